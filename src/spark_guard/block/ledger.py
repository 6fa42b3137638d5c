"""The blocks' records as a guard holds them: one per unit, in memory and on disk.

The store (block/records.py) is what every guard and release shares; the ledger is
this guard's view of it: read again whenever another process changed the store,
written after each step (said once when it cannot be, and kept here meanwhile),
every step change checked against core.block's table, every problem said once, and
the login note (banner.py) kept in step with the records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.block import Step, StepError
from ..core.events import Event, EventKind, Level, tell
from . import banner
from .records import Record, RecordError, RecordStore, Unlisted

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import


class Ledger:
    """The records this guard drives, and what it said of them."""

    def __init__(
        self,
        store: RecordStore,
        log: FilteringBoundLogger,
        motd: str,
        issue: str,
        held: Callable[[str], bool],
    ) -> None:
        self.store, self.log, self.motd, self.issue = store, log, motd, issue
        # A record a thread of its block holds (a container's): its copy outlives a re-read.
        self.held = held
        self.records: dict[str, Record] = {}
        self.on_disk: set[str] = set()  # records this guard has seen on disk
        self.unsaved: set[str] = set()  # records whose latest state could not be written
        self.reported: dict[str, str] = {}  # what was said last of each (said once)
        self._generation: int | None = None
        self._banner: str | None = None

    def once(self, key: str, text: str) -> bool:
        """Whether `text` is news of `key` (said once, until it changes)."""
        if self.reported.get(key) == text:
            return False
        self.reported[key] = text
        return True

    def move(self, record: Record, to: Step) -> bool:
        """Every step change goes through here (core.block.TRANSITIONS says which may happen).
        One it does not allow is a bug: reported as block-failed and refused, the record
        staying where it was, rather than raised: an exception would end the guard's loop,
        and the record, resumed after each restart, would end it again."""
        try:
            record.move(to)
        except StepError as e:
            self.problem(record, str(e))
            return False
        return True

    def problem(self, record: Record, problem: str) -> None:
        record.problem = problem
        if self.once(str(record.ref), problem):  # not on every retry
            record.note(f"problem: {problem}")
            self.event(EventKind.BLOCK_FAILED, record, f"{record.ref}: {problem}", error=problem)

    def solved(self, record: Record) -> None:
        record.problem = ""
        self.reported.pop(str(record.ref), None)

    def event(self, kind: EventKind, record: Record, msg: str, **fields: Any) -> None:
        level: Level = "error" if kind == EventKind.BLOCK_FAILED else "warning"
        tell(
            self.log,
            Event(kind, level, msg, {"unit": str(record.ref), "manager": record.manager, **fields}),
        )

    def save(self, record: Record) -> bool:
        """Write the record; False (said once) if it cannot be written now. It is then
        kept here, tried again every pass, and nothing that changes a file goes on."""
        key = str(record.ref)
        try:
            aside, why = self.store.save(record)
            if aside:
                tell(
                    self.log,
                    Event.of(
                        EventKind.RECORD_UNREADABLE,
                        "error",
                        error=why,
                        kept=aside,
                        msg=f"{why}; kept as {aside}, and a new record written in its place",
                    ),
                )
            self.on_disk.add(key)
            self.unsaved.discard(key)
            saved = True
        except OSError as e:
            self.unsaved.add(key)
            saved = False
            problem = f"cannot write {self.store.path_of(record.ref)}: {e}"
            if self.once(key, problem):
                self.event(EventKind.BLOCK_FAILED, record, f"{key}: {problem}", error=problem)
        with contextlib.suppress(OSError):
            self._generation = self.store.generation()
        return saved

    def released_meanwhile(self, record: Record) -> bool:
        """A record this guard saved that is no longer on disk: `release` took it (under the
        lock we now hold). Acting on it would undo the admin's release."""
        key = str(record.ref)
        if key not in self.on_disk:
            return False
        try:
            gone = self.store.load(record.ref) is None
        except RecordError:
            gone = False
        if gone:
            self.records.pop(key, None)
            self.on_disk.discard(key)
        return gone

    def on_record(self, record: Record) -> Record | None:
        """The unit's record as it is on disk now (another guard's, perhaps)."""
        try:
            return self.store.load(record.ref)
        except (RecordError, OSError):
            return None

    def refresh(self) -> None:
        """Re-read the records when another process (release) changed them."""
        generation = self.store.generation()
        if generation == self._generation and generation != -1:
            return
        self._generation = generation
        records, errors = self.store.all()
        for e in errors:
            if self.once(str(e), str(e)):
                tell(
                    self.log,
                    Event.of(EventKind.RECORD_UNREADABLE, "error", error=str(e), msg=str(e)),
                )
        if any(isinstance(e, Unlisted) for e in errors):
            # Not "no records": the ones known are kept and driven, and the store is read
            # again next pass (a failed listing is never taken for a release).
            self._generation = None
            return
        fresh = {str(r.ref): r for r in records}
        for key in fresh:
            if self.held(key) and key in self.records:
                fresh[key] = self.records[key]  # its block's thread holds this one
        for key in list(self.unsaved):
            if key in self.records and (key in fresh or key not in self.on_disk):
                fresh[key] = self.records[key]  # newer than the disk's, or never there
            elif key not in fresh:
                self.unsaved.discard(key)  # on disk once, gone now: released meanwhile
        self.records = fresh
        self.on_disk = {str(r.ref) for r in records}
        self.publish()

    def publish(self) -> None:
        """The login note (motd, issue) says what is blocked now."""
        blocked = list(self.records.values())
        text = banner.render(blocked)
        if text == self._banner:
            return
        try:
            banner.publish(blocked, self.motd, self.issue)
            self._banner = text
        except OSError as e:
            why = f"cannot write the login note: {e}"
            tell(self.log, Event.of(EventKind.BANNER_FAILED, "error", error=str(e), msg=why))
