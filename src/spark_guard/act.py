"""Act: log what a pass found to say, and hand its stops to the blocker.

The judgement of what is new and what to say is step.py's, pure; this is the
I/O after it. In a dry run step() hands over no stops, only what it would do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block.blocker import Blocker
from .core.events import tell
from .core.step import Outcome

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import


def act(outcome: Outcome, blocker: Blocker, log: FilteringBoundLogger) -> None:
    """Say what the pass decided, then block what it stops."""
    tell(log, *outcome.events)
    if outcome.stops:
        blocker.block(outcome.stops, outcome.decision)
