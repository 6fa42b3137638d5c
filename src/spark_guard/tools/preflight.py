"""Would this load fit now? The same rule the guard applies in the strict phase, as a verdict.

fits  <=>  headroom - reserve - what the loaders the guard admits are
           expected to add (policy.admit)  >=  the load's footprint

The headroom is what the guard judges (policy.judged): MemAvailable, or on unified
memory the room a GPU allocation can be given (MemFree, plus the clean page cache the
guard drops for it). On unified memory where no room is made, the model file's own page
cache counts too: a load reads the file through the cache while its copy fills MemFree.

Pure: a footprint and a Snapshot/Decision in, a Verdict out. `spark-guard
preflight` is the front door; it senses once, as the daemon does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.policy import admit
from ..core.snapshot import Decision, Snapshot, UnitRef, judged


@dataclass(frozen=True)
class Verdict:
    need: int
    available: int  # the headroom judged (policy.judged)
    reserve: int
    pending: int  # growth still expected from other loaders that are loading
    gpu_holders: tuple[tuple[str, int], ...]  # (unit, bytes), biggest first
    unified: bool = False
    mem_available: int = 0
    mem_free: int | None = None
    file_clean: int = 0
    # The model file's page cache, added to `need` on unified memory without make-room.
    page_cache: int = 0

    @property
    def room(self) -> int:
        return self.available - self.reserve - self.pending

    @property
    def fits(self) -> bool:
        return self.room >= self.need


def verdict(
    need: int,
    snapshot: Snapshot,
    decision: Decision,
    itself: UnitRef | None = None,
    *,
    model_bytes: int = 0,
) -> Verdict:
    # What the guard itself would let grow: the loaders it admits (policy.admit), not the
    # ones it is stopping now, nor the load being asked about (`itself`, when it is a unit).
    stopping = {a.unit for a in decision.actions if a.kind == "stop"}
    headroom = judged(snapshot.memory, snapshot.rule)
    pending, _ = admit(
        (ld for ld in decision.loaders if ld.ref != itself and ld.ref not in stopping),
        headroom,
        decision.reserve,
    )
    holders = sorted(
        ((str(u.ref), u.gpu) for u in snapshot.units if u.gpu > 0), key=lambda h: -h[1]
    )
    rule, memory = snapshot.rule, snapshot.memory
    cache = model_bytes if rule.unified and not rule.make_room else 0
    return Verdict(
        need + cache,
        headroom,
        decision.reserve,
        pending,
        tuple(holders[:5]),
        unified=rule.unified,
        mem_available=memory.available,
        mem_free=memory.free,
        file_clean=memory.file_clean,
        page_cache=cache,
    )
