"""Act: log each new action of a Decision, and hand the stops to the Blocker.

An action is not repeated for the same run of a unit and the same reason
within `repeat_after` seconds; a unit that Restart= brought back is a new
run and is acted on at once. In a dry run the guard says what it would do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .block.blocker import Blocker
from .snapshot import Action, Decision

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import


class Actuator:
    """Act: turns each Decision's actions into what is logged and what is stopped.

    Owns the memory of what was already done (per run of a unit, for
    `repeat_after` seconds), the last action taken and the action counts that
    state.json and the metrics show. Warnings are only logged; stops go to the
    Blocker, or in a dry run are only said.
    """

    def __init__(
        self,
        blocker: Blocker,
        log: FilteringBoundLogger,
        *,
        dry_run: bool,
        repeat_after: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.blocker = blocker
        self.log = log
        self.dry_run = dry_run
        self.repeat_after = repeat_after
        self.clock = clock
        self._done: dict[tuple[str, str, str, float | None], float] = {}
        self.last: str = "none"
        self.counts: dict[str, int] = {}  # actions taken by kind, for the metrics

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
            self.last = f"{action.kind} {action.unit} ({action.reason})"
            kind = "dry-run" if self.dry_run and action.kind == "stop" else action.kind
            self.counts[kind] = self.counts.get(kind, 0) + 1
            taken.append(action)
        stops = [a for a in taken if a.kind == "stop"]
        if stops and self.dry_run:
            for action in stops:
                self.log.warning(
                    "dry-run",
                    unit=str(action.unit),
                    manager=action.unit.manager,
                    action="stop",
                    msg=f"dry run: would stop, mask and disable {action.unit}",
                )
        elif stops:
            self.blocker.block(stops, decision)
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
