"""`spark-guard release`: undo exactly what the guard did to a unit, and nothing else.

The mask is removed if it is still ours, each enablement link is put back
with its old target, the record moves to released/, and the unit's manager
re-reads its units. For a user's manager all of it is done with that
user's file rights, inside their runtime dir (the mask) and their home from
passwd (the links): whatever they swapped for a symlink is refused, and what
is made is theirs. If something else now sits where a link was, or the way
to a link is no longer theirs, nothing is changed for that unit and the
conflict is named; a mask whose way is no longer theirs is not ours any
more, and is left alone.

A container (`container:NAME`) gets its exact restart policy back through its
engine, and is started if it ran when it was blocked (block/containers.py).
Its record is retired first, under the store's lock: a guard that sees it start
then judges it afresh instead of taking it for a blocked container running
again. If the engine refuses, the record is put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ..core.block import Step
from ..core.events import Event, EventKind
from ..core.snapshot import SYSTEM, USER_PREFIX, parse_ref
from ..system.engine import TIMEOUT, Engine
from ..system.managers import ManagerError, ManagerNotRunning, connect_to
from ..system.unitfiles import (
    Owner,
    UnitFileError,
    owner,
    present,
    remove_mask,
    restore_conflict,
    restore_link,
)
from .containers import ContainerBlockError
from .containers import release as release_container
from .records import Record, RecordError, RecordStore

# An admin's command, not the guard's loop: a container's start answers once it has started,
# which on a busy machine takes seconds (3-12 s measured under emulation in the VM test).
RELEASE_TIMEOUT = 60.0


class ReleaseError(RuntimeError):
    """A unit cannot be released; str() says which and why."""


@dataclass
class Released:
    record: Record
    archived: str
    mask_removed: bool
    restored: list[str] = field(default_factory=list)
    reload_error: str = ""
    # A container's: its restart policy put back, and whether it was started.
    policy: str = ""
    started: bool = False
    gone: bool = False  # the container no longer exists: nothing was left to put back


def select(records: Iterable[Record], names: Iterable[str], store: RecordStore) -> list[Record]:
    """The records named: 'llama.service', 'llama', or 'user:1000:llama.service'."""
    records = list(records)
    chosen: dict[str, Record] = {}
    for name in names:
        ref = parse_ref(name, SYSTEM)
        exact = [r for r in records if r.ref == ref]
        # A bare name: whichever manager it is blocked on, if only one.
        by_unit = exact or (
            [] if name.startswith(USER_PREFIX) else [r for r in records if r.unit == ref.name]
        )
        if not by_unit:
            raise ReleaseError(f"{name}: not blocked by spark-guard (no record in {store.blocked})")
        if len(by_unit) > 1:
            refs = ", ".join(str(r.ref) for r in by_unit)
            raise ReleaseError(f"{name}: blocked on more than one manager ({refs}); name one")
        chosen[str(by_unit[0].ref)] = by_unit[0]
    return list(chosen.values())


def release(
    record: Record,
    store: RecordStore,
    system_socket: str,
    user_runtime: str,
    engine_timeout: float = TIMEOUT,
    *,
    start: bool = True,
) -> Released:
    """Undo the block of `record`; a container is started again if it ran when blocked,
    unless `start` is False (the package's removal: like a unit re-enabled, it starts at
    the next boot, not now)."""
    if record.ref.is_container:
        return _release_container(record, store, engine_timeout, start, user_runtime)
    with _locked(store, record):
        current = store.load(record.ref)
        if current is None:
            raise ReleaseError(f"{record.ref}: already released")
        try:
            who = owner(current.manager, user_runtime, home=True)
        except UnitFileError as e:
            raise ReleaseError(f"{current.ref}: not released, {e}") from None
        # Every recorded link that is not there now: the ones the block removed, and one a
        # crash took between DisableUnitFiles and the record saying so.
        removed = [lr for lr in current.links if lr.removed or _absent(lr.path, who)]
        conflicts = [c for lr in removed if (c := restore_conflict(lr.link, who))]
        if conflicts:
            raise ReleaseError(f"{current.ref}: not released, " + "; ".join(conflicts))
        archived = _begin(store, current)
        mask_removed = False
        try:
            if current.mask_made and current.mask_path:
                try:
                    mask_removed = remove_mask(current.mask_path, who)
                except UnitFileError as e:
                    # The way to it was swapped since: ours is not there, what is there is not
                    # ours.
                    current.note(f"mask left alone: {e}")
            restored = [lr.path for lr in removed if restore_link(lr.link, who)]
        except (UnitFileError, OSError) as e:
            _abandon(store, current, archived)
            raise ReleaseError(f"{current.ref}: {e}; still blocked") from None
        except BaseException:
            _abandon(store, current, archived)
            raise
        current.note(
            f"released: mask {'removed' if mask_removed else 'not ours or gone'}; "
            f"links restored {restored}"
        )
        _finish(store, current, archived)
    done = Released(current, archived, mask_removed, restored)
    try:
        manager = connect_to(current.manager, system_socket, user_runtime)
    except ManagerNotRunning:
        return done  # it reads the unit files afresh when it starts
    except ManagerError as e:
        done.reload_error = str(e)
        return done
    try:
        manager.reload()  # LoadState flips back from masked
    except ManagerError as e:
        done.reload_error = str(e)
    finally:
        manager.close()
    return done


def _absent(path: str, who: Owner) -> bool:
    try:
        return not present(path, who)
    except UnitFileError:
        return False  # not reachable as its owner could: left as it is


@contextlib.contextmanager
def _locked(store: RecordStore, record: Record) -> Iterator[None]:
    """The store's lock, before a release changes anything: one that cannot be taken (its
    file cannot be made on a full or read-only disk) is said in one line."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(store.lock())
        except OSError as e:
            raise ReleaseError(
                f"{record.ref}: not released, {store.root} cannot be locked: "
                f"{e.strerror or e}; nothing was changed"
            ) from None
        yield


