"""The boot wedge with a loader container: dockerd's restart policy, with spark-guard and without.

    .venv/bin/python -m benchmarks.container_wedge [--seconds 120] [--mib 2048] [--only none]

As root, after `scripts/deps --test` (qemu, mmdebstrap). Each run gets a fresh
copy of the same Debian 12 image (lab/vm.py) with 2 GiB of memory and the
container layout (lab/containers_vm.py): dockerd enabled; `vllm`
(`vllm/vllm-openai:test`, `--restart unless-stopped`) and `keep`
(`ollama/ollama:test`, `--restart always`, 50 MiB). A first boot, not
measured, creates the containers (with a load that fits) and then gives
`vllm` its real load: --mib at 100 MiB/s after 5 s, more than the VM has.
The second boot is the one measured, as benchmarks/boot_wedge.py measures:
ssh logins from the host every second for --seconds after sshd first lets
the host in, the in-guest probe (lab/probe.py) on the second serial port.

"none": the guard is not installed. "spark-guard": installed from the .deb,
enabled for the second boot, with `container:vllm` at --mib + 50 MiB (as an
admin who measured it would write it), `keep` protected, a 200 MiB reserve.
Prints the column for docs/benchmarks.md, then (on stderr) the loader's own output
and the kernel's OOM lines of each run; every sample goes to --json. About 9.5
minutes for both (2 CPUs, TCG).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.boot_wedge import build_deb
from lab import containers_vm as cv
from lab.vm import VM
from lab.wedge import MiB, Run, observe

PROTECTIONS = ("none", "spark-guard")


def one(protection: str, deb: Path, seconds: float, mib: int) -> Run:
    run = Run(protection)
    guard = protection == "spark-guard"
    with VM(memory_mib=2048) as vm:
        config = cv.guard_config(footprint=f"{mib + 50}MiB")
        cv.prepare(vm, deb if guard else None, config=config, loader=(0, 100, 0), probe=True)
        vm.boot(snapshot=False)
        cv.create(vm)
        both = "[ $(docker ps -q | wc -l) = 2 ]"
        if not cv.wait_for(vm, both, 60):
            raise RuntimeError(f"the containers did not start:\n{cv.docker_log(vm)}")
        cv.set_load(vm, cv.WAIT_S, mib, cv.LOAD_RATE)
        if guard:
            cv.enable_guard(vm)
        vm.poweroff()
        observe(vm, run, seconds, snapshot=False)
        collect(vm, run)
    return run


def collect(vm: VM, run: Run) -> None:
    """Container states (restarts as NRestarts), kills and the guard's journal, over ssh."""
    for _ in range(10):
        if vm.ssh("true", check=False, timeout=60, connect=20).returncode == 0:
            run.ssh_at_end = True
            break
        time.sleep(5)
    if not run.ssh_at_end:
        return
    for name in (cv.LOADER, cv.KEEP):
        found = cv.state(vm, name)
        found["NRestarts"] = found.get("RestartCount", "?")
        run.units[f"container:{name}"] = found
    run.kills = {"kernel": cv.kernel_kills(vm)}
    # How the loader's runs ended: its own output (journald log driver) and the kernel's.
    run.units["loader-log"] = {
        "tail": vm.ssh(
            f"journalctl -b -q -o cat CONTAINER_NAME={cv.LOADER} --no-pager | tail -n 20; "
            "journalctl -b -k -q -o cat --no-pager | grep -i -E 'oom|out of memory' | tail -n 20",
            check=False,
            timeout=60,
        ).stdout
    }
    run.guard_log = cv.guard_log(vm)
    run.guard_stops = sum(
        e.get("SG_EVENT") == "unit-stop-requested" for e in cv.events(vm, f"container:{cv.LOADER}")
    )


def column(runs: list[Run], mib: int) -> str:
    rows = [
        f"| a loader container at boot ({mib} MiB, unless-stopped) | "
        + " | ".join(r.protection for r in runs)
        + " |",
        "|---" * (len(runs) + 1) + "|",
    ]

    def row(name: str, cells: list[str]) -> None:
        rows.append(f"| {name} | " + " | ".join(cells) + " |")

    row(
        "ssh logins failed / tried, after the first",
        [f"{r.ssh_failures} / {len(r.logins_after_up)}" for r in runs],
    )
    row("longest time without a login", [f"{r.longest_ssh_gap:.1f} s" for r in runs])
    row("ssh at the end", ["yes" if r.ssh_at_end else "no" for r in runs])
    row("worst fork+exec+wait", [f"{r.worst_fork_ms:.0f} ms" for r in runs])
    row("worst probe stall (fork or late)", [f"{r.worst_stall_ms:.0f} ms" for r in runs])
    row("min MemAvailable", [f"{r.min_available / MiB:.0f} MiB" for r in runs])
    row("kernel OOM kills", [str(r.kills.get("kernel", "?")) for r in runs])
    row("container stops by spark-guard", [str(r.guard_stops) for r in runs])
    for name in (cv.LOADER, cv.KEEP):
        cells = []
        for r in runs:
            c = r.units.get(f"container:{name}", {})
            cells.append(
                f"{c.get('Status', '?')}, policy {c.get('RestartPolicy', '?')}, "
                f"RestartCount {c.get('RestartCount', '?')}, OOMKilled {c.get('OOMKilled', '?')}"
                if c
                else "?"
            )
        row(f"`container:{name}` afterwards", cells)
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--mib", type=int, default=2048, help="what vllm allocates")
    ap.add_argument("--only", nargs="*", choices=PROTECTIONS, default=list(PROTECTIONS))
    ap.add_argument("--json", type=Path, default=Path("/var/tmp/container_wedge.json"))
    args = ap.parse_args()
    deb = build_deb()
    runs = []
    for protection in args.only:
        print(f"== {protection}", file=sys.stderr, flush=True)
        runs.append(one(protection, deb, args.seconds, args.mib))
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs]}))
    for r in runs:
        print(f"== {r.protection}: the loader's output, the kernel's OOM lines", file=sys.stderr)
        print(r.units.get("loader-log", {}).get("tail", ""), file=sys.stderr)
    print(column(runs, args.mib))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
