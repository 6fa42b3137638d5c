"""Would this load fit now? The same rule the guard applies in the strict phase, as a verdict.

fits  <=>  MemAvailable - reserve - what loaders still loading are expected to
           add  >=  the load's footprint

Pure: a footprint and a Snapshot/Decision in, a Verdict out. `spark-guard
preflight` is the front door; it senses once, as the daemon does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..snapshot import Decision, Snapshot, UnitRef


@dataclass(frozen=True)
class Verdict:
    need: int
    available: int
    reserve: int
    pending: int  # growth still expected from other loaders that are loading
    gpu_holders: tuple[tuple[str, int], ...]  # (unit, bytes), biggest first

    @property
    def room(self) -> int:
        return self.available - self.reserve - self.pending

    @property
    def fits(self) -> bool:
        return self.room >= self.need


def verdict(
    need: int, snapshot: Snapshot, decision: Decision, itself: UnitRef | None = None
) -> Verdict:
    pending = sum(
        max(loader.expected - loader.seen.used, 0)
        for loader in decision.loaders
        if loader.expected is not None and loader.ref != itself
    )
    holders = sorted(
        ((str(u.ref), u.gpu) for u in snapshot.units if u.gpu > 0), key=lambda h: -h[1]
    )
    return Verdict(need, snapshot.memory.available, decision.reserve, pending, tuple(holders[:5]))
