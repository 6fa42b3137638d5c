"""Which units are judged as running, and which are leaving: the guard's own stops.

A unit deactivating is leaving only when the guard (or a rescue, for a block) sent its
stop: that stop is under way and escalated on its own clock (core/stops.py). Any other
stop hides nothing: her own `systemctl stop` of a unit whose ExecStop= never ends
(TimeoutStopSec=infinity) leaves its server running, and growing, for as long as she
likes (issue 40, H2), so that unit is judged as a running one is.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from .snapshot import SeenUnit, Snapshot, UnitRef


def running(seen: SeenUnit, stopping: Collection[UnitRef]) -> bool:
    """Judged as running: starting, active or reloading, or deactivating by a stop the
    guard did not send."""
    if seen.starting or seen.active_state in ("active", "activating", "reloading"):
        return True
    return seen.active_state == "deactivating" and seen.ref not in stopping


def leaving(snapshot: Snapshot, loader: Callable[[SeenUnit], object]) -> int:
    """What the loaders the guard is stopping hold (`loader`: not None for a loader), those
    that do not grow: killed, their memory on its way back. Below the reserve it counts
    against the deficit, so the pass after a stop does not take another, innocent loader
    for the same gap; one that grows frees nothing yet."""
    return sum(
        seen.used
        for seen in snapshot.units
        if seen.active_state == "deactivating"
        and seen.ref in snapshot.stopping
        and seen.growth <= 0
        and loader(seen) is not None
    )
