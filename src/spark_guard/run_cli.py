"""`spark-guard run`: the guard itself, the daemon behind spark-guard.service.

This front door and the daemon must stay clear of the admin's tools (the
*_cli modules and what they import): the guard has to stay small and start fast.
"""

from __future__ import annotations

import argparse

from . import daemon
from . import log as log_mod


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="decide and log, but do not act")
    parser.add_argument(
        "--log",
        choices=("auto", "journal", "console"),
        default="auto",
        help="where events go (auto: the journal when run by systemd)",
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning"), default="info")


def run(args: argparse.Namespace) -> int:
    log_mod.configure(args.log, level=args.log_level)
    return daemon.run(args.config, dry_run=args.dry_run, log=log_mod.get_logger())
