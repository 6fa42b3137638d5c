"""RoomKeeper: room for the GPU, pass by pass, and what clean page cache is worth.

Each pass, before anything is judged: what the worker did is told (room-made, and each
way the kernel refused, once), the next plan (core/room.plan_room) is handed to the
worker (system/reclaim.RoomMaker, one thread: the loop never waits on a write), and
what the cache counts for is kept here (core/room.cache_counts) and handed to the
sensor with the pass's memory as a RoomView. While reclaims free little, while no way
of dropping cache works, and while a plan sits in the worker's hands past
ROOM_DEADLINE (F13), the cache is no room: the rules judge MemFree alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from .core.config import Config
from .core.events import Event, EventKind, Level, tell
from .core.quantities import format_size
from .core.room import ROOM_DEADLINE, Pace, RoomView, cache_counts, paced, plan_room
from .core.snapshot import Decision, Memory, UnitRef
from .system.reclaim import RoomMade, RoomMaker

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import


class RoomKeeper:
    """Hands the plans to the worker, tells what it did, says what the cache is worth."""

    def __init__(
        self,
        maker: RoomMaker,
        config: Config,
        log: FilteringBoundLogger,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_change`: called when what the cache counts for turns (the rules must judge
        again now: the brake and the full look's timing read the last decision's rule)."""
        self.maker = maker
        self.on_change = on_change
        self.counted = True
        self.config = config
        self.log = log
        self.pace = Pace(config.make_room_every)  # slower while reclaims free little
        self.reclaimed_at: float | None = None
        self.compacted_at: float | None = None
        # False once every way of dropping cache failed for good (system/reclaim.py).
        self.possible = True
        self.handed: float | None = None  # when the plan in the worker's hands was given
        self.hung = False  # it is past ROOM_DEADLINE (said once)
        self.said: set[str] = set()
        self.counts: dict[str, int] = {}  # for state.json and the metrics

    def reconfigure(self, config: Config) -> None:
        self.config = config

    def view(self, now: float) -> RoomView:
        """What clean page cache is worth to the GPU now."""
        counts = cache_counts(
            wanted=self.config.make_room,
            possible=self.possible,
            pace=self.pace,
            busy_since=self.handed,
            now=now,
        )
        return RoomView(counts, self.maker.reclaims_mapped)

    def tick(
        self,
        memory: Memory | None,
        decision: Decision | None,
        new_loaders: Collection[UnitRef],
        now: float,
    ) -> None:
        """Tell what the worker did; hand it the next plan, if any. `memory`: the pass's
        (None: no plan now, as in a dry run); `decision`: the last one, whose loaders say
        whether one loads (growing, or new since the one before)."""
        for made in self.maker.take():
            self._answered(made)
        if not self.maker.busy:
            self.handed = None
        self._watch(now)
        if self.view(now).counts != self.counted:
            self.counted = not self.counted
            self.on_change()
        if memory is None or decision is None or self.maker.busy or not self.config.make_room:
            return
        plan = plan_room(
            memory,
            self.config,
            decision.rule,
            loading=any(ld.seen.growth > 0 or ld.ref in new_loaders for ld in decision.loaders),
            now=now,
            last_reclaim=self.reclaimed_at,
            last_compact=self.compacted_at,
            every=self.pace.every,
        )
        if plan is None or not self.maker.submit(plan, memory):
            return
        self.handed = now
        if plan.reclaim:
            self.reclaimed_at = now
        if plan.compact:
            self.compacted_at = now

    def close(self) -> None:
        self.maker.close()

    def _watch(self, now: float) -> None:
        since = self.handed
        if self.hung or since is None or now - since < ROOM_DEADLINE:
            return
        self.hung = True
        tell(
            self.log,
            Event.of(
                EventKind.ROOM_FAILED,
                "warning",
                error=f"no answer within {ROOM_DEADLINE:g}s",
                msg=f"making room has not answered in {now - since:.0f}s: the page cache is"
                " not counted as room for the GPU until it does",
            ),
        )

    def _answered(self, made: RoomMade) -> None:
        if self.hung:
            self.hung = False
            tell(
                self.log,
                Event.of(
                    EventKind.ROOM_MADE,
                    "info",
                    msg=f"making room answered after {made.seconds:.0f}s: the page cache"
                    " counts as room again, as far as reclaims free it",
                ),
            )
        self._tell_refusals(made)
        if made.plan.reclaim and self.maker.reclaim_possible(made.before.swap_total):
            self._judge_reclaim(made)
        if made.method or made.compacted:
            self._tell_made(made)

    def _tell_refusals(self, made: RoomMade) -> None:
        # A way the kernel refused is said once (it stays so); as a warning only where no
        # other way did the work: 6.1 refuses memory.reclaim's swappiness=0 and the next works.
        failed = (made.plan.reclaim > 0 and not made.method) or (
            made.plan.compact and not made.compacted
        )
        for error in made.errors:
            if error not in self.said:
                self.said.add(error)
                level: Level = "warning" if failed else "info"
                tell(
                    self.log,
                    Event.of(
                        EventKind.ROOM_FAILED,
                        level,
                        error=error,
                        msg=f"cannot make room this way: {error}"
                        + ("" if failed else f"; {made.method or 'compaction'} did it"),
                    ),
                )
        if self.possible and not self.maker.reclaim_possible(made.before.swap_total):
            # No reclaim works here: the page cache is no room for the GPU, MemFree is judged.
            self.possible = False
            tell(
                self.log,
                Event.of(
                    EventKind.ROOM_FAILED,
                    "warning",
                    error="; ".join(self.maker.broken.values()),
                    msg="no way to drop page cache works here: on unified memory the guard now "
                    "judges MemFree alone",
                ),
            )

    def _judge_reclaim(self, made: RoomMade) -> None:
        """The pace of reclaims after this one (room.paced); while reclaims free little the
        cache is no room for the GPU (Pace.counts), said when that turns."""
        done = max(made.dropped, made.freed, 0) if made.method else 0
        before = self.pace
        self.pace = paced(before, made.plan.reclaim, done, self.config.make_room_every)
        if before.counts and not self.pace.counts:
            tell(
                self.log,
                Event.of(
                    EventKind.ROOM_FAILED,
                    "warning",
                    error=f"asked {made.plan.reclaim} bytes, {done} freed",
                    msg=f"reclaims free little ({format_size(done)} of "
                    f"{format_size(made.plan.reclaim)} asked): the page cache is not counted as"
                    f" room for the GPU until one frees again; retried every {self.pace.every:g}s",
                ),
            )
        elif not before.counts and self.pace.counts:
            tell(
                self.log,
                Event.of(
                    EventKind.ROOM_MADE,
                    "info",
                    msg="page cache can be dropped again: it counts as room",
                ),
            )

    def _tell_made(self, made: RoomMade) -> None:
        before, after = made.before, made.after
        for kind in ([made.method] if made.method else []) + (
            ["compact"] if made.compacted else []
        ):
            self.counts[kind] = self.counts.get(kind, 0) + 1
        self.counts["freed_bytes"] = self.counts.get("freed_bytes", 0) + max(made.freed, 0)
        fields: dict[str, object] = {
            "method": made.method or None,
            "compacted": made.compacted,
            "asked": made.plan.reclaim,
            "seconds": round(made.seconds, 3),
            "mem_free_before": before.free,
            "file_clean_before": before.file_clean,
            "huge_free_before": before.huge_free,
        }
        msg = f"made room for the GPU: {made.done} in {made.seconds:.2f}s; {made.plan.why}"
        if after is not None:
            fields |= {
                "mem_free_after": after.free,
                "file_clean_after": after.file_clean,
                "huge_free_after": after.huge_free,
            }
            msg += (
                f"; MemFree {format_size(before.free or 0)} -> {format_size(after.free or 0)}"
                f", clean cache {format_size(before.file_clean)} -> "
                f"{format_size(after.file_clean)}"
            )
            if before.huge_free is not None and after.huge_free is not None:
                msg += (
                    f", free in 2 MiB blocks {format_size(before.huge_free)} -> "
                    f"{format_size(after.huge_free)}"
                )
        tell(self.log, Event.of(EventKind.ROOM_MADE, "info", msg=msg, **fields))
