"""The guard's own cost against earlyoom and nohang, measured the same way on the same machine.

    .venv/bin/python -m benchmarks.daemon_cost [--idle 60]

Each daemon runs with its default settings: earlyoom and nohang from
Debian's packages (installed here if missing), spark-guard as a Type=notify
unit of a harness user manager (lab/harness.py), watching that manager,
with the shipped polls (poll.max 2 s; the tests' 0.5 s is for their speed).
Measured from /proc: RSS and PSS (smaps_rollup) after 10 s, idle CPU
(every thread's schedstat, in ns) over --idle seconds; for spark-guard also exec-to-READY=1
(systemd's ExecMainStartTimestampMonotonic to ActiveEnterTimestampMonotonic)
and RSS/PSS after it blocked a loader.

Goals: exec to READY=1 under 200 ms; RSS no higher than nohang's and at most
30 MiB (the guard's budget, tests/test_budget.py); idle CPU no higher than
earlyoom's; 600 MiB above a Spark's reserve (8.52 GiB; a process holds the
rest of this machine's memory), at most 0.25 % of a core. Exits non-zero
when a goal is missed, and names it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import spark_guard
from lab.guardunit import GUARD, guard_manager, loader_unit, restart_guard, wait_log, write_config
from lab.harness import UserManager
from spark_guard.core.config import Config
from spark_guard.system.procfs import ProcFS


def memory(pid: int) -> tuple[int, int]:
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss  # kB


def cpu_seconds(pid: int) -> float:
    """utime+stime of every thread, from schedstat: nanoseconds, where /proc/PID/stat counts
    10 ms ticks (0.017 % of a core in 60 s is one tick; ten short wake-ups a second may
    fall between ticks or on them)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def idle_cpu(pid: int, seconds: float) -> float:
    start = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - start) / seconds * 100  # percent of one core


def ensure(packages: list[str]) -> None:
    missing = [p for p in packages if shutil.which(p) is None]
    if missing:
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", *missing], check=True, stdout=subprocess.DEVNULL
        )


def measure_process(argv: list[str], idle: float) -> dict[str, float]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(10)
        rss, pss = memory(proc.pid)
        cpu = idle_cpu(proc.pid, idle)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    return {"rss": rss, "pss": pss, "cpu": cpu}


NEAR_MIB = 600
# A DGX Spark's MemTotal (field notes 1a) and so its default reserve: max(8 GiB, 7 %).
SPARK_TOTAL = int(121.69 * 2**30)


@contextlib.contextmanager
def holding(nbytes: int) -> Iterator[None]:
    """A process that holds `nbytes` of touched anonymous memory until the block ends, so
    that MemAvailable here stands where a Spark's stands with its model loaded."""
    code = (
        "import mmap, sys, time\n"
        f"m = mmap.mmap(-1, {nbytes})\n"
        f"for i in range(0, {nbytes}, mmap.PAGESIZE): m[i] = 1\n"
        "print('held', flush=True)\n"
        "time.sleep(1e6)\n"
    )
    hog = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline() == "held\n"
        time.sleep(2)  # the kernel settles (kswapd, the page cache it gave up)
        yield
    finally:
        hog.kill()
        hog.wait()


READY_RUNS = 7


def ready_ms(um: UserManager) -> float:
    """Exec to READY=1 of the last start, by systemd's own timestamps."""
    p = um.show(GUARD, "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    return (
        int(p["ActiveEnterTimestampMonotonic"]) - int(p["ExecMainStartTimestampMonotonic"])
    ) / 1000


