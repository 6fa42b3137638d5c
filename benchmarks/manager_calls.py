"""What a call to a user's manager costs on a connection of its own (issue 40, H1).

A user's manager is asked with dbuswire.call() on a fresh connection each time
(connect, handshake, call, close), so nothing she makes it send is left queued
in the guard. This measures that against one connection held open (pystemd, as
PID 1 is asked), on real user managers:

  held       ListUnitsByNames on one pystemd connection (root's user manager,
             asked as PID 1 is)
  wire       the same, a connection each (what the guard does for a user)
  details    what a new unit costs: ExecStart=, ExecStartPost=, Environment=, User=
             and two timestamps, six calls held or six replies on one connection
  connect    connecting and believing the manager of a real unprivileged user:
             the handshake, the checks (PID 1's vouching left out: no PID 1
             here), and the first call on a connection only her manager holds
             the other end of (answerer.py)

Run as root where the test harness works (lab/harness.py):

    .venv/bin/python -m benchmarks.manager_calls [--calls 500]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from lab.accounts import unprivileged_user
from lab.harness import UserManager
from spark_guard.core.snapshot import SYSTEM
from spark_guard.system.managers import Manager


def timed(n: int, call: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(n):
        began = time.perf_counter()
        call()
        out.append((time.perf_counter() - began) * 1000)
    return out


def row(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"| {name} | {statistics.median(ms):.2f} | {p99:.2f} | {len(ms)} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    with (
        UserManager() as root,
        unprivileged_user() as user,
        UserManager(user=user, user_runtime=root.user_runtime) as um,
    ):
        names = ["default.target", "basic.target", "no-such.service"]
        root.write_unit("bench.service", "[Service]\nExecStart=/bin/sleep 1 -m /m.gguf\n")
        # PID 1's way: one pystemd connection held open (a Manager keyed SYSTEM).
        held = Manager(SYSTEM, str(root.socket))
        held.connect()
        wire = Manager("user:0", str(root.socket))
        wire.connect()

        def connect() -> None:
            Manager(f"user:{user.uid}", str(um.socket)).connect()

        try:
            rows = [
                row(
                    "held (pystemd, one connection)",
                    timed(args.calls, lambda: held.unit_states(names)),
                ),
                row("wire (a connection each)", timed(args.calls, lambda: wire.unit_states(names))),
                row(
                    "a unit's details, held (6 properties, 6 calls)",
                    timed(args.calls, lambda: held.unit_details("bench.service")),
                ),
                row(
                    "a unit's details, wire (6 properties, one connection)",
                    timed(args.calls, lambda: wire.unit_details("bench.service")),
                ),
                row("connect and believe her manager", timed(max(args.calls // 10, 10), connect)),
            ]
        finally:
            held.close()
            wire.close()
    print("| call | median ms | p99 ms | calls |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
