"""Every kind of event the guard logs, with its journal MESSAGE_ID, and the one way out.

`journalctl MESSAGE_ID=<id>` finds every event of one kind; the IDs never
change once released (the message catalog of the package keys on them).
Pure code returns Events and I/O code builds them; either way they reach the
journal through tell(), which hands the logger where each was built, so the
journal's CODE_FILE, CODE_LINE and CODE_FUNC name that place and not the relay.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

Level = Literal["debug", "info", "warning", "error"]


class EventKind(StrEnum):
    """The kinds of event; each value is the event's name in the journal (SG_EVENT)."""

    GUARD_STARTED = "guard-started"
    GUARD_STOPPING = "guard-stopping"
    CONFIG_INVALID = "config-invalid"
    CONFIG_RELOADED = "config-reloaded"
    CONFIG_RELOAD_REFUSED = "config-reload-refused"
    GPU_ACCOUNTING_OFF = "gpu-accounting-off"
    GPU_ACCOUNTING_ON = "gpu-accounting-on"
    GPU_HUNG = "gpu-hung"
    MANAGER_CONNECTED = "manager-connected"
    MANAGER_LOST = "manager-lost"
    MANAGER_UNTRUSTED = "manager-untrusted"
    MANAGER_LATE = "manager-late"
    ENGINE_UNANSWERED = "engine-unanswered"
    LOADER_SEEN = "loader-seen"
    PHASE_CHANGED = "phase-changed"
    DECISION = "decision"
    UNIT_STOP_REQUESTED = "unit-stop-requested"
    UNIT_STOP_FAILED = "unit-stop-failed"
    DRY_RUN = "dry-run"
    PSI_TRIGGER_OFF = "psi-trigger-off"
    MEMLOCK_FAILED = "memlock-failed"
    SENSE_FAILED = "sense-failed"
    UNIT_STOPPED = "unit-stopped"
    UNIT_KILLED = "unit-killed"
    UNIT_BLOCKED = "unit-blocked"
    BLOCK_FAILED = "block-failed"
    BLOCK_RENEWED = "block-renewed"
    STATE_BUSY = "state-busy"
    RECORD_UNREADABLE = "record-unreadable"
    BANNER_FAILED = "banner-failed"
    UNIT_RELEASED = "unit-released"
    FOOTPRINT_UNKNOWN = "footprint-unknown"
    METRICS_OFF = "metrics-off"
    BRAKE = "brake"
    BRAKE_RELEASED = "brake-released"
    THAW_FAILED = "thaw-failed"
    BRAKE_FAILED = "brake-failed"
    PRESSURE_WAKE = "pressure-wake"
    MEMLOCK = "memlock"
    STATE_UNWRITTEN = "state-unwritten"
    ROOM_MADE = "room-made"
    ROOM_FAILED = "room-failed"
    JOURNAL_DROPPED = "journal-dropped"
    PASS_FAILED = "pass-failed"


@dataclass(frozen=True)
class Callsite:
    """Where an event was built: the journal's CODE_FILE, CODE_LINE and CODE_FUNC."""

    file: str
    line: int
    func: str


def _callsite() -> Callsite:
    """The first frame outside this module and dataclass-made code: the event's builder."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith("<")
    ):
        frame = frame.f_back
    return Callsite(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


@dataclass(frozen=True)
class Event:
    """Something to tell the journal, as plain data, with where it was built."""

    kind: EventKind
    level: Level
    msg: str
    fields: dict[str, Any] = field(default_factory=dict)
    where: Callsite = field(default_factory=_callsite, compare=False, repr=False)

    @classmethod
    def of(cls, kind: EventKind, level: Level, msg: str = "", **fields: Any) -> Event:
        """An event from keyword fields, as a log call reads them:
        Event.of(EventKind.UNIT_BLOCKED, "warning", msg=..., unit=...)."""
        return cls(kind, level, msg, fields)


class Logger(Protocol):
    """What tell() needs of a logger: structlog's bound loggers have these."""

    def debug(self, event: str, **kw: Any) -> Any: ...
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...
    def error(self, event: str, **kw: Any) -> Any: ...


def tell(log: Logger, *events: Event) -> None:
    """The one way out: each event at its level, with its fields and where it was built
    (log.py writes that as CODE_FILE, CODE_LINE and CODE_FUNC, and adds the MESSAGE_ID)."""
    for event in events:
        getattr(log, event.level)(
            event.kind.value, msg=event.msg, callsite=event.where, **event.fields
        )


