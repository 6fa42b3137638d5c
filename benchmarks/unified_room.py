"""Making room on unified memory, with the guard's make-room and without (issue 25).

    .venv/bin/python -m benchmarks.unified_room

Two boots of the 2 GiB VM of tests/test_vm_unified.py (lab/unified.py): a 1.2 GiB
page-cache flood, a loader that fits (reads 300 MiB, allocates 600 MiB), one that does
not (1.5 GiB). The guard runs in both, told `unified = "yes"`; in the second its
`make_room` is off, so MemFree alone is judged and nothing drops the cache. Measured:
min MemFree through the flood and the fitting load, from the first time MemFree was
under the floor to the end of the first reclaim, the guard's CPU over the run, what
became of each loader. Prints one Markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.boot_wedge import build_deb
from lab.unified import FLOOR_MIB, METHOD_MIB, MiB, Outcome, methods, prepare, run
from lab.vm import VM


def measure(deb: Path, make_room: bool) -> tuple[Outcome, dict[str, tuple[float, float, str]]]:
    with VM(memory_mib=2048) as vm:
        prepare(vm, deb, make_room=make_room)
        out = run(vm)
        return out, (methods(vm) if make_room else {})


def first_reclaim(out: Outcome) -> str:
    crossed = out.first_under(FLOOR_MIB * MiB, out.marks["flood"])
    if crossed is None:
        return "never under the floor"
    if not out.rooms:
        return "no reclaim"
    done = int(str(out.rooms[0]["__MONOTONIC_TIMESTAMP"])) / 1e6
    return f"{(done - crossed) * 1000:.0f} ms"


def fate(unit: dict[str, str]) -> str:
    return f"{unit.get('ActiveState')}/{unit.get('LoadState')}"


def main() -> int:
    deb = build_deb()
    on, ways = measure(deb, True)
    off, _ = measure(deb, False)
    rows = {"make-room on": on, "make-room off": off}
    print(
        "| guard | min MemFree (flood + fitting load) | floor to first reclaim | reclaims | "
        "guard CPU | fitting loader | loader that does not fit | OOM kills |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, out in rows.items():
        held = out.window("flood", "big")
        low = min(s.free for s in held) / MiB if held else float("nan")
        span = out.marks["end"] - out.marks["flood"]
        print(
            f"| {name} | {low:.0f} MiB (floor {FLOOR_MIB}) | {first_reclaim(out)} | "
            f"{len(out.rooms)} | {out.guard_cpu_s:.2f} s in {span:.0f} s "
            f"({out.guard_cpu_s / span * 100:.1f} %) | {fate(out.units['llama-fit.service'])} | "
            f"{fate(out.units['llama-big.service'])} | {out.kernel_kills} |"
        )
    print(f"\n| way of dropping {METHOD_MIB} MiB of clean cache | dropped | time | said |")
    print("|---|---|---|---|")
    for name, (mib, seconds, said) in ways.items():
        print(f"| {name} | {mib:.0f} MiB | {seconds * 1000:.0f} ms | {said} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
