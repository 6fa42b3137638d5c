"""How fast a decision becomes a block that holds, on a real systemd user manager.

For each of N runs: an enabled loader unit (Restart=always) allocates memory,
the guard's own sensor takes a snapshot, step() says stop, and the
blocker acts for real. Four times are taken from the moment
step() returned (nothing runs between it and act()):

  stop call   StopUnit has been answered by the manager
  exited      the loader's main process is gone (a pidfd, watched from a thread)
  inactive    the guard has read ActiveState=inactive (it polls every 20 ms)
  verified    LoadState=masked was read back (after the daemon-reload it needs)

(systemd's InactiveEnterTimestamp cannot serve: the reload that loads the
mask drops a masked unit's timestamps.)

The unit is then released and the next run starts. Run as root on a host
where the test harness works (see lab/harness.py):

    .venv/bin/python -m benchmarks.block_latency [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lab import LAB
from lab.harness import UserManager
from spark_guard.act import act
from spark_guard.block.blocker import Blocker
from spark_guard.block.records import RecordStore
from spark_guard.block.release import release
from spark_guard.core.config import Config
from spark_guard.core.step import GuardState, step
from spark_guard.sense import Sensor

UNIT = "llama-bench.service"


def watch_exit(pid: int, out: list[float]) -> threading.Thread:
    fd = os.pidfd_open(pid)

    def wait() -> None:
        select.select([fd], [], [])
        out.append(time.monotonic())
        os.close(fd)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


class TimingLog:
    """Stands in for the structlog logger: keeps when each event first happened."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.problems: list[str] = []

    def _event(self, event: str, **fields: object) -> None:
        self.times.setdefault(event, time.monotonic())
        if event in ("block-failed", "unit-stop-failed"):
            self.problems.append(str(fields.get("msg")))

    debug = info = warning = error = _event


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--alloc", type=int, default=256, help="MiB the loader holds")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sg-bench.") as tmp, UserManager() as um:
        work = Path(tmp)
        config = Config(
            system_manager="/nonexistent/systemd/private",
            user_runtime=str(um.user_runtime),
            state=str(work / "state"),
            motd=str(work / "motd"),
            issue=str(work / "issue"),
            rescue_units=("rescue-none.service",),
            rescue_graphical="no",
            grace=3600.0,
            gpu=False,
            footprint={UNIT: 100 * 1024**4},
        )
        um.write_unit(
            UNIT,
            f"[Service]\nExecStart={sys.executable} {LAB}/fake_loader.py "
            f"--alloc {args.alloc}\nRestart=always\nLimitAS=4G\n"
            "[Install]\nWantedBy=default.target\n",
        )
        um.systemctl("enable", UNIT)
        for _ in range(args.runs):
            um.systemctl("start", UNIT)
            um.wait_for(UNIT, "ActiveState", "active")
            time.sleep(0.3 + args.alloc / 2000)  # let it allocate
            log: Any = TimingLog()  # duck-types structlog's logger: the calls the guard makes
            sensor = Sensor(config, log)
            sensor.refresh_managers()
            blocker = Blocker(sensor.managers, config, log)
            exited: list[float] = []
            watcher = watch_exit(int(um.show(UNIT, "MainPID")["MainPID"]), exited)
            outcome = step(GuardState(), sensor.snapshot(), config, dry_run=False)
            decision = outcome.decision
            t0 = time.monotonic()  # the clock starts when step() returns
            act(outcome, blocker, log)
            assert [str(a.unit) for a in decision.actions] == [f"user:0:{UNIT}"], decision
            watcher.join(timeout=10)
            assert not log.problems, log.problems
            rows.append(
                (
                    log.times["unit-stop-requested"] - t0,
                    exited[0] - t0,
                    log.times["unit-stopped"] - t0,
                    log.times["unit-blocked"] - t0,
                )
            )
            sensor.close()
            store = RecordStore(config.state)
            (record,), _ = store.all()
            release(record, store, config.system_manager, config.user_runtime)
    # The table as docs/benchmarks.md shows it, pasted unedited.
    print(f"{args.runs} runs, loader holding {args.alloc} MiB, times from step()'s return:")
    print()
    print("| step | median | worst |")
    print("|---|---|---|")
    steps = (
        "StopUnit answered by the manager",
        "loader's main process exited (pidfd)",
        "guard read `ActiveState=inactive`",
        "block verified (`LoadState=masked`)",
    )
    for i, name in enumerate(steps):
        values = [r[i] * 1000 for r in rows]
        print(f"| {name} | {statistics.median(values):.1f} ms | {max(values):.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
