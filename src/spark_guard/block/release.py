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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..snapshot import SYSTEM, parse_ref
from ..system.managers import ManagerError, ManagerNotRunning, connect_to
from ..system.unitfiles import (
    UnitFileError,
    owner,
    remove_mask,
    restore_conflict,
    restore_link,
)
from .records import Record, RecordStore

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import


class ReleaseError(RuntimeError):
    """A unit cannot be released; str() says which and why."""


@dataclass
class Released:
    record: Record
    archived: str
    mask_removed: bool
    restored: list[str] = field(default_factory=list)
    reload_error: str = ""


def select(records: Iterable[Record], names: Iterable[str], store: RecordStore) -> list[Record]:
    """The records named: 'llama.service', 'llama', or 'user:1000:llama.service'."""
    records = list(records)
    chosen: dict[str, Record] = {}
    for name in names:
        ref = parse_ref(name, SYSTEM)
        exact = [r for r in records if r.ref == ref]
        # A bare name: whichever manager it is blocked on, if only one.
        by_unit = exact or (
            [] if name.startswith("user:") else [r for r in records if r.unit == ref.name]
        )
        if not by_unit:
            raise ReleaseError(f"{name}: not blocked by spark-guard (no record in {store.blocked})")
        if len(by_unit) > 1:
            refs = ", ".join(str(r.ref) for r in by_unit)
            raise ReleaseError(f"{name}: blocked on more than one manager ({refs}); name one")
        chosen[str(by_unit[0].ref)] = by_unit[0]
    return list(chosen.values())


def release(record: Record, store: RecordStore, system_socket: str, user_runtime: str) -> Released:
    with store.lock():
        current = store.load(record.ref)
        if current is None:
            raise ReleaseError(f"{record.ref}: already released")
        try:
            who = owner(current.manager, user_runtime, home=True)
        except UnitFileError as e:
            raise ReleaseError(f"{current.ref}: not released, {e}") from None
        removed = [lr for lr in current.links if lr.removed]
        conflicts = [c for lr in removed if (c := restore_conflict(lr.link, who))]
        if conflicts:
            raise ReleaseError(f"{current.ref}: not released, " + "; ".join(conflicts))
        mask_removed = False
        if current.mask_made and current.mask_path:
            try:
                mask_removed = remove_mask(current.mask_path, who)
            except UnitFileError as e:
                # The way to it was swapped since: ours is not there, what is there is not ours.
                current.note(f"mask left alone: {e}")
        try:
            restored = [lr.path for lr in removed if restore_link(lr.link, who)]
        except (UnitFileError, OSError) as e:
            raise ReleaseError(f"{current.ref}: {e}") from None
        current.note(
            f"released: mask {'removed' if mask_removed else 'not ours or gone'}; "
            f"links restored {restored}"
        )
        archived = store.retire(current)
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


def log_release(log: FilteringBoundLogger, done: Released) -> None:
    r = done.record
    log.warning(
        "unit-released",
        unit=str(r.ref),
        manager=r.manager,
        mask=r.mask_path if done.mask_removed else None,
        links_restored=done.restored,
        record=done.archived,
        error=done.reload_error or None,
        msg=f"{r.ref} released: unmasked, {len(done.restored)} link(s) restored"
        + (f"; reload failed: {done.reload_error}" if done.reload_error else ""),
    )
