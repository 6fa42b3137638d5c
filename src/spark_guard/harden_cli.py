"""`spark-guard harden UNIT`: write the hardening drop-in after showing it; `--undo` removes it.

Never edits the unit file: the drop-in goes to UNIT.d/50-spark-guard.conf in
the unit's manager's persistent config directory (/etc/systemd/system, or
the user's ~/.config/systemd/user), owned as the manager's user would own
it, and is recorded under <state>/hardened/ so --undo removes exactly it.
A file there that spark-guard did not write is left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import sys
import time

from . import config as config_mod
from .classify import expected_footprint
from .config import Config, ConfigError, format_size
from .foresight import Predictor, parse_environment
from .harden import DROP_IN, MARKER, NOTE, drop_in, memory_max
from .managers import Manager, ManagerError, command_manager, connect_to
from .procfs import ProcError, ProcFS
from .snapshot import UnitRef, parse_ref


class HardenError(RuntimeError):
    pass


def _connect(ref: UnitRef, config: Config) -> Manager:
    try:
        return connect_to(ref.manager, config.system_manager, config.user_runtime)
    except ManagerError as e:
        raise HardenError(f"{ref}: {e}") from None


def _record_path(config: Config, ref: UnitRef) -> str:
    return os.path.join(config.state, "hardened", f"{ref}.json")


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
    except (HardenError, ManagerError, ProcError, OSError) as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 2
    finally:
        manager.close()


def _harden(args: argparse.Namespace, ref: UnitRef, manager: Manager, config: Config) -> int:
    state = manager.unit_states([ref.name]).get(ref.name)
    if state is None or state.load_state == "not-found":
        raise HardenError(f"{ref}: no such unit")
    directory = manager.persistent_config_dir
    if directory is None:
        raise HardenError(f"{ref.manager}: no persistent config directory in its UnitPath")
    path = os.path.join(directory, f"{ref.name}.d", DROP_IN)
    old = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = f.read()
        if not old.startswith(MARKER):
            raise HardenError(f"{path} exists and spark-guard did not write it; leaving it alone")
    memory = ProcFS(config.proc).memory()
    expected, why = _expected(ref, manager, config, memory.total)
    limit = memory_max(memory.total, config.reserve_for(memory.total), expected)
    why = f"MemoryMax: {why}"
    new = drop_in(str(ref), config, limit, why, time.strftime("%Y-%m-%d", time.gmtime()))
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
    _write(path, new, manager.uid, ref, config)
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
    prediction = Predictor().predict(
        details.exec_start, parse_environment(details.environment), total
    )
    if prediction is not None and prediction.bytes is not None:
        return prediction.bytes, f"the estimated footprint ({prediction.source}) plus 10 %"
    return None, "MemTotal minus the reserve (its footprint is unknown)"


def _write(path: str, text: str, uid: int, ref: UnitRef, config: Config) -> None:
    directory = os.path.dirname(path)
    made_dir = not os.path.isdir(directory)
    if made_dir:
        os.mkdir(directory, 0o755)
        if uid:
            os.chown(directory, uid, uid_gid(directory))
    tmp = f"{path}.{os.getpid()}.tmp"  # two writers (daemon, release) never share one
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    if uid:
        os.chown(tmp, uid, uid_gid(directory))
    os.replace(tmp, path)
    record = _record_path(config, ref)
    os.makedirs(os.path.dirname(record), exist_ok=True)
    previous = {}
    if os.path.exists(record):
        with open(record) as f:
            previous = json.load(f)
    with open(record, "w") as f:
        json.dump(
            {"unit": str(ref), "path": path, "made_dir": previous.get("made_dir", made_dir)}, f
        )


def uid_gid(directory: str) -> int:
    """The group of the directory's parent: the user's own group, as their manager would use."""
    return os.stat(os.path.dirname(directory)).st_gid


def _undo(ref: UnitRef, manager: Manager, config: Config) -> int:
    record_path = _record_path(config, ref)
    try:
        with open(record_path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise HardenError(f"{ref}: not hardened by spark-guard (no {record_path})") from None
    path = record["path"]
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if not f.read().startswith(MARKER):
                raise HardenError(f"{path} was changed by someone else; leaving it alone")
        os.unlink(path)
    if record.get("made_dir"):
        # Not empty: someone put other drop-ins there since; theirs stay.
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
    os.unlink(record_path)
    manager.reload()
    print(f"removed {path}; {ref.manager} manager reloaded")
    return 0
