"""Would this load fit now? The same rule the guard applies in the strict phase, as a verdict.

fits  <=>  MemAvailable - reserve - what the loaders the guard admits are
           expected to add (policy.admit)  >=  the load's footprint

Pure: a footprint and a Snapshot/Decision in, a Verdict out. `spark-guard
preflight` is the front door; it senses once, as the daemon does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policy import admit
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
    # What the guard itself would let grow: the loaders it admits (policy.admit), not the
    # ones it is stopping now, nor the load being asked about (`itself`, when it is a unit).
    stopping = {a.unit for a in decision.actions if a.kind == "stop"}
    pending, _ = admit(
        (ld for ld in decision.loaders if ld.ref != itself and ld.ref not in stopping),
        snapshot.memory.available,
        decision.reserve,
    )
    holders = sorted(
        ((str(u.ref), u.gpu) for u in snapshot.units if u.gpu > 0), key=lambda h: -h[1]
    )
    return Verdict(need, snapshot.memory.available, decision.reserve, pending, tuple(holders[:5]))
