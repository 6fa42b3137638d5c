"""`spark-guard harden UNIT`: write the hardening drop-in after showing it; `--undo` removes it.

Never edits the unit file: the drop-in goes to UNIT.d/50-spark-guard.conf in
the unit's manager's persistent config directory: /etc/systemd/system, or
~/.config/systemd/user in the user's home from passwd (never a directory
the manager names: a user's manager could name any). It must be in the
manager's UnitPath. A user's drop-in is written with that user's file
rights through their home without following a symlink, so it is theirs and
lands nowhere they could not write themselves. It is recorded under
<state>/hardened/ so --undo removes exactly it. A file there that
spark-guard did not write is left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import pwd
import sys
import time
from typing import Any

from .. import config as config_mod
from ..core.classify import expected_footprint
from ..core.config import Config, ConfigError
from ..core.quantities import format_size
from ..core.snapshot import SYSTEM, UnitRef, parse_ref
from ..foresight.predict import Predictor, owner_of, parse_environment
from ..system.gpu import probe_unified, unified_memory
from ..system.managers import Manager, ManagerError, command_manager, connect_to
from ..system.procfs import ProcError, ProcFS
from ..system.safefs import MAKEDIRS, Tree, UnsafePath, own_tree
from .harden import DROP_IN, MARKER, NOTE, drop_in, makes_room, memory_max

SYSTEM_CONFIG = "/etc/systemd/system"
READ_LIMIT = 1 << 20  # a drop-in or record of ours is a few hundred bytes


class HardenError(RuntimeError):
    pass


def _connect(ref: UnitRef, config: Config) -> Manager:
    try:
        return connect_to(ref.manager, config.system_manager, config.user_runtime)
    except ManagerError as e:
        raise HardenError(f"{ref}: {e}") from None


def _record_path(config: Config, ref: UnitRef) -> str:
    return os.path.join(config.state, "hardened", f"{ref}.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("unit", metavar="UNIT", help="the loader unit to harden")
    parser.add_argument("--yes", action="store_true", help="write without asking")
    parser.add_argument("--dry-run", action="store_true", help="only show what would be written")
    parser.add_argument("--undo", action="store_true", help="remove the drop-in harden wrote")


def run(args: argparse.Namespace) -> int:
    try:
        config = config_mod.load(args.config)
        ref = parse_ref(args.unit, command_manager())
        manager = _connect(ref, config)
    except (ConfigError, HardenError) as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 2
    try:
        return _undo(ref, manager, config) if args.undo else _harden(args, ref, manager, config)
    except UnsafePath as e:
        print(f"spark-guard: {e.strerror}", file=sys.stderr)  # names the path already
        return 2
    except (HardenError, ManagerError, ProcError, OSError) as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 2
    finally:
        manager.close()


def _harden(args: argparse.Namespace, ref: UnitRef, manager: Manager, config: Config) -> int:
    state = manager.unit_states([ref.name]).get(ref.name)
    if state is None or state.load_state == "not-found":
        raise HardenError(f"{ref}: no such unit")
    path, tree = _place(ref, manager)
    old = ""
    found = tree.read(path, READ_LIMIT)
    if found is not None:
        old = found.decode("utf-8", "replace")
        if not old.startswith(MARKER):
            raise HardenError(f"{path} exists and spark-guard did not write it; leaving it alone")
    memory = ProcFS(config.proc).memory()
    expected, why = _expected(ref, manager, config, memory.total)
    limit = memory_max(memory.total, config.reserve_for(memory.total), expected)
    why = f"MemoryMax: {why}"
    room = makes_room(
        ref.manager,
        config,
        unified=unified_memory(
            config.unified, probe_unified() if config.unified == "auto" and config.gpu else None
        ),
    )
    new = drop_in(
        str(ref), config, limit, why, time.strftime("%Y-%m-%d", time.gmtime()), make_room=room
    )
    if _body(old) == _body(new):
        print(f"{path}: already in place")
        return 0
    diff = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        fromfile=path if old else "/dev/null",
        tofile=path,
    )
    sys.stdout.writelines(diff)
    print(f"\nMemoryMax={format_size(limit)}. Note: {NOTE}")
    if args.dry_run:
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise HardenError("not a terminal: add --yes to write it, or --dry-run to only show it")
        if input(f"Write {path} and reload the {ref.manager} manager? [y/N] ").strip() != "y":
            print("left unchanged")
            return 1
    _write(path, new, tree, ref, config)
    manager.reload()
    print(f"wrote {path}; {ref.manager} manager reloaded")
    return 0


def _body(text: str) -> str:
    """The drop-in without its dated first line: unchanged settings are not a change."""
    return text.split("\n", 1)[1] if "\n" in text else text


def _expected(ref: UnitRef, manager: Manager, config: Config, total: int) -> tuple[int | None, str]:
    fixed = expected_footprint(ref, config)
    if fixed is not None:
        return fixed, "the [loaders.footprint] size plus 10 %"
    details = manager.unit_details(ref.name)
    predictor = Predictor()
    try:
        # With the unit owner's rights, as the guard reads models (foresight/predict.py): the
        # path is the user's text, and what the read says lands in a drop-in that user reads.
        prediction = predictor.predict(
            details.exec_start,
            parse_environment(details.environment),
            total,
            owner=owner_of(ref.manager),
        )
    finally:
        predictor.close()
    if prediction is not None and prediction.bytes is not None:
        return prediction.bytes, f"the estimated footprint ({prediction.source}) plus 10 %"
    return None, "MemTotal minus the reserve (its footprint is unknown)"


def _place(ref: UnitRef, manager: Manager) -> tuple[str, Tree]:
    """Where the unit's drop-in goes, and the tree it is read and written through."""
    if ref.manager == SYSTEM:
        directory, tree = SYSTEM_CONFIG, Tree("/")
    elif manager.uid == 0:
        # root's own user manager: where it reads units is root's to say, and every
        # directory on the way must be root's.
        found = manager.persistent_config_dir
        if found is None:
            raise HardenError(f"{ref.manager}: no persistent config directory in its UnitPath")
        directory, tree = found, Tree("/")
    else:
        try:
            entry = pwd.getpwuid(manager.uid)
        except KeyError:
            raise HardenError(f"{ref.manager}: no passwd entry for uid {manager.uid}") from None
        directory = os.path.join(entry.pw_dir, ".config", "systemd", "user")
        tree = Tree(entry.pw_dir, manager.uid, entry.pw_gid)
    if os.path.normpath(directory) not in {os.path.normpath(d) for d in manager.unit_path_dirs}:
        raise HardenError(
            f"{ref.manager}: {directory} is not in its UnitPath, so a drop-in there would not load"
        )
    return os.path.join(directory, f"{ref.name}.d", DROP_IN), tree


