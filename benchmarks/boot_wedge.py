"""The wedge at boot, four ways: no guard, earlyoom, systemd-oomd, spark-guard.

    .venv/bin/python -m benchmarks.boot_wedge [--seconds 180] [--only spark-guard ...]

As root, after `scripts/deps --test` (qemu, mmdebstrap). Each protection
gets a fresh copy of the same Debian 12 image (lab/vm.py), the same
layout (lab/wedge.py: a system loader, the same loader as a linger user's
unit, an idle server; Restart=on-failure on all), the same 2 GiB of memory,
and is watched for --seconds after sshd first lets the host in. The VM's
memory is the cap that keeps the unguarded run from touching the host; qemu
is killed at the end of every run. Prints the table for docs/benchmarks.md
and writes every sample to --json.

With spark-guard, the same boot then meets the loader that fights back
(lab/wedge.py `fight`: ignores SIGTERM, allocates flat out, started by hand
after the wedge): a second table says how far MemAvailable fell and how fast
the guard froze and killed it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from lab.vm import VM
from lab.wedge import (
    FIGHT_MIB,
    PROTECTIONS,
    RESERVE_MIB,
    UNITS,
    Fight,
    MiB,
    Run,
    collect,
    fight,
    observe,
    prepare,
)

ROOT = Path(__file__).resolve().parent.parent


def build_deb() -> Path:
    out = subprocess.run(
        [str(ROOT / "packaging" / "build-deb.sh")], capture_output=True, text=True, check=True
    )
    return ROOT / out.stdout.strip().splitlines()[-1]


def one(protection: str, deb: Path, seconds: float) -> tuple[Run, Fight | None]:
    run = Run(protection)
    fought = None
    with VM(memory_mib=2048) as vm:
        prepare(vm, protection, deb)
        observe(vm, run, seconds)
        collect(vm, run)
        if protection == "spark-guard" and run.ssh_at_end:
            fought = fight(vm)
    return run, fought


def fight_table(f: Fight) -> str:
    """The loader that fights back: one column of figures, Markdown."""
    kill = f.killed[0] if f.killed else None
    thaw = f.thaw_check.split()
    rows = [
        "| the loader that fights back | spark-guard |",
        "|---|---|",
        f"| MemAvailable when it was started | {f.available_before / MiB:.0f} MiB |",
        f"| what it allocates | {FIGHT_MIB} MiB, flat out, SIGTERM ignored |",
        f"| lowest MemAvailable (reserve {RESERVE_MIB} MiB) | {f.min_available / MiB:.0f} MiB |",
        "| start to the brake's freeze (before any decision) | "
        + (f"{f.braked - f.started:.2f} s ({f.brake_why}) |" if f.braked else "none |"),
        "| start to the guard's decision | "
        + (f"{f.decided - f.started:.2f} s ({f.reason}) |" if f.decided else "none |"),
        "| frozen before the stop | "
        + ("yes" if f.frozen == "True" else f"no ({f.frozen})") + " |",
        "| decision to SIGKILL | "
        + (f"{(kill[0] - f.decided) * 1000:.0f} ms, {kill[1]}: {kill[2]} |" if kill and f.decided
           else "none |"),
        "| decision to unit stopped | "
        + (f"{(f.stopped - f.decided) * 1000:.0f} ms |" if f.stopped and f.decided else "? |"),
        f"| probe samples in the window | {len(f.samples)} |",
        f"| worst fork+exec+wait / probe late / gap | {f.worst_fork_ms:.0f} ms / "
        f"{f.worst_stall_ms:.0f} ms / {f.worst_gap_s:.2f} s |",
        f"| ssh logins in the window (ok / tried) | {f.logins_ok} / {len(f.logins)} |",
        f"| PSI wakes of the guard in the window (before its poll) | {len(f.wakes_in_window)} "
        f"({sum(w[1] < w[2] for w in f.wakes_in_window)}) |",
        f"| kernel OOM kills | {f.kernel_kills} |",
        f"| unit afterwards (active/load/file) | {state(f.unit)}, NRestarts "
        f"{f.unit.get('NRestarts', '?')} |",
        "| PID 1's llama-server afterwards (same run as before) | "
        + state(f.bystander[1])
        + (", same run" if f.bystander[1].get("ExecMainStartTimestampMonotonic")
           == f.bystander[0].get("ExecMainStartTimestampMonotonic") else ", RESTARTED")
        + " |",
        "| systemd stops a frozen unit (SIGTERM handler exits) | "
        + (f"{thaw[0]} before, stopped in {float(thaw[2]) - float(thaw[1]):.2f} s |"
           if len(thaw) == 3 else f"? ({f.thaw_check!r}) |"),
    ]  # fmt: skip
    return "\n".join(rows)


def state(unit: dict[str, str]) -> str:
    if not unit:
        return "?"
    return "/".join(unit.get(k, "?") for k in ("ActiveState", "LoadState", "UnitFileState"))


def table(runs: list[Run]) -> str:
    rows = [
        "| | " + " | ".join(r.protection for r in runs) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]

    def row(name: str, cells: list[str]) -> None:
        rows.append(f"| {name} | " + " | ".join(cells) + " |")

    row(
        "ssh logins failed / tried, after the first",
        [f"{r.ssh_failures} / {len(r.logins_after_up)}" for r in runs],
    )
    row("longest time without a login", [f"{r.longest_ssh_gap:.1f} s" for r in runs])
    row(
        "logins during the load window",
        [str(r.logins_in_load_window) if r.load_window else "?" for r in runs],
    )
    row("ssh at the end", ["yes" if r.ssh_at_end else "no" for r in runs])
    row("worst fork+exec+wait", [f"{r.worst_fork_ms:.0f} ms" for r in runs])
    row("worst probe stall (fork or late)", [f"{r.worst_stall_ms:.0f} ms" for r in runs])
    row(
        "worst fork+exec+wait in the load window",
        [f"{r.worst_fork_in_window_ms:.0f} ms" if r.load_window else "?" for r in runs],
    )
    row("median fork+exec+wait", [f"{r.median_fork_ms:.0f} ms" for r in runs])
    row("min MemAvailable", [f"{r.min_available / MiB:.0f} MiB" for r in runs])
    row(
        "kills (kernel OOM / earlyoom / oomd)",
        [
            "/".join(
                str(n) if (n := r.kills.get(k, -1)) >= 0 else "?"  # ?: the guest did not answer
                for k in ("kernel", "earlyoom", "systemd-oomd")
            )
            for r in runs
        ],
    )
    row("units stopped by spark-guard", [str(r.guard_stops) for r in runs])
    row("loader restarts (NRestarts, all units)", [str(r.restarts) for r in runs])
    for level, unit in UNITS:
        key = f"{level}:{unit}"
        row(f"`{key}` active/load/file state", [state(r.units.get(key, {})) for r in runs])
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--only", nargs="*", choices=PROTECTIONS, default=list(PROTECTIONS))
    ap.add_argument("--json", type=Path, default=Path("/var/tmp/boot_wedge.json"))
    args = ap.parse_args()
    deb = build_deb()
    runs = []
    fights = []
    for protection in args.only:
        print(f"== {protection}", file=sys.stderr, flush=True)
        run, fought = one(protection, deb, args.seconds)
        runs.append(run)
        if fought is not None:
            fights.append(fought)
        args.json.write_text(
            json.dumps({"runs": [asdict(r) for r in runs], "fights": [asdict(f) for f in fights]})
        )
    print(table(runs))
    for fought in fights:
        print()
        print(fight_table(fought))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
