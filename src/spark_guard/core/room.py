"""plan_room(memory, ...) -> RoomPlan | None: when to make room for the GPU, with no I/O.

On unified memory (a DGX Spark) a GPU allocation gets MemFree. A page-cache flood
(a model streamed from disk, a checkpoint copied) leaves MemFree low while
MemAvailable looks healthy, and the driver then fails (NV_ERR_NO_MEMORY) or wedges
the host; it also leaves no free 2 MiB blocks. What worked in the field is to drop
clean page cache and compact whenever MemFree falls under a floor, above all
while a server loads (docs/unified-memory.md). That is what this plans, before any
rule stops anything: policy.judged counts the cache as room because of it.

system/reclaim.py carries a plan out, off the loop; roomkeeper.py hands plans to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config
from .quantities import format_size
from .snapshot import Memory, MemoryRule, droppable

MiB = 1024**2
# Less clean cache than this is not worth a reclaim: it would not lift MemFree by much.
RECLAIM_MIN = 64 * MiB
# While a loader loads, room is made once MemFree is under this many floors: the field's
# watcher acted from a server's launch on, and a loader at GB/s crosses one floor fast.
LOADING_MARGIN = 1.5
# Compaction walks every zone (seconds on 121 GiB): at most once this many reclaim periods.
COMPACT_EVERY = 5
# The longest wait between two reclaims that freed little (paced()).
BACKOFF_MAX = 30.0
# Reclaims in a row that freed little before the cache stops counting as room.
MISSES_MAX = 2


@dataclass(frozen=True)
class RoomPlan:
    """What to do: reclaim `reclaim` bytes of clean page cache (0: none), compact or not."""

    reclaim: int
    compact: bool
    why: str


def plan_room(
    memory: Memory,
    config: Config,
    rule: MemoryRule,
    *,
    loading: bool,
    now: float,
    last_reclaim: float | None,
    last_compact: float | None,
    every: float | None = None,
) -> RoomPlan | None:
    """Room to make now, or None.

    Under the floor (or under LOADING_MARGIN floors while a loader loads), with clean
    page cache to drop: reclaim up to two floors' worth above MemFree, and compact after
    it (dropped pages are scattered). With MemFree above the floor but fewer free 2 MiB
    blocks than a floor and than half of MemFree: compact only. At most one reclaim per
    `every` (make_room_every, or longer while reclaims free little: the caller backs off),
    one compaction per
    COMPACT_EVERY of those. Only the cache `droppable` counts. Never on a discrete-GPU
    machine, nor where the config says no: `rule.make_room` is not asked, since it is off
    while reclaims do not work, and this is how they are tried again.
    """
    if not (rule.unified and config.make_room) or memory.free is None:
        return None
    floor = config.floor_for(memory.total)
    free = memory.free
    cache = droppable(memory, rule)
    every = config.make_room_every if every is None else every
    may_reclaim = last_reclaim is None or now - last_reclaim >= every
    may_compact = last_compact is None or now - last_compact >= every * COMPACT_EVERY
    trigger = floor * (LOADING_MARGIN if loading else 1.0)
    if free < trigger and cache >= RECLAIM_MIN and may_reclaim:
        want = min(2 * floor - free, cache)
        if want >= RECLAIM_MIN:
            return RoomPlan(
                want,
                may_compact,
                f"MemFree {format_size(free)} under "
                + (f"{LOADING_MARGIN:g}x " if loading else "")
                + f"the device floor {format_size(floor)}"
                + (" while a loader loads" if loading else "")
                + f", {format_size(cache)} of clean page cache to drop",
            )
    if floor <= free and fragmented(memory, floor) and may_compact:
        return RoomPlan(
            0,
            True,
            f"{format_size(memory.huge_free or 0)} free in 2 MiB blocks of "
            f"{format_size(free)} free (device floor {format_size(floor)}): fragmented",
        )
    return None


def fragmented(memory: Memory, floor: int) -> bool:
    """Less than half of MemFree, and less than a floor, is in free 2 MiB blocks: what a
    compaction mends. (MemFree mostly in large blocks is no fragmentation: a compaction
    there moves pages for nothing; measured in the VM.) False where buddyinfo is unknown."""
    huge, free = memory.huge_free, memory.free
    return huge is not None and free is not None and huge < floor and huge < free // 2


@dataclass(frozen=True)
class Pace:
    """How often room is made now: `every` seconds, after `misses` reclaims in a row that
    freed little. While `counts` is false, clean cache is no room (MemoryRule.make_room)."""

    every: float
    misses: int = 0

    @property
    def counts(self) -> bool:
        return self.misses < MISSES_MAX


def paced(pace: Pace, asked: int, done: int, base: float) -> Pace:
    """The pace after a reclaim that asked `asked` bytes and freed `done` (MemFree gained or
    cache dropped, the larger). Less than a quarter of what was asked (or RECLAIM_MIN)
    doubles the wait, up to BACKOFF_MAX; one that frees is back to `base`. Cache the kernel
    will not drop (mapped and in use, refilled as fast as it goes) then neither makes the
    guard drop caches every second nor makes it see room that is not there."""
    if done >= min(asked // 4, RECLAIM_MIN):
        return Pace(base)
    return Pace(min(pace.every * 2, BACKOFF_MAX), pace.misses + 1)


# A plan in the worker's hands longer than this has hung (a reclaim stuck in the kernel
# behind a locked page, a compaction of a host under thrash): until it answers, the cache
# it was to drop is no room for the GPU (F13). A reclaim of a few GiB takes well under a
# second (docs/benchmarks.md); one worker carries the plans out, one at a time.
ROOM_DEADLINE = 10.0


@dataclass(frozen=True)
class RoomView:
    """What clean page cache is worth to the GPU in this pass (MemoryRule's make_room and
    reclaims_mapped): the RoomKeeper's, handed to the sensor with the pass's memory."""

    counts: bool = True
    mapped: bool = False  # a memory.reclaim worked: mapped cache is droppable too


# Where no RoomKeeper runs (a one-shot command): the cache counts, as room would be made.
AS_MADE = RoomView()


def cache_counts(
    *, wanted: bool, possible: bool, pace: Pace, busy_since: float | None, now: float
) -> bool:
    """Whether clean page cache counts as room now: only while room can be made of it.
    make_room on, a way of dropping it that did not fail for good, reclaims that free
    (Pace.counts), and no plan in hand past ROOM_DEADLINE (the worker hung: nothing is
    dropping the cache, however much of it there is)."""
    overdue = busy_since is not None and now - busy_since >= ROOM_DEADLINE
    return wanted and possible and pace.counts and not overdue
