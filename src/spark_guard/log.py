"""structlog pipeline: small processors, then one sink (journal or terminal).

Every event reaches it through core.events.tell(). Under systemd the events go
to journald as native fields (SG_UNIT=..., PRIORITY from the level, MESSAGE_ID
per event kind, CODE_FILE/CODE_LINE/CODE_FUNC of the place that built the
event) so admins can filter on them. On a terminal they are one readable
key=value line each.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, TextIO, cast

import structlog

from . import journal
from .core.events import MESSAGE_IDS, Callsite, EventKind
from .core.text import printable

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

EventDict = MutableMapping[str, Any]

PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}
SYSLOG_IDENTIFIER = "spark-guard"


_MESSAGE_IDS = {kind.value: message_id for kind, message_id in MESSAGE_IDS.items()}


def add_message_id(_logger: Any, _name: str, event: EventDict) -> EventDict:
    message_id = _MESSAGE_IDS.get(str(event.get("event")))
    if message_id:
        event["message_id"] = message_id
    return event


def add_callsite(_logger: Any, _name: str, event: EventDict) -> EventDict:
    """Where the event was built (core.events.Callsite, which tell() passes), as the
    journal's CODE_FILE, CODE_LINE and CODE_FUNC."""
    where = event.pop("callsite", None)
    if isinstance(where, Callsite):
        event["pathname"], event["lineno"], event["func_name"] = where.file, where.line, where.func
    return event


# The longest value one field or the message keeps; a user's 1 MiB argument is cut here.
FIELD_LIMIT = 2048


def make_printable(_logger: Any, _name: str, event: EventDict) -> EventDict:
    """Every field but numbers as printable, capped text: no terminal escape, CR, newline or
    bidi override from a unit name, model path or command line reaches root's screen."""
    for key, value in event.items():
        if value is None or isinstance(value, bool | int | float):
            continue
        event[key] = printable(_field_value(value), FIELD_LIMIT)
    return event


def _field_value(value: Any) -> str:
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v) for v in value)
    return str(value)


class JournalSink:
    """Final processor: sends the event to journald, never waiting (journal.py), and drops
    it from stdout. What journald could not take is counted and said once it reads again."""

    _META = ("event", "level", "msg", "message_id", "pathname", "lineno", "func_name")

    def __init__(self, path: str = journal.SOCKET) -> None:
        if not journal.available(path):
            raise FileNotFoundError(f"no journald socket at {path}")
        self._journal = journal.JournalSocket(path)

    def __call__(self, _logger: Any, _name: str, event: EventDict) -> str:
        kind = str(event.get("event", ""))
        fields = {
            f"SG_{key.upper()}": _field_value(value)
            for key, value in event.items()
            if key not in self._META and value is not None
        }
        sent = self._journal.send(
            {
                "MESSAGE": str(event.get("msg") or kind),
                "MESSAGE_ID": event.get("message_id"),
                "CODE_FILE": event.get("pathname"),
                "CODE_LINE": event.get("lineno"),
                "CODE_FUNC": event.get("func_name"),
                "PRIORITY": str(PRIORITY.get(str(event.get("level")), 6)),
                "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
                "SG_EVENT": kind,
                **fields,
            }
        )
        if sent and self._journal.dropped:
            self._say_dropped(self._journal.take_dropped())
        raise structlog.DropEvent

    def _say_dropped(self, n: int) -> None:
        # Said by the way out itself: it is what the events could not get through.
        kind = EventKind.JOURNAL_DROPPED
        self._journal.send(
            {
                "MESSAGE": f"journald did not take {n} entries (stopped, or stalled); "
                "the guard went on without them",
                "MESSAGE_ID": MESSAGE_IDS[kind],
                "PRIORITY": str(PRIORITY["warning"]),
                "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
                "SG_EVENT": kind.value,
                "SG_DROPPED": str(n),
            }
        )


def render_line(_logger: Any, _name: str, event: EventDict) -> str:
    """'warning decision: <msg> unit=x reason=footprint' for terminals and plain logs."""
    level = event.pop("level", "info")
    kind = event.pop("event", "")
    msg = event.pop("msg", None)
    for key in ("message_id", "pathname", "lineno", "func_name"):
        event.pop(key, None)
    if msg and "error" in event and str(event["error"]) in msg:
        event.pop("error")  # already said in the message
    head = f"{level} {kind}" + (f": {msg}" if msg else "")
    rest = " ".join(f"{k}={_quote(_field_value(v))}" for k, v in event.items() if v is not None)
    return f"{head} {rest}".rstrip()


def _quote(s: str) -> str:
    return repr(s) if (" " in s or not s) else s


def journal_connected(stream: TextIO) -> bool:
    """True when systemd connected this stream to journald (JOURNAL_STREAM=dev:ino)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
        dev, ino = (int(x) for x in value.split(":"))
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def configure(
    mode: str = "auto",
    stream: TextIO | None = None,
    level: str = "info",
    journal_socket: str = journal.SOCKET,
) -> str:
    """Set up the pipeline; returns the sink chosen ('journal' or 'console')."""
    out = stream or sys.stderr
    sink: Any = render_line
    chosen = "console"
    if mode == "journal" or (mode == "auto" and journal_connected(out)):
        try:
            sink = JournalSink(journal_socket)
            chosen = "journal"
        except OSError as e:
            if mode == "journal":
                print(f"spark-guard: {e}; logging to stderr", file=out)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            add_callsite,
            add_message_id,
            make_printable,
            sink,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level_number(level)),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    return chosen


def _level_number(level: str) -> int:
    return {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}[level]


def get_logger() -> FilteringBoundLogger:
    # structlog types get_logger() as Any; configure() (and structlog's default) makes
    # every logger a filtering bound one, so callers get methods mypy can check.
    return cast("FilteringBoundLogger", structlog.get_logger())
