"""Act: carry out a Decision's actions through each unit's own manager.

Stays in-process: a D-Bus call on the manager's private socket, never a
fork or exec, since the memory to fork may already be gone. One action is
not repeated for the same unit and reason within `repeat_after` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from .config import format_size
from .managers import Manager, ManagerError
from .snapshot import Action, Decision


class Actuator:
    def __init__(
        self,
        managers: Mapping[str, Manager],
        log: Any,
        *,
        dry_run: bool,
        repeat_after: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.managers = managers
        self.log = log
        self.dry_run = dry_run
        self.repeat_after = repeat_after
        self.clock = clock
        self._done: dict[tuple[str, str, str, float | None], float] = {}
        self.last: str = "none"

    def apply(self, decision: Decision) -> list[Action]:
        """Carry out what is new in the decision; returns the actions taken."""
        now = self.clock()
        taken = []
        for action in decision.actions:
            # Per run of the unit: when Restart= brings it back, that is new.
            key = (str(action.unit), action.kind, action.reason, action.since)
            if now - self._done.get(key, -self.repeat_after - 1) <= self.repeat_after:
                continue
            self._done[key] = now
            self._log_decision(decision, action)
            if action.kind == "stop":
                self._stop(action)
            self.last = f"{action.kind} {action.unit} ({action.reason})"
            taken.append(action)
        return taken

    def _log_decision(self, decision: Decision, action: Action) -> None:
        level = self.log.warning if action.kind == "stop" else self.log.info
        level(
            "decision",
            unit=str(action.unit),
            manager=action.unit.manager,
            action=action.kind,
            reason=action.reason,
            phase=decision.phase,
            msg=f"{action.kind} {action.unit}: {action.detail}",
            **action.figures,
        )

    def _stop(self, action: Action) -> None:
        unit = action.unit
        if self.dry_run:
            self.log.warning(
                "dry-run",
                unit=str(unit),
                manager=unit.manager,
                action="stop",
                msg=f"dry run: would stop {unit}",
            )
            return
        manager = self.managers.get(unit.manager)
        try:
            if manager is None:
                raise ManagerError(f"{unit.manager} manager is not connected")
            job = manager.stop_unit(unit.name)
        except ManagerError as e:
            self.log.error(
                "unit-stop-failed",
                unit=str(unit),
                manager=unit.manager,
                error=str(e),
                msg=f"cannot stop {unit}: {e}",
            )
            return
        self.log.warning(
            "unit-stop-requested",
            unit=str(unit),
            manager=unit.manager,
            job=job,
            reason=action.reason,
            mem_available=action.figures.get("mem_available"),
            msg=f"stopping {unit} ({action.reason}; MemAvailable "
            f"{format_size(action.figures.get('mem_available', 0))})",
        )