def measure_guard(idle: float) -> dict[str, float]:
    # The .deb byte-compiles the package at install (dh_python3's py3compile); a checkout
    # run with PYTHONDONTWRITEBYTECODE (set on this workplace) compiles every module at
    # each start instead: about 60 ms more to READY. Measure what is installed.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(Path(spark_guard.__file__).parent)],
        check=True,
    )
    with guard_manager() as um:
        # Steady (boot is over), the idle case, with the shipped polls (the tests' are faster).
        write_config(um, grace="0s", fast=False)
        um.systemctl("start", "rescue-ssh.service")
        readies = []
        for _ in range(READY_RUNS):  # its spread: one start says little
            restart_guard(um)
            readies.append(ready_ms(um))
            time.sleep(2)
            um.systemctl("reset-failed", GUARD, check=False)  # no start limit between runs
        pid = int(um.show(GUARD, "MainPID")["MainPID"])
        ready = statistics.median(readies)
        print(
            f"spark-guard exec to READY over {READY_RUNS} starts: median {ready:.0f} ms, "
            f"{min(readies):.0f}-{max(readies):.0f} ms"
        )
        time.sleep(10)
        rss, pss = memory(pid)
        cpu = idle_cpu(pid, idle)
        # Near the reserve: a Spark holding its model 600 MiB above its reserve. The quiet
        # pass comes as often as policy.FILL_RATE and FILL_SLACK ask: the reserve is a
        # Spark's, and a process holds what this machine has beyond it.
        reserve = Config().reserve_for(SPARK_TOTAL)
        spare = ProcFS().memory().available - reserve - NEAR_MIB * 2**20
        with holding(max(spare, 0)):
            reserve_mib = ProcFS().memory().available // 2**20 - NEAR_MIB
            write_config(
                um,
                f'[budget]\nreserve = "{reserve_mib}MiB"\nreserve_percent = 0\n',
                grace="0s",
                fast=False,
            )
            um.systemctl("reload", GUARD)
            time.sleep(3)
            cpu_near = idle_cpu(pid, idle)
        offset = len(um.log.read_text())
        # An action: a reserve no machine has, so the steady guard stops the next loader.
        write_config(um, '[budget]\nreserve = "100TiB"\n', grace="0s", fast=False)
        um.systemctl("reload", GUARD)
        loader_unit(um, "llama-cost.service", 50)
        um.systemctl("start", "llama-cost.service")
        wait_log(um, r"^warning unit-blocked: user:0:llama-cost.service", after=offset)
        time.sleep(2)
        rss_after, pss_after = memory(pid)
    return {
        "rss": rss,
        "pss": pss,
        "cpu": cpu,
        "cpu_near": cpu_near,
        "ready_ms": ready,
        "rss_after": rss_after,
        "pss_after": pss_after,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=float, default=60.0)
    args = ap.parse_args()
    ensure(["earlyoom", "nohang"])
    rows = {
        "earlyoom": measure_process(["earlyoom"], args.idle),
        "nohang": measure_process(
            ["nohang", "--monitor", "--config", "/etc/nohang/nohang.conf"], args.idle
        ),
        "spark-guard": measure_guard(args.idle),
    }
    print(f"| daemon | RSS | PSS | idle CPU ({args.idle:g} s) | exec to READY | after a block |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        ready = f"{r['ready_ms']:.0f} ms" if "ready_ms" in r else "-"
        after = (
            f"{r['rss_after'] / 1024:.1f} / {r['pss_after'] / 1024:.1f} MB"
            if "rss_after" in r
            else "-"
        )
        print(
            f"| {name} | {r['rss'] / 1024:.1f} MB | {r['pss'] / 1024:.1f} MB | "
            f"{r['cpu']:.3f} % | {ready} | {after} |"
        )
    ours = rows["spark-guard"]
    goals = {
        "exec to READY under 200 ms (median)": ours["ready_ms"] < 200,
        "RSS no higher than nohang's": ours["rss"] <= rows["nohang"]["rss"],
        "RSS at most 30 MiB, also after a block": max(ours["rss"], ours["rss_after"]) <= 30 * 1024,
        "idle CPU no higher than earlyoom's": ours["cpu"] <= rows["earlyoom"]["cpu"],
        # A Spark holding its model near the reserve sits there all day (issue 25).
        "near the reserve at most 0.25 % of a core": ours["cpu_near"] <= 0.25,
    }
    print(
        f"\nspark-guard {NEAR_MIB} MiB above a Spark's reserve "
        f"({Config().reserve_for(SPARK_TOTAL) / 2**30:.2f} GiB, the rest held): "
        f"idle CPU {ours['cpu_near']:.3f} % over {args.idle:g} s"
    )
    missed = [goal for goal, met in goals.items() if not met]
    print("\ngoals missed: " + "; ".join(missed) if missed else "\nall goals met")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
