"""The block's steps that change a manager's files: plan, disable, mask; and verify.

Each does its step's work on the record (what it plans, what it found removed) and
raises (ManagerError, UnitFileError, OSError) when the step is not done; the blocker
moves the record on, saves it, and says the problem. Every path under a user's tree
is reached from a root-owned anchor as its owner could (system/unitfiles.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping

from ..core.block import Verdict, verdict, verified
from ..core.events import Event, EventKind, tell
from ..system.managers import ManagerError
from ..system.unitfiles import (
    UnitFileError,
    lay_mask,
    mask_dir,
    owner,
    present,
    read_link,
    shadowing_file,
)
from .ledger import Ledger
from .ports import ManagerPort
from .records import LinkRecord, Record


def plan(
    record: Record,
    manager: ManagerPort,
    user_runtime: str,
    on_disk: Callable[[], Record | None],
) -> None:
    """Record the links a disable removes (with their targets and owners) and where the
    mask goes. `on_disk` reads the unit's record on disk now, another guard's perhaps (a
    rescue beside the daemon, or this one before a restart), which may have planned and
    disabled already: its links are gone from the manager's view then. It is adopted: a
    re-plan never records fewer links, nor forgets one was removed, nor takes back a mask
    it made. It is read after the manager's links: a plan saved before its disable is
    then on disk whenever the manager no longer lists them."""
    # Where the mask goes is ours to say; the manager only has to read it from there.
    control = mask_dir(record.manager, user_runtime)
    if control not in {os.path.normpath(d) for d in manager.unit_path_dirs}:
        raise UnitFileError(
            f"{record.manager}: {control} is not in its UnitPath, so a mask there would not hold"
        )
    who = owner(record.manager, user_runtime)
    links = []
    for path in manager.unit_file_links(record.unit):
        try:
            link = read_link(path, who)
        except UnitFileError as e:
            # Not readable as its owner could: not recorded, so never put back.
            record.note(f"plan: {path} left out ({e})")
            continue
        if link is not None:
            links.append(LinkRecord(link.path, link.target, link.uid, link.gid))
    earlier = on_disk()
    for lr in [*record.links, *(earlier.links if earlier else [])]:
        mine = next((x for x in links if x.path == lr.path), None)
        if mine is None:
            links.append(LinkRecord(lr.path, lr.target, lr.uid, lr.gid, lr.removed))
        elif lr.removed:
            mine.removed = True
    record.links = links
    if not record.cgroup and record.unit.endswith(".service"):
        # Only for the kill of last resort; the snapshot usually had it.
        with contextlib.suppress(ManagerError):
            record.cgroup = manager.unit_control_group(record.unit)
    record.mask_path = os.path.join(control, record.unit)
    # A mask someone else laid stays theirs: release leaves it.
    try:
        made = not present(record.mask_path, who)
    except UnitFileError:
        made = True  # the way there is not theirs: the mask step says so
    laid = earlier is not None and earlier.mask_made and earlier.mask_path == record.mask_path
    record.mask_made = made or laid or record.mask_made
    record.note(f"plan: mask {record.mask_path}; links {[lr.path for lr in links]}")


def disable(record: Record, manager: ManagerPort, user_runtime: str) -> None:
    """DisableUnitFiles, then check that each recorded link is gone."""
    if any(not lr.removed for lr in record.links):
        manager.disable_unit_files(record.unit)
    who = owner(record.manager, user_runtime)
    left = []
    for lr in record.links:
        if lr.removed:
            continue
        try:
            there = present(lr.path, who)
        except UnitFileError as e:
            # The way to it changed since the plan: not ours to check, nor to put back.
            record.note(f"disable: {lr.path} cannot be checked ({e}); not restored")
            continue
        if there:
            left.append(lr.path)
        else:
            lr.removed = True
            record.note(f"disabled: removed {lr.path} -> {lr.target}")
    if left:
        raise ManagerError(f"{record.manager} left {', '.join(left)} in place")


def mask(record: Record, user_runtime: str) -> None:
    """Lay the mask in the manager's runtime control directory."""
    expected = os.path.join(mask_dir(record.manager, user_runtime), record.unit)
    if record.mask_path != expected:  # a record from before the guard chose it itself
        raise UnitFileError(f"{record.mask_path}: not where a mask goes ({expected})")
    lay_mask(record.mask_path, owner(record.manager, user_runtime))
    record.note(f"masked: {record.mask_path} -> /dev/null")


def mask_present(record: Record, user_runtime: str) -> bool:
    """Whether its mask is there (a record with none planned yet: as good as there)."""
    if not record.mask_path:
        return True
    try:
        return present(record.mask_path, owner(record.manager, user_runtime))
    except UnitFileError:
        return False  # not reachable safely: laying it again names the problem


def _not_masked(record: Record, manager: ManagerPort, user_runtime: str, load_state: str) -> str:
    """Why a unit whose mask was laid does not read masked: a file that outranks it, named
    where there is one."""
    try:
        shadow = shadowing_file(
            manager.unit_path_dirs,
            os.path.dirname(record.mask_path),
            record.unit,
            owner(record.manager, user_runtime),
        )
    except UnitFileError:
        shadow = None
    why = f"{shadow} outranks the mask" if shadow else "LoadState is not masked"
    return f"verify: {record.ref}: {why} (LoadState={load_state})"


def verify(
    batch: list[Record], managers: Mapping[str, ManagerPort], ledger: Ledger, user_runtime: str
) -> None:
    """Read LoadState back, batched per manager: it must read 'masked' (a unit still loaded
    needs one daemon-reload); one running again goes back to its stop."""
    for key in sorted({r.manager for r in batch}):
        records = [r for r in batch if r.manager == key]
        manager = managers.get(key)
        if manager is None:
            continue
        try:
            states = manager.unit_states([r.unit for r in records])
            if any(states[r.unit].load_state != "masked" for r in records if r.unit in states):
                manager.reload()
                for r in records:
                    r.note("manager reloaded to load the mask")
                states = manager.unit_states([r.unit for r in records])
        except ManagerError as e:
            for r in records:
                ledger.problem(r, f"verify: {e}")
            continue
        for r in records:
            st = states.get(r.unit)
            found = verdict(st.load_state if st else None, st.active_state if st else None)
            to = verified(found)
            if to is not None and not ledger.move(r, to):
                continue  # (said: a step change the table refuses)
            if found == Verdict.BLOCKED:
                _blocked(r, ledger)
            elif found == Verdict.RUNNING and st is not None:
                # Something started it again before the mask took.
                ledger.problem(r, f"verify: {r.ref} is {st.active_state} again")
            else:
                load = st.load_state if st else "?"
                ledger.problem(r, _not_masked(r, manager, user_runtime, load))


def _blocked(record: Record, ledger: Ledger) -> None:
    ledger.solved(record)
    removed = [lr.path for lr in record.links if lr.removed]
    record.note("verified: LoadState=masked")
    tell(
        ledger.log,
        Event.of(
            EventKind.UNIT_BLOCKED,
            "warning",
            unit=str(record.ref),
            manager=record.manager,
            reason=record.reason,
            mask=record.mask_path,
            links_removed=removed,
            record=ledger.store.path_of(record.ref),
            clients=record.clients or None,
            **record.figures,
            msg=f"{record.ref} is stopped, masked and disabled ({record.reason}: "
            f"{record.detail}); undo with: spark-guard release {record.ref}",
        ),
    )
