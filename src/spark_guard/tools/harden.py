"""The drop-in `spark-guard harden` writes for a loader unit: plain text from plain data.

It bounds what can be bounded (CPU-side memory, restarts), orders the
loader after the rescue units, and makes it the kernel OOM killer's first choice.
MemoryMax= does not bound GPU memory on a unified-memory machine
(cudaMalloc is not charged to the cgroup): that is what the guard is for.
"""

from __future__ import annotations

from ..core.config import Config
from ..core.snapshot import SYSTEM

MARKER = "# Written by spark-guard harden"
DROP_IN = "50-spark-guard.conf"
NOTE = (
    "MemoryMax= bounds CPU-side memory only: on a unified-memory machine (DGX Spark, GB10) "
    "GPU allocations are not charged to the cgroup. spark-guard watches MemAvailable for "
    "that part."
)


def memory_max(mem_total: int, reserve: int, expected: int | None) -> int:
    """The loader's expected footprint plus a tenth, never more than all but the reserve."""
    ceiling = mem_total - reserve
    if expected is None:
        return ceiling
    return min(ceiling, int(expected * 1.1))


def rescue_units(config: Config) -> list[str]:
    return [n for group in config.rescue_units for n in group.split("|") if "*" not in n]


# On unified memory a system loader makes room before it loads, in place of the field's
# `ExecStartPre=... echo 1 > /proc/sys/vm/drop_caches`: '+' runs it as root whatever the
# unit's User= ('--make-room' refuses anyone else), '-' lets the load start whatever the
# verdict (the guard itself judges the load as it runs).
MAKE_ROOM = "ExecStartPre=-+/usr/bin/spark-guard preflight --make-room %n"


def makes_room(manager: str, config: Config, *, unified: bool) -> bool:
    """Whether the drop-in makes room before the load (MAKE_ROOM): on unified memory, where
    `[memory] make_room` allows it, for a system unit only: room is made as root, and a
    user's unit is the guard's to make room for."""
    return manager == SYSTEM and config.make_room and unified


def drop_in(
    unit: str, config: Config, max_bytes: int, why: str, when: str, *, make_room: bool = False
) -> str:
    after = " ".join(rescue_units(config))
    room = (
        "# Unified memory: drop clean page cache and compact for the load first; a GPU\n"
        "# allocation gets MemFree, which the page cache takes (docs/unified-memory.md).\n"
        f"{MAKE_ROOM}\n"
        if make_room
        else ""
    )
    return f"""{MARKER} on {when} for {unit}.
# Undo: spark-guard harden --undo {unit}
# {NOTE}
[Unit]
# Load only once the rescue units (ssh, the console) are up.
After={after}
# A load that keeps crashing stops after 3 tries in 15 minutes, not never.
StartLimitIntervalSec=15min
StartLimitBurst=3

[Service]
# {why}
MemoryMax={max_bytes}
# When memory runs out, the kernel kills the loader first.
OOMScoreAdjust=800
Restart=on-failure
RestartSec=30s
Nice=10
IOSchedulingClass=best-effort
IOSchedulingPriority=7
{room}"""
