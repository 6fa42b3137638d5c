"""`spark-guard release UNIT... | --all`: undo what the guard did to a unit.

Unmasks it and re-enables it with the same links it had, then updates the
login note. Exit 2 when neither units nor --all (or both) are given.
"""

from __future__ import annotations

import argparse
import sys

from .. import config as config_mod
from .. import log as log_mod
from ..block import banner
from ..block.records import Record, RecordStore
from ..block.release import ReleaseError, release, released_event, select
from ..core.events import tell
from ..core.text import printable as p
from ..exits import USAGE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "units",
        nargs="*",
        metavar="UNIT",
        help="llama.service, user:UID:x.service, container:NAME",
    )
    parser.add_argument("--all", action="store_true", help="release every blocked unit")
    parser.add_argument(
        "--no-start",
        action="store_true",
        help="a container gets its restart policy back but is not started now",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be put back; change nothing"
    )


def run(args: argparse.Namespace) -> int:
    names: list[str] = args.units
    config = config_mod.load_for_command(args.config)
    if config is None:
        return USAGE
    store = RecordStore(config.state)
    records, errors = store.all()
    for error in errors:
        print(f"spark-guard: {p(error)}", file=sys.stderr)
    if args.all == bool(names):
        blocked = p(", ".join(str(r.ref) for r in records) or "nothing")
        what = "units or --all, not both" if args.all else "the units to release, or --all"
        print(f"spark-guard: name {what} (blocked: {blocked})", file=sys.stderr)
        return 2
    try:
        chosen = records if args.all else select(records, names, store)
    except ReleaseError as e:
        print(f"spark-guard: {p(e)}", file=sys.stderr)
        return 1
    if args.dry_run:
        for record in chosen:
            print(_would(record, start=not args.no_start))
        if not chosen:
            print(f"nothing blocked (no record in {config.state})")
        return 0
    _configure_audit_log()
    log = log_mod.get_logger()
    status = 0
    for record in chosen:
        try:
            done = release(
                record,
                store,
                config.system_manager,
                config.user_runtime,
                config.engine_timeout,
                start=not args.no_start,
            )
        except ReleaseError as e:
            print(f"spark-guard: {p(e)}", file=sys.stderr)
            status = 1
            continue
        except OSError as e:  # one line, and --all goes on to the next unit
            print(f"spark-guard: {p(record.ref)}: not released: {p(e)}", file=sys.stderr)
            status = 1
            continue
        tell(log, released_event(done))
        if record.ref.is_container:
            print(
                f"released {p(record.ref)}: "
                + (
                    "the container no longer exists, nothing to put back"
                    if done.gone
                    else f"restart policy {p(done.policy)} put back"
                )
                + ("; started" if done.started else "")
            )
            continue
        print(
            f"released {p(record.ref)}: "
            + ("mask removed" if done.mask_removed else "no mask of ours left")
            + f", {len(done.restored)} link(s) restored"
            + (f"; reload failed ({p(done.reload_error)})" if done.reload_error else "")
        )
    remaining, _ = store.all()
    for line in _same_load(chosen, remaining):
        print(line)
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


def _same_load(released: list[Record], remaining: list[Record]) -> list[str]:
    """A server blocked for a client's load and the client are two records, one event:
    each is released on its own (the server back without the load is often what the
    admin wants), and the one left blocked is named, with how to release it too."""
    left = {str(r.ref) for r in remaining}
    lines: list[str] = []
    for record in released:
        lines.extend(
            f"{p(client)} asked the load {p(record.ref)} was blocked for, and is still "
            f"blocked: spark-guard release {p(client)}"
            for client in record.clients
            if client in left
        )
        lines.extend(
            f"{p(server.ref)}, blocked for the load {p(record.ref)} asked, is still "
            f"blocked: spark-guard release {p(server.ref)}"
            for server in remaining
            if str(record.ref) in server.clients
        )
    return lines


def _would(record: Record, *, start: bool) -> str:
    """What a release of `record` would put back, from the record alone (nothing asked)."""
    if record.container is not None:
        c = record.container
        return f"would release {p(record.ref)}: restart policy {p(c.policy)} put back" + (
            "; started again" if start and c.was_running else ""
        )
    lines = [f"would release {p(record.ref)}:"]
    if record.mask_path:
        lines.append(f"  remove the mask {p(record.mask_path)} (if it is still the guard's)")
    lines.extend(
        f"  put back {p(link.path)} -> {p(link.target)} (uid {link.uid})" for link in record.links
    )
    if not record.mask_path and not record.links:
        lines.append("  nothing recorded to put back")
    return "\n".join(lines)
