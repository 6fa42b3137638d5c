"""What the guard did to each unit, kept on disk so it can be finished, shown and undone.

One JSON file per blocked unit under <state>/blocked/, replaced atomically
(safefs: a new file under a random name, fsync, rename, fsync the directory,
never through a symlink) at every step,
so a crash leaves either the old or the new record, never half of one. A
record names its next step: the next start of the guard goes on from there.
`spark-guard release` moves a record to <state>/released/, which keeps the
history.

A stop-only stop (a server stopped, not blocked) has no record; while it is
under way it has a small file under <state>/stopping/, so a guard restarted
before the server has gone still escalates its stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from ..core.block import Step, Stopping, moved
from ..core.snapshot import CONTAINER, UnitRef, manager_uid, valid_id, valid_name
from ..system.safefs import MAKEDIRS, own_tree
from ..system.unitfiles import Link
from . import codec

FORMAT = 1
STOP_FORMAT = 1
T = TypeVar("T")
RELEASING = ".releasing"  # beside a record: its release is under way
# The directories of kept stops (PendingStop): a stop-only stop until it settles, a
# brake's freeze until it is thawed or a stop takes it over.
STOPPING, BRAKED = "stopping", "braked"


class RecordError(RuntimeError):
    """A record file that cannot be read or parsed; str() names the file."""


class Unlisted(RecordError):
    """A directory of records that could not be listed: its records are not known to be
    gone (a reader keeps what it knew and reads again later)."""


@dataclass
class LinkRecord:
    path: str
    target: str
    uid: int
    gid: int
    removed: bool = False

    @property
    def link(self) -> Link:
        return Link(self.path, self.target, self.uid, self.gid)


@dataclass
class ContainerState:
    """A container as it was before its block: what release() puts back exactly."""

    id: str
    image: str
    engine: str  # the engine's API socket
    restart: str  # the restart policy ("" is "no")
    max_retries: int
    was_running: bool

    @property
    def policy(self) -> str:
        name = self.restart or "no"
        return f"{name}:{self.max_retries}" if self.max_retries else name


@dataclass
class Record:
    unit: str
    manager: str
    reason: str
    detail: str
    phase: str
    figures: dict[str, float] = field(default_factory=dict)
    at: str = ""  # wall-clock time of the decision, UTC
    boot_id: str = ""
    step: Step = Step.STOP
    cgroup: str = ""
    mask_path: str = ""
    mask_made: bool = False
    links: list[LinkRecord] = field(default_factory=list)
    # (UTC time, what happened), in order: the record's own log.
    history: list[tuple[str, str]] = field(default_factory=list)
    problem: str = ""
    # A server blocked for loads its clients asked (`lms load`, `ollama run`): those units.
    clients: list[str] = field(default_factory=list)
    # A container's (manager "container"): the first block's account of it, kept as it was
    # when it is blocked again.
    container: ContainerState | None = None
    # Its stop's clock (core.block.Stopping, CLOCK_MONOTONIC: the same for every process
    # of one boot) and that boot: a guard restarted while it settles goes on from it.
    stopping: Stopping | None = None
    stopping_boot: str = ""
    # Fields of a newer version, kept as they were and written back (never read here).
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def ref(self) -> UnitRef:
        return UnitRef(self.manager, self.unit)

    @property
    def uid(self) -> int:
        return manager_uid(self.manager)

    def note(self, what: str) -> None:
        self.history.append((utc_now(), what))

    def move(self, to: Step) -> None:
        """Go on to step `to`: the one way a block changes step (core.block.StepError if
        its table does not allow it; the step is then left as it was)."""
        self.step = moved(str(self.ref), self.step, to, container=self.ref.is_container)

    def to_json(self) -> str:
        data = asdict(self)
        data = {**data.pop("extra"), **data}
        data["format"] = FORMAT
        data["step"] = str(self.step)  # the plain string, as ever
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> Record:
        """A record as written by to_json(), every field checked for its type (codec.py):
        a hand edit or a corruption that stays valid JSON is a RecordError naming the file
        and the field, never a TypeError later in a pass. Fields this version does not
        know are kept, unread, and written back."""
        try:
            data: object = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            if data.pop("format", None) != FORMAT:
                raise ValueError(f"not a format {FORMAT} record")
            known = codec.names(cls) - {"extra"}
            record = codec.decode(cls, {k: v for k, v in data.items() if k in known})
            record.extra = {k: v for k, v in data.items() if k not in known}
        except (ValueError, TypeError) as e:
            raise RecordError(f"{where}: unreadable record: {e}") from None
        if not record.unit or not record.manager:
            raise RecordError(f"{where}: unreadable record: bad unit or manager")
        if record.ref.is_container:
            # Its name and id go into the engine's URLs: checked as the engine checks them.
            if not _container_ok(record):
                raise RecordError(f"{where}: unreadable record: bad container name or id")
            if record.manager == CONTAINER:
                return record
        try:
            manager_uid(record.manager)  # 'system' or 'user:UID': what every reader assumes
        except ValueError:
            raise RecordError(f"{where}: unreadable record: bad manager") from None
        return record


def _container_ok(record: Record) -> bool:
    c = record.container
    return valid_name(record.ref.container) and (
        c is None
        or (
            valid_id(c.id)
            and isinstance(c.max_retries, int)
            and isinstance(c.restart, str)
            and isinstance(c.engine, str)
        )
    )


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def boot_id(proc: str = "/proc") -> str:
    try:
        with open(os.path.join(proc, "sys/kernel/random/boot_id")) as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class PendingStop:
    """A stop-only stop under way: which unit, its cgroup, when the stop went out
    (CLOCK_MONOTONIC, which is the same for every process of one boot) and in which boot.
    A brake's freeze is kept as one too: `sent` is when it froze the unit."""

    unit: str
    manager: str
    cgroup: str
    sent: float
    boot_id: str

    @classmethod
    def of(cls, ref: UnitRef, cgroup: str, sent: float, boot: str) -> PendingStop:
        return cls(ref.name, ref.manager, cgroup, sent, boot)

    @property
    def ref(self) -> UnitRef:
        return UnitRef(self.manager, self.unit)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "format": STOP_FORMAT}, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> PendingStop:
        try:
            data: object = json.loads(text)
            if not isinstance(data, dict) or data.pop("format", None) != STOP_FORMAT:
                raise ValueError(f"not a format {STOP_FORMAT} stop")
            known = codec.names(cls)  # (a newer version's fields: not this one's to keep)
            stop = codec.decode(cls, {k: v for k, v in data.items() if k in known})
            unit, manager = stop.unit, stop.manager
            ok = valid_name(unit) if manager == CONTAINER else _manager_ok(manager)
            if not unit or "/" in unit or not ok:
                raise ValueError("bad unit or manager")
        except (ValueError, TypeError) as e:
            raise RecordError(f"{where}: unreadable stop: {e}") from None
        return replace(stop, sent=float(stop.sent))


