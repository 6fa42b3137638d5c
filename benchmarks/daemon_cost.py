"""The guard's own cost against earlyoom and nohang, measured the same way on the same machine.

    .venv/bin/python -m benchmarks.daemon_cost [--idle 60]

Each daemon runs with its default settings: earlyoom and nohang from
Debian's packages (installed here if missing), spark-guard as a Type=notify
unit of a harness user manager (lab/harness.py), watching that manager.
Measured from /proc: RSS and PSS (smaps_rollup) after 10 s, idle CPU
(utime+stime) over --idle seconds; for spark-guard also exec-to-READY=1
(systemd's ExecMainStartTimestampMonotonic to ActiveEnterTimestampMonotonic)
and RSS/PSS after it blocked a loader.

Goals: exec to READY=1 under 200 ms; RSS no higher than nohang's and at most
32 MiB (the guard's budget, tests/test_budget.py); idle CPU no higher than
earlyoom's; 600 MiB above its reserve (a quiet pass every poll.min), at most
0.25 % of a core. Exits non-zero when a goal is missed, and names it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import time

from lab.guardunit import GUARD, guard_manager, loader_unit, restart_guard, wait_log, write_config
from spark_guard.system.procfs import ProcFS

TICK = os.sysconf("SC_CLK_TCK")


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
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


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


def measure_guard(idle: float) -> dict[str, float]:
    with guard_manager() as um:
        write_config(um, grace="0s")  # steady: boot is over, the idle case
        um.systemctl("start", "rescue-ssh.service")
        restart_guard(um)
        p = um.show(
            GUARD, "MainPID", "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic"
        )
        pid = int(p["MainPID"])
        ready = (
            int(p["ActiveEnterTimestampMonotonic"]) - int(p["ExecMainStartTimestampMonotonic"])
        ) / 1000
        time.sleep(10)
        rss, pss = memory(pid)
        cpu = idle_cpu(pid, idle)
        # Near the reserve the quiet pass comes every poll.min (policy.FILL_RATE: a loader at
        # 6 GB/s could take the headroom before a longer wait ends): 600 MiB above it here.
        reserve_mib = ProcFS().memory().available // 2**20 - NEAR_MIB
        write_config(
            um, f'[budget]\nreserve = "{reserve_mib}MiB"\nreserve_percent = 0\n', grace="0s"
        )
        um.systemctl("reload", GUARD)
        time.sleep(3)
        cpu_near = idle_cpu(pid, idle)
        offset = len(um.log.read_text())
        # An action: a reserve no machine has, so the steady guard stops the next loader.
        write_config(um, '[budget]\nreserve = "100TiB"\n', grace="0s")
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
        "exec to READY under 200 ms": ours["ready_ms"] < 200,
        "RSS no higher than nohang's": ours["rss"] <= rows["nohang"]["rss"],
        "RSS at most 32 MiB, also after a block": max(ours["rss"], ours["rss_after"]) <= 32 * 1024,
        "idle CPU no higher than earlyoom's": ours["cpu"] <= rows["earlyoom"]["cpu"],
        # A Spark holding its model near the reserve sits there all day (issue 25).
        "near the reserve at most 0.25 % of a core": ours["cpu_near"] <= 0.25,
    }
    print(
        f"\nspark-guard {NEAR_MIB} MiB above its reserve (a quiet pass every poll.min): "
        f"idle CPU {ours['cpu_near']:.3f} % over {args.idle:g} s"
    )
    missed = [goal for goal, met in goals.items() if not met]
    print("\ngoals missed: " + "; ".join(missed) if missed else "\nall goals met")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
