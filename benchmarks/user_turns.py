"""What one pass waits for the users' managers: one after another, or in parallel in
one turn (issue 40, item 1).

Each user's manager is asked a pass's questions (sense/asking.ask: ListJobs, and
ListUnitsByNames for the start job it answers) on connections of its own. Asked one
after another, a pass waits the sum of their answers; asked by Turns.ask_all, a
worker each (at most asking.WORKERS at once), the loop waits for the slowest, and
never past asking.USER_TURN: what is not back by then is left pending.

The managers are lab/churn.py's: each a small D-Bus peer run as its own uid in its
user@UID.service cgroup, believed as the guard believes a manager, answering each
question after `slow` seconds (0: as fast as it can).

Run as root where the test harness works (lab/harness.py):

    .venv/bin/python -m benchmarks.user_turns [--passes 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from lab.churn import Churn
from lab.harness import UserManager
from spark_guard.sense.asking import USER_TURN, Question, Turns, ask
from spark_guard.system.managers import Manager


def measure(root: UserManager, users: int, slow: float, passes: int, first_uid: int) -> str:
    churn = Churn(root, users=users, loaders=0, first_uid=first_uid, slow=slow)
    managers: list[Manager] = []
    try:
        for u in churn.users:
            u.send("up")
        for u in churn.users:
            m = Manager(u.key, str(root.user_runtime / str(u.uid) / "systemd" / "private"))
            m.connect()
            managers.append(m)
        q = Question((), lambda _: False)  # (its start job: no details wanted)
        serial, parallel, pending = [], [], 0
        for _ in range(passes):
            began = time.perf_counter()
            for m in managers:
                ask(m, q)
            serial.append(time.perf_counter() - began)
            turns = Turns()
            began = time.perf_counter()
            _, failed, late = turns.ask_all({m.key: (m, q) for m in managers})
            parallel.append(time.perf_counter() - began)
            turns.close(wait=True)  # (those left pending are done before the next pass)
            assert not failed, failed
            pending += len(late)
        return (
            f"| {users} | {slow:g} | {statistics.median(serial) * 1000:.1f}"
            f" | {statistics.median(parallel) * 1000:.1f} | {pending / passes:.1f} |"
        )
    finally:
        for m in managers:
            m.close()
        churn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    rows = []
    with UserManager() as root:
        (root.base / "models").mkdir(exist_ok=True)  # (Churn's loaders' model: none here)
        uid = 63000
        for users in (1, 4, 16):
            for slow in (0.0, 0.2):
                rows.append(measure(root, users, slow, args.passes, uid))
                uid += users
    print(f"USER_TURN = {USER_TURN:g} s")
    print("| users | each answer, s | one after another, ms | one turn, ms | left pending |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