def _release_container(
    record: Record, store: RecordStore, timeout: float, start: bool, user_runtime: str
) -> Released:
    with _locked(store, record):
        current = store.load(record.ref)
        if current is None:
            raise ReleaseError(f"{record.ref}: already released")
        if current.container is None and current.step != Step.BLOCKED:
            raise ReleaseError(
                f"{current.ref}: not released, its block had not begun (no policy recorded)"
            )
        archived = _begin(store, current)
    if current.container is None:
        # Blocked with nothing recorded of it: removed (`--rm`) before its engine could be
        # asked. No policy was changed: nothing to put back, the record is retired.
        done = Released(current, archived, False, gone=True)
        with store.lock():
            _finish(store, current, archived)
        return done
    # The engine's stop or start may take its timeout: not under the store's lock, which the
    # guard's passes take (the releasing mark keeps the guard off this container meanwhile).
    container = current.container
    try:
        engine = Engine(
            container.engine, timeout=max(timeout, RELEASE_TIMEOUT), user_runtime=user_runtime
        )
        if engine.owner != current.ref.engine_owner:
            raise ContainerBlockError(f"{current.ref}: {container.engine} is not its engine")
        now = release_container(engine, current, start=start)
    except ContainerBlockError as e:
        with store.lock():
            _abandon(store, current, archived)
            current.note(f"release failed: {e}")
            with contextlib.suppress(OSError):
                store.save(current)  # its history; still blocked, and on record
        raise ReleaseError(f"{e}; still blocked") from None
    except BaseException:
        _abandon(store, current, archived)  # interrupted: still blocked, as on record
        raise
    done = Released(current, archived, False, policy=container.policy, gone=now is None)
    done.started = container.was_running and now is not None and now.running
    with store.lock():
        _finish(store, current, archived)  # its history: the policy put back, started
    return done


def _begin(store: RecordStore, record: Record) -> str:
    """Before a release changes anything: its archive, and the mark that keeps a guard
    that could not take the lock from laying the mask again meanwhile. A disk too full
    for them stops the release here, with nothing changed."""
    archived = ""
    try:
        archived = store.archive(record)
        store.mark_releasing(record.ref)
    except RecordError as e:  # another release's mark: not this one's to take off
        with contextlib.suppress(OSError, ValueError):
            store.unarchive(archived)
        raise ReleaseError(f"{e}; this one changed nothing") from None
    except OSError as e:
        _abandon(store, record, archived)
        raise ReleaseError(
            f"{record.ref}: not released, its archive cannot be written in {store.released}: "
            f"{e.strerror or e}; nothing was changed"
        ) from None
    return archived


def _abandon(store: RecordStore, record: Record, archived: str) -> None:
    """A release that did not happen: no archive of it, no mark; the record stays."""
    store.clear_releasing(record.ref)
    with contextlib.suppress(OSError, ValueError):
        store.unarchive(archived)


def _finish(store: RecordStore, record: Record, archived: str) -> None:
    """Its archive gets what the release did (if the disk takes it: the copy written
    before the release stands otherwise); then the record leaves blocked/. A record that
    cannot leave (the disk went read-only) is said in one line: the machine is released,
    but a guard would block the unit again once the release's mark is stale."""
    with contextlib.suppress(OSError):
        store.write_released(archived, record)
    try:
        store.drop(record.ref)
    except OSError as e:
        raise ReleaseError(
            f"{record.ref}: released, but its record {store.path_of(record.ref)} cannot be "
            f"removed: {e.strerror or e}; run the release again once it can, or the guard "
            "blocks the unit again"
        ) from None


def released_event(done: Released) -> Event:
    """What the journal is told of a release."""
    r = done.record
    if r.ref.is_container:
        return Event.of(
            EventKind.UNIT_RELEASED,
            "warning",
            unit=str(r.ref),
            manager=r.manager,
            restart=done.policy,
            record=done.archived,
            msg=f"{r.ref} released: "
            + (
                f"container {r.container.id[:12] if r.container else '?'} no longer exists, "
                "nothing to put back"
                if done.gone
                else f"restart policy {done.policy} put back"
            )
            + ("; started" if done.started else ""),
        )
    return Event.of(
        EventKind.UNIT_RELEASED,
        "warning",
        unit=str(r.ref),
        manager=r.manager,
        mask=r.mask_path if done.mask_removed else None,
        links_restored=done.restored,
        record=done.archived,
        error=done.reload_error or None,
        msg=f"{r.ref} released: unmasked, {len(done.restored)} link(s) restored"
        + (f"; reload failed: {done.reload_error}" if done.reload_error else ""),
    )