MESSAGE_IDS: dict[EventKind, str] = {
    EventKind.GUARD_STARTED: "8499ee7b395245ab811cf26e83911ead",
    EventKind.GUARD_STOPPING: "a7c0e1ea184a4cc0889c96bef6fc0c8f",
    EventKind.CONFIG_INVALID: "87366aeaf55f458d943fef92003a4a27",
    EventKind.CONFIG_RELOADED: "7d4a83b4823b4e968a980fd1f014ef5f",
    EventKind.CONFIG_RELOAD_REFUSED: "e20ac1ea7c5840379b8d230be52f7ba4",
    EventKind.GPU_ACCOUNTING_OFF: "343fe5ebb11843f6a0753f7357559624",
    EventKind.GPU_ACCOUNTING_ON: "be04c5795d1e46efba08aea465d37337",
    EventKind.GPU_HUNG: "3e52a17603ff4bf49ccaadef383cdf03",
    EventKind.MANAGER_CONNECTED: "542be34c8de6421cb66e1a009b6949e3",
    EventKind.MANAGER_LOST: "be412eceffd849ddaa1bd575d38bd4b3",
    EventKind.MANAGER_UNTRUSTED: "30ca554172384757b931717acb0d32b7",
    EventKind.MANAGER_LATE: "4e1e8ee38be24e1e9d9dd60f1542945f",
    EventKind.ENGINE_UNANSWERED: "c7752726b9074718bb28d293086eea7d",
    EventKind.LOADER_SEEN: "4a07fefefba742fca5fdea72ee9904c8",
    EventKind.PHASE_CHANGED: "9fdd30b2101e4b4a800f03b3587ed425",
    EventKind.DECISION: "386c475fe9d64cdfb4d03ede643cd1d2",
    EventKind.UNIT_STOP_REQUESTED: "068574cbf2c74b65a6744f41ff55b762",
    EventKind.UNIT_STOP_FAILED: "83856f75370143689e0f5965a4cac00b",
    EventKind.DRY_RUN: "447c739011624aacb47ca3408ec3d060",
    EventKind.PSI_TRIGGER_OFF: "8844c0d55c5b4cc5aa406731145534b5",
    EventKind.MEMLOCK_FAILED: "3a49c4fbc7094cfe942a2efc3bada846",
    EventKind.SENSE_FAILED: "6776d5f685704f268d151cecab7fe43f",
    EventKind.UNIT_STOPPED: "ac1d944d0c8d44ed93bdcfe43c2997d2",
    EventKind.UNIT_KILLED: "9b512aa4392b4cc0bba33a359d89d6f1",
    EventKind.UNIT_BLOCKED: "946bcf8b7d054547a32d497077fd9379",
    EventKind.BLOCK_FAILED: "330a79dbc034448fb7ac4365419fa51a",
    EventKind.BLOCK_RENEWED: "7bd47e0684834296bc60c60039672a7c",
    EventKind.STATE_BUSY: "5a7570cfeac84610a641f9fd4ec39f7f",
    EventKind.RECORD_UNREADABLE: "83cd7014831d45e299290fff91c64030",
    EventKind.BANNER_FAILED: "207ebaccb9e84fdda1a859a2242a75b1",
    EventKind.UNIT_RELEASED: "9fcd4780bf5842c78919f0d3599374b2",
    EventKind.FOOTPRINT_UNKNOWN: "a33da9a96833480f84e35b39ca9edd11",
    EventKind.METRICS_OFF: "4f76fb80581c4fd68ec441a08693e7b4",
    EventKind.BRAKE: "1def070118a642b092262264a76aea3c",
    EventKind.BRAKE_RELEASED: "c725e9176903439d992f0b8cbe64ac37",
    EventKind.THAW_FAILED: "aae995cb63eb4e29b028f0e3ff7e0e94",
    EventKind.BRAKE_FAILED: "2a96ecf430f04dac84d957db813eff70",
    EventKind.PRESSURE_WAKE: "2197032827e94d129a83292ae1436385",
    EventKind.MEMLOCK: "1eb07c395299433ca89f86cd6e77583b",
    EventKind.STATE_UNWRITTEN: "4bdea0cfb6d6492e82c9984b50394eed",
    EventKind.ROOM_MADE: "687c3cf5d15744ea932bb082c17fed2a",
    EventKind.ROOM_FAILED: "41e7b70ba971400ca7fa5fe322aaeea5",
    EventKind.PASS_FAILED: "dcf65e5c5ce941838f7f5b993c7aacc3",
    EventKind.JOURNAL_DROPPED: "4f9f087323724d6b96f01fb5e457e25c",
}
