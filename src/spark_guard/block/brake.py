"""The brake: freeze a growing loader before the full look that decides on it, and thaw
what that look spared.

Each freeze is written down before it is asked for (<state>/braked/<unit>.json, a
PendingStop) and taken off only once the unit is thawed or a stop took it over. A guard
killed between the freeze and the thaw, or a pass that raised between them, leaves that
file: the next guard of the same boot adopts it and thaws the unit after its first
decision, unless that decision stops it. Before, the freezes lived only in the guard's
memory and such a loader stayed frozen for good, its memory held (fault F5). A freeze
that cannot be written down is not made: the full look that follows decides anyway.

A thaw that fails (a manager silent for a moment) is kept and tried again every
RETRY_AFTER until it thaws (F2). All of it is FreezeUnit/ThawUnit on the managers'
private sockets: no fork, no exec, nothing on the system bus.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ..core.block import RETRY_AFTER
from ..core.events import Event, EventKind, Level, tell
from ..core.snapshot import UnitRef
from ..system.managers import FreezeLate, ManagerError, ManagerSilent
from .records import BRAKED, PendingStop, RecordStore

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

# A freeze that failed this way means the manager is not answering, not that it cannot freeze.
NOT_ANSWERING = ("timed out", "timeout", "not connected", "connection", "broken pipe")
# A thaw refused this way has nothing to thaw: the unit stopped (by hand), or is gone.
NOT_FROZEN = ("not active", "not loaded", "NoSuchUnit", "not found")


class Freezable(Protocol):
    def freeze_unit(self, name: str) -> None: ...
    def thaw_unit(self, name: str) -> None: ...


def cannot_freeze(error: str) -> bool:
    """The manager has no freezer (cgroup v1/hybrid, or a systemd before 246)."""
    return "NotSupported" in error or "not support" in error or "UnknownMethod" in error


class Brake:
    """The units frozen ahead of a decision, on disk and here; and the managers that
    cannot freeze at all (asked once)."""

    def __init__(
        self,
        managers: Mapping[str, Freezable],
        store: RecordStore,
        boot_id: str,
        log: FilteringBoundLogger,
        clock: Callable[[], float],
    ) -> None:
        self.managers, self.store, self.boot_id = managers, store, boot_id
        self.log, self.clock = log, clock
        self.frozen: dict[str, UnitRef] = {}  # frozen by freeze(), not (yet) stopped
        self.no_freezer: set[str] = set()  # managers that cannot freeze (cgroup v1, hybrid)
        self._thaw_at: dict[str, float] = {}  # a thaw that failed: when it is tried again

    def adopt(self) -> None:
        """Take over the freezes an earlier guard of this boot left on disk (to be thawed
        after the next decision); those of another boot are gone with it: forgotten."""
        kept, errors = self.store.stops(BRAKED)
        for error in errors:
            tell(self.log, Event.of(EventKind.RECORD_UNREADABLE, "error", msg=str(error)))
        for stop in kept:
            if stop.boot_id and stop.boot_id == self.boot_id:
                self.frozen[str(stop.ref)] = stop.ref
            else:
                self.store.forget_stop(stop.ref, BRAKED)

    def freeze_unit(self, ref: UnitRef, manager: Freezable) -> tuple[bool, str]:
        """FreezeUnit on a service: (frozen, the manager's refusal or "" where none was
        asked). A manager that is not answering raises (a stop would wait as long again:
        the caller kills the cgroup)."""
        if ref.manager in self.no_freezer or not ref.name.endswith(".service"):
            return False, ""
        try:
            manager.freeze_unit(ref.name)
        except FreezeLate as e:
            # The kernel has not frozen it yet (a process in an uninterruptible wait), and
            # may: kept as frozen, so that a unit the decision spares is thawed (F4).
            return True, str(e)
        except ManagerError as e:
            text = str(e)
            if isinstance(e, ManagerSilent) or any(s in text.lower() for s in NOT_ANSWERING):
                raise
            if cannot_freeze(text):
                self.no_freezer.add(ref.manager)  # cgroup v1/hybrid, or an old systemd
            return False, text
        return True, ""

    def freeze(
        self, refs: Sequence[UnitRef], why: str, skip: Collection[str], **figures: float
    ) -> list[UnitRef]:
        """Freeze these services now (but those in `skip`: blocked already), each written
        down first. Returns those frozen; release() thaws the ones no stop takes()."""
        done = []
        for ref in refs:
            key = str(ref)
            manager = self.managers.get(ref.manager)
            if key in self.frozen or key in skip or manager is None:
                continue
            if ref.manager in self.no_freezer or not ref.name.endswith(".service"):
                continue
            level: Level = "debug"
            try:
                self.store.save_stop(PendingStop.of(ref, "", self.clock(), self.boot_id), BRAKED)
            except OSError as e:
                frozen, error, level = False, f"cannot record the freeze: {e}", "error"
            else:
                try:
                    frozen, error = self.freeze_unit(ref, manager)
                except ManagerError as e:
                    frozen, error = False, str(e)
            if not frozen:
                self.store.forget_stop(ref, BRAKED)
                error = error or "its manager cannot freeze"
                kind = EventKind.BRAKE_FAILED
                tell(self.log, Event.of(kind, level, unit=key, error=error, msg=f"{key}: {error}"))
                continue
            self.frozen[key] = ref
            self._thaw_at.pop(key, None)
            done.append(ref)
        if done:
            units = [str(r) for r in done]
            msg = f"froze {', '.join(units)} until the guard has looked ({why})"
            tell(
                self.log,
                Event.of(EventKind.BRAKE, "warning", units=units, error=why, msg=msg, **figures),
            )
        return done

    def take(self, ref: UnitRef) -> bool:
        """A stop takes over this unit's freeze (release() must not thaw it): whether the
        brake had frozen it."""
        if self.frozen.pop(str(ref), None) is None:
            return False
        self._thaw_at.pop(str(ref), None)
        self.store.forget_stop(ref, BRAKED)
        return True

    def for_stop(self, ref: UnitRef, manager: Freezable) -> tuple[bool, str]:
        """Freeze a unit before its block's stop (allocation halts at once), or take the
        brake's freeze: (frozen, what its record notes of it)."""
        if self.take(ref):
            return True, "frozen (FreezeUnit, by the brake before the decision)"
        frozen, why = self.freeze_unit(ref, manager)
        return frozen, "frozen (FreezeUnit)" if frozen else why and f"not frozen: {why}"

    def give_back(self, ref: UnitRef) -> None:
        """A stop that took the freeze could not stop the unit: the brake thaws it, as before
        (here at least, where its file cannot be written)."""
        self.frozen[str(ref)] = ref
        with contextlib.suppress(OSError):
            self.store.save_stop(PendingStop.of(ref, "", self.clock(), self.boot_id), BRAKED)

    def release(self, owned: Collection[str] = ()) -> None:
        """Thaw what freeze() froze and no stop took over (the decision spared it); one a
        block `owned` already (its record) is that block's, not thawed. A freeze whose
        manager is not connected now (a call timed out, or not yet back after a restart)
        is kept until it answers: its unit may still be frozen."""
        now = self.clock()
        for key, ref in list(self.frozen.items()):
            manager = self.managers.get(ref.manager)
            if key in owned:
                self.take(ref)
                continue
            if now < self._thaw_at.get(key, 0.0) or manager is None:
                continue
            try:
                manager.thaw_unit(ref.name)
            except ManagerError as e:
                if not any(s in str(e) for s in NOT_FROZEN):
                    self._thaw_failed(key, e, now)
                    continue
            self.take(ref)
            msg = f"thawed {key}: the guard spared it"
            tell(self.log, Event.of(EventKind.BRAKE_RELEASED, "info", unit=key, msg=msg))

    def _thaw_failed(self, key: str, error: ManagerError, now: float) -> None:
        # Kept, and tried again RETRY_AFTER later until it thaws: a manager silent once
        # (10 s after any timeout) must not leave a spared loader frozen for good. Said once.
        if key not in self._thaw_at:
            msg = f"cannot thaw {key}: {error}; trying again every {RETRY_AFTER:g}s"
            tell(
                self.log,
                Event.of(EventKind.THAW_FAILED, "error", unit=key, error=str(error), msg=msg),
            )
        self._thaw_at[key] = now + RETRY_AFTER
