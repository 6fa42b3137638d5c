"""Command line: thin front doors over the same sense -> decide -> act core."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from . import config as config_mod
from . import log as log_mod
from .config import format_size
from .text import printable as p

if TYPE_CHECKING:
    from .snapshot import Decision, Snapshot


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spark-guard",
        description=(
            "Keeps the rescue window open: stops model-loader units that threaten"
            " the memory budget."
        ),
    )
    p.add_argument("--version", action="version", version=f"spark-guard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the guard (the daemon behind spark-guard.service)")
    run.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)
    run.add_argument("--dry-run", action="store_true", help="decide and log, but do not act")
    run.add_argument(
        "--log",
        choices=("auto", "journal", "console"),
        default="auto",
        help="where events go (auto: the journal when run by systemd)",
    )
    run.add_argument("--log-level", choices=("debug", "info", "warning"), default="info")

    check = sub.add_parser("check-config", help="validate a config file; non-zero exit on errors")
    check.add_argument("file", nargs="?", type=Path, default=config_mod.DEFAULT_PATH)

    dump = sub.add_parser("dump", help="sense and decide once, print what the guard sees")
    dump.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)
    dump.add_argument("--json", action="store_true")

    pre = sub.add_parser(
        "preflight",
        help="would this load fit now? exit 0 if it fits, 1 if not (usable as ExecStartPre=)",
    )
    pre.add_argument("target", metavar="UNIT|MODEL.gguf")
    pre.add_argument("-c", "--ctx", type=int, help="context size (0: the trained one)")
    pre.add_argument("-np", "--parallel", type=int, help="slots")
    pre.add_argument("-ctk", "--cache-type-k")
    pre.add_argument("-ctv", "--cache-type-v")
    pre.add_argument("-fa", "--flash-attn", choices=("on", "off", "auto"))
    pre.add_argument("-ub", "--ubatch", type=int)
    pre.add_argument("--swa-full", action="store_true", default=None)
    pre.add_argument("--mmproj", help="the multimodal projector file loaded with the model")
    pre.add_argument("--json", action="store_true")
    pre.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)

    audit = sub.add_parser(
        "audit", help="every model loader on every level, what can wedge the machine, the fixes"
    )
    audit.add_argument("units", nargs="*", metavar="UNIT", help="also check these units by name")
    audit.add_argument("--json", action="store_true")
    audit.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)

    status = sub.add_parser("status", help="what the running guard sees and has done")
    status.add_argument("--json", action="store_true")
    status.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)

    harden = sub.add_parser(
        "harden", help="write a hardening drop-in for a loader unit (shows it, asks first)"
    )
    harden.add_argument("unit", metavar="UNIT")
    harden.add_argument("--yes", action="store_true", help="write without asking")
    harden.add_argument("--dry-run", action="store_true", help="only show what would be written")
    harden.add_argument("--undo", action="store_true", help="remove the drop-in harden wrote")
    harden.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)

    rescue = sub.add_parser(
        "rescue", help="stop, mask and disable every model loader now, on every level"
    )
    rescue.add_argument(
        "--stop-timeout", type=float, default=5.0, help="seconds before SIGKILL (default 5)"
    )
    rescue.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)

    doctor = sub.add_parser(
        "doctor", help="why a model server died or the GPU fell off: Xid, driver, card, logs"
    )
    doctor.add_argument(
        "--since",
        default="24h ago",
        help="how far back to read the logs, as journalctl --since takes it",
    )
    doctor.add_argument(
        "--directory", help="read the journal files in this directory (a rescued disk's)"
    )
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)

    release = sub.add_parser(
        "release", help="undo what the guard did to a unit: unmask, re-enable with the same links"
    )
    release.add_argument(
        "units", nargs="*", metavar="UNIT", help="llama.service, user:UID:x.service"
    )
    release.add_argument("--all", action="store_true", help="release every blocked unit")
    release.add_argument("--config", type=Path, default=config_mod.DEFAULT_PATH)
    return p


# The admin's tools, each a module imported only when it runs (the daemon needs none).
_TOOLS = {
    "status": "status_cli",
    "harden": "harden_cli",
    "rescue": "rescue_cli",
    "audit": "audit_cli",
    "doctor": "doctor_cli",
    "preflight": "preflight_cli",
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        log_mod.configure(args.log, level=args.log_level)
        from .daemon import run  # imported here: the other commands need none of it

        return run(args.config, dry_run=args.dry_run, log=log_mod.get_logger())
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "dump":
        return _dump(args.config, args.json)
    if args.command == "release":
        return _release(args.config, args.units, args.all)
    if args.command in _TOOLS:
        module = importlib.import_module(f".{_TOOLS[args.command]}", __package__)
        return int(module.run(args))
    return 2


def _check_config(path: Path) -> int:
    c = config_mod.load_for_command(path)
    if c is None:
        return 1
    print(
        f"{path}: ok (reserve {format_size(c.reserve)} or {c.reserve_percent:g}% of MemTotal, "
        f"steady phase: {c.steady})"
    )
    return 0


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if hasattr(obj, "manager") and hasattr(obj, "name"):
            return str(obj)
        return out
    if isinstance(obj, list | tuple):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def _dump(path: Path, as_json: bool) -> int:
    from .policy import decide
    from .procfs import ProcError
    from .sensor import Sensor

    config = config_mod.load_for_command(path)
    if config is None:
        return 1
    log_mod.configure("console", level="warning")
    sensor = Sensor(config, log_mod.get_logger())
    sensor.wait_for_models = True  # a command waits for model headers (up to their deadline)
    try:
        sensor.refresh_managers()
        managers = sorted(sensor.managers)
        snapshot = sensor.snapshot()
    except ProcError as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 1
    finally:
        sensor.close()
    decision = decide(snapshot, config)
    if as_json:
        json.dump(
            {"snapshot": _plain(snapshot), "decision": _plain(decision), "managers": managers},
            sys.stdout,
            indent=1,
        )
        print()
        return 0
    _print_dump(snapshot, decision)
    return 0


def _print_dump(snapshot: Snapshot, decision: Decision) -> None:
    m = snapshot.memory
    print(
        f"phase {decision.phase}; MemAvailable {format_size(m.available)} of "
        f"{format_size(m.total)}; reserve {format_size(decision.reserve)}; "
        f"GPU accounting {'on' if snapshot.gpu_accounting else 'off'}"
    )
    # Unit names, evidence and details can hold a user's text: printed inert.
    for loader in decision.loaders:
        u = loader.usage
        print(
            f"loader {p(loader.ref)}: {p(u.active_state)}, rss {format_size(u.rss)}, "
            f"gpu {format_size(u.gpu)}, expected "
            f"{format_size(loader.expected) if loader.expected else '-'}; "
            f"{p(', '.join(loader.evidence))}"
        )
    for action in decision.actions:
        print(f"would {action.kind} {p(action.unit)}: {p(action.reason)}: {p(action.detail)}")


def _release(path: Path, names: list[str], everything: bool) -> int:
    from . import banner
    from .records import RecordStore
    from .release import ReleaseError, log_release, release, select

    config = config_mod.load_for_command(path)
    if config is None:
        return 1
    store = RecordStore(config.state)
    records, errors = store.all()
    for error in errors:
        print(f"spark-guard: {p(error)}", file=sys.stderr)
    if everything == bool(names):
        blocked = p(", ".join(str(r.ref) for r in records) or "nothing")
        print(
            f"spark-guard: name the units to release, or --all (blocked: {blocked})",
            file=sys.stderr,
        )
        return 2
    try:
        chosen = records if everything else select(records, names, store)
    except ReleaseError as e:
        print(f"spark-guard: {p(e)}", file=sys.stderr)
        return 1
    _configure_audit_log()
    log = log_mod.get_logger()
    status = 0
    for record in chosen:
        try:
            done = release(record, store, config.system_manager, config.user_runtime)
        except ReleaseError as e:
            print(f"spark-guard: {p(e)}", file=sys.stderr)
            status = 1
            continue
        log_release(log, done)
        print(
            f"released {p(record.ref)}: "
            + ("mask removed" if done.mask_removed else "no mask of ours left")
            + f", {len(done.restored)} link(s) restored"
            + (f"; reload failed ({p(done.reload_error)})" if done.reload_error else "")
        )
    remaining, _ = store.all()
    try:
        banner.publish(remaining, config.motd, config.issue)
    except OSError as e:
        print(f"spark-guard: cannot update the login note: {e}", file=sys.stderr)
        status = 1
    return status


def _configure_audit_log() -> None:
    """What an admin does by hand goes to the journal too, next to what the guard did."""
    try:
        log_mod.configure("journal")
    except (ImportError, OSError):
        log_mod.configure("console", level="error")