def _manager_ok(manager: str) -> bool:
    try:
        manager_uid(manager)
    except ValueError:
        return False
    return True


class RecordStore:
    def __init__(self, root: str) -> None:
        self.lock_problem = ""  # why the last lock(wait=...) could not even try
        self.root = root
        self.blocked = os.path.join(root, "blocked")
        self.released = os.path.join(root, "released")
        self.stopping = os.path.join(root, STOPPING)
        self._marks: dict[str, int] = {}  # releasing marks this process holds (flock)

    def save_stop(self, stop: PendingStop, kind: str = STOPPING) -> None:
        """Keep a stop-only stop until it has settled, or a brake's freeze until it is
        thawed or taken over (kind BRAKED); forget_stop() takes it off."""
        # A brake's file need only outlive the guard, not the boot (no freeze does): no
        # fsync, which under a page-cache flood would hold the brake for seconds.
        path, durable = os.path.join(self.root, kind, f"{stop.ref}.json"), kind != BRAKED
        own_tree().write(path, stop.to_json().encode(), create=MAKEDIRS, durable=durable)

    def forget_stop(self, ref: UnitRef, kind: str = STOPPING) -> None:
        with contextlib.suppress(OSError):
            own_tree().unlink(os.path.join(self.root, kind, f"{ref}.json"), durable=kind != BRAKED)

    def stops(self, kind: str = STOPPING) -> tuple[list[PendingStop], list[RecordError]]:
        """The stops of this kind kept, and an error for each file that is not one."""
        directory = os.path.join(self.root, kind)
        return _read_each(directory, PendingStop.from_json, OSError, limit=1 << 16)

    def path_of(self, ref: UnitRef) -> str:
        return os.path.join(self.blocked, f"{ref}.json")

    def generation(self) -> int:
        """Changes whenever a record is added, replaced or released; -1 when it cannot be
        told (read the records again)."""
        try:
            return os.stat(self.blocked).st_mtime_ns
        except FileNotFoundError:
            return 0
        except OSError:
            return -1

    def load(self, ref: UnitRef) -> Record | None:
        path = self.path_of(ref)
        try:
            with open(path, encoding="utf-8") as f:
                return Record.from_json(f.read(), path)
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise RecordError(f"{path}: cannot read: {e}") from None

    def all(self) -> tuple[list[Record], list[RecordError]]:
        """Every record, and an error for each file that is not one (left in place)."""
        return _read_each(self.blocked, Record.from_json, FileNotFoundError)

    def save(self, record: Record) -> tuple[str, str]:
        """Write the record, atomically. A file in its place whose content is not a record
        (a hand edit, a corruption, a newer format) is never written over: it is set
        aside beside it first, under a name that says so. Returns (that name, why), or
        ("", "") when there was none, for the caller to tell the admin. A file that cannot
        be read at all now (EIO, EMFILE) is not judged by its content, and not moved."""
        path = self.path_of(record.ref)
        aside = why = ""
        try:
            with open(path, "rb") as f:
                data: bytes | None = f.read()
        except OSError:
            data = None
        if data is not None:
            try:
                Record.from_json(data.decode("utf-8"), path)
            except (RecordError, UnicodeDecodeError) as e:
                why = str(e)
                stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                aside, n = f"{path}.unreadable-{stamp}", 1
                while os.path.lexists(aside):
                    n += 1
                    aside = f"{path}.unreadable-{stamp}-{n}"
                os.rename(path, aside)  # not *.json: no longer read as a record
        _write_atomic(path, record.to_json())
        return aside, why

    def retire(self, record: Record) -> str:
        """Move a released record into released/; returns its new path."""
        dest = self.archive(record)
        self.drop(record.ref)
        return dest

    def archive(self, record: Record) -> str:
        """A copy of the record in released/, under a name no other release has (two in
        one second get -2, -3, ...); its path. Written before a release changes anything:
        a disk too full for it stops the release before it begins."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        base = os.path.join(self.released, f"{stamp}-{record.ref}")
        dest, n = f"{base}.json", 1
        while own_tree().lstat(dest) is not None:
            n += 1
            dest = f"{base}-{n}.json"
        _write_atomic(dest, record.to_json())
        return dest

    def unarchive(self, path: str) -> None:
        """Take back the copy of a release that did not happen."""
        if os.path.dirname(path) != self.released:
            raise ValueError(f"{path}: not in {self.released}")
        own_tree().unlink(path)

    def drop(self, ref: UnitRef) -> None:
        """The record leaves blocked/ (its release is done), and its releasing mark."""
        try:
            own_tree().unlink(self.path_of(ref))  # fsyncs the directory
        finally:
            self.clear_releasing(ref)  # (not removed: the unit is guarded again)

    # A release under way marks its record, so that a guard that could not take the lock
    # in time leaves the unit alone instead of laying again the mask being removed, and a
    # container's block or recheck thread does not undo it. The mark is flock()ed by the
    # release for as long as it runs: a mark no process holds is a release that died, and
    # the guard guards the unit again. Before, a mark was fresh for 120 s by the wall
    # clock, which a long release outlived and a clock step made stale (F7).

    def mark_releasing(self, ref: UnitRef) -> None:
        """Mark a release of `ref` under way, held until clear_releasing() or this process
        ends. (Taken under the store's lock.) RecordError if another release holds it."""
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with own_tree().directory(self.blocked, create=MAKEDIRS) as dfd:
            fd = os.open(os.path.basename(self.path_of(ref)) + RELEASING, flags, 0o644, dir_fd=dfd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RecordError(f"{ref}: another release of it is under way") from None
        self._marks[str(ref)] = fd

    def clear_releasing(self, ref: UnitRef) -> None:
        """Take off the mark this store holds (never another release's)."""
        fd = self._marks.pop(str(ref), None)
        if fd is None:
            return
        with contextlib.suppress(OSError):
            own_tree().unlink(self.path_of(ref) + RELEASING)
        os.close(fd)

    def releasing(self, ref: UnitRef) -> bool:
        """Whether a release of the unit is under way: its mark is held by a live process."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            with own_tree().directory(self.blocked) as dfd:
                fd = os.open(os.path.basename(self.path_of(ref)) + RELEASING, flags, dir_fd=dfd)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
        return False

    @contextlib.contextmanager
    def held(self, ref: UnitRef, saved: bool, wait: float) -> Iterator[str]:
        """Around a change an engine keeps, made outside the guard's pass (a container's
        block or recheck thread): the store's lock (had or not, as a pass), and "" while
        the record is still the guard's, else why not: a release is under way, or took it
        (`saved`: the guard had written it). Faults F6 and F7."""
        with self.lock(wait=wait):
            try:
                gone = saved and self.load(ref) is None
            except RecordError:
                gone = False
            if self.releasing(ref):
                yield "a release of it is under way"
            else:
                yield "released meanwhile" if gone else ""

    def sweep(self) -> list[str]:
        """Remove what dead writers left: their temporary files (safefs), and the
        releasing mark of a record no longer there. Returns what it removed; what cannot
        be removed now (a read-only disk) is left for the next sweep. Needs no lock."""
        tree = own_tree()
        removed = tree.remove_leftovers(self.blocked) + tree.remove_leftovers(self.released)
        removed += tree.remove_leftovers(self.stopping)
        removed += tree.remove_leftovers(os.path.join(self.root, BRAKED))
        try:
            names = os.listdir(self.blocked)
        except OSError:
            names = []
        for name in names:
            path = os.path.join(self.blocked, name)
            if name.endswith(".json" + RELEASING) and not os.path.lexists(path[: -len(RELEASING)]):
                with contextlib.suppress(OSError):
                    if tree.unlink(path):
                        removed.append(path)
        return removed

    def write_released(self, path: str, record: Record) -> None:
        """Bring a retired record in released/ up to date (what its release did)."""
        if os.path.dirname(path) != self.released:
            raise ValueError(f"{path}: not in {self.released}")
        _write_atomic(path, record.to_json())

    @contextlib.contextmanager
    def lock(self, wait: float | None = None) -> Iterator[bool]:
        """Hold the store's lock; with `wait`, give up after that many seconds (yields False).

        With `wait`, the lock is best effort, as its timeout already says: a lock file
        that cannot even be made (a read-only or full state directory) yields False too,
        and `lock_problem` says why; the guard goes on guarding without it."""
        # Read-only: flock needs no more, a lock file once made still opens on a state
        # directory gone read-only, and an fd held for writing would keep the filesystem
        # from being remounted read-only under it.
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.lock_problem = ""
        try:
            with own_tree().directory(self.root, create=MAKEDIRS) as dfd:
                fd = os.open("lock", flags, 0o644, dir_fd=dfd)
        except OSError as e:
            if wait is None:
                raise
            self.lock_problem = f"cannot lock {self.root}: {e.strerror or e}"
            yield False
            return
        try:
            got = False
            deadline = None if wait is None else time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                    got = True
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    time.sleep(0.02)
            yield got
        finally:
            os.close(fd)


def _read_each(
    directory: str,
    parse: Callable[[str, str], T],
    missing: type[OSError],
    limit: int = -1,
) -> tuple[list[T], list[RecordError]]:
    """Each *.json file of `directory` parsed, in name order, and a RecordError for each
    that is not one (left in place); none where listing it raises `missing`."""
    found: list[T] = []
    errors: list[RecordError] = []
    try:
        names = sorted(os.listdir(directory))
    except missing:
        return found, errors
    except OSError as e:  # EIO, ENOTDIR, EMFILE: what is there is not known, not "none"
        return found, [Unlisted(f"{directory}: cannot list: {e}")]
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                found.append(parse(f.read(limit), path))
        except RecordError as e:
            errors.append(e)
        except (OSError, UnicodeDecodeError) as e:
            errors.append(RecordError(f"{path}: cannot read: {e}"))
    return found, errors


def _write_atomic(path: str, text: str) -> None:
    # Directories made as makedirs made them; a random temporary name per writer.
    own_tree().write(path, text.encode(), mode=0o644, create=MAKEDIRS)