def _write(path: str, text: str, tree: Tree, ref: UnitRef, config: Config) -> None:
    # The record first: a drop-in on disk with no record could never be undone (a full
    # /var/lib fails here, before anything is written). UNIT.d is made if missing, by the
    # unit's owner (their rights, their file).
    made_dir = tree.lstat(os.path.dirname(path)) is None
    record = _record_path(config, ref)
    previous = _read_record(record)
    records = os.path.dirname(record)
    new_dir = own_tree().lstat(records) is None
    data = {"unit": str(ref), "path": path, "made_dir": (previous or {}).get("made_dir", made_dir)}
    own_tree().write(record, json.dumps(data).encode(), mode=0o644, create=MAKEDIRS)
    try:
        tree.write(path, text.encode(), mode=0o644, create=1)
    except OSError:
        if previous is None:  # nothing was written that it would undo: as it was before
            with contextlib.suppress(OSError):
                own_tree().unlink(record)
                if new_dir:
                    own_tree().rmdir(records)
        raise


def _read_record(path: str) -> dict[str, Any] | None:
    raw = own_tree().read(path, READ_LIMIT)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        if not isinstance(record, dict) or not isinstance(record.get("path"), str):
            raise ValueError("no path")
    except ValueError as e:
        raise HardenError(f"{path}: unreadable record: {e}") from None
    return record


def _undo(ref: UnitRef, manager: Manager, config: Config) -> int:
    record_path = _record_path(config, ref)
    record = _read_record(record_path)
    if record is None:
        raise HardenError(f"{ref}: not hardened by spark-guard (no {record_path})")
    path, tree = _place(ref, manager)
    if record["path"] != path:
        raise HardenError(
            f"{record_path} names {record['path']}, not {path}, where spark-guard writes; "
            "leaving it alone"
        )
    found = tree.read(path, READ_LIMIT)
    if found is not None:
        if not found.startswith(MARKER.encode()):
            raise HardenError(f"{path} was changed by someone else; leaving it alone")
        tree.unlink(path)
    if record.get("made_dir"):
        # Not empty: someone put other drop-ins there since; theirs stay.
        tree.rmdir(os.path.dirname(path))
    own_tree().unlink(record_path)
    manager.reload()
    print(f"removed {path}; {ref.manager} manager reloaded")
    return 0
