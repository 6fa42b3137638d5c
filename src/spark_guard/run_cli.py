"""`spark-guard run`: the guard itself, the daemon behind spark-guard.service.

This front door and the daemon must stay clear of the admin's tools (the
*_cli modules and what they import): the guard has to stay small and start fast.
"""

from __future__ import annotations

import argparse
import sys

# The daemon speaks no TLS: its sockets are unix sockets (systemd, the container engines,
# the journal). But structlog imports asyncio, and asyncio imports ssl when it can, and
# OpenSSL's start-up costs about 4 MB that mlockall() then keeps resident. A None entry
# makes `import ssl` fail, so asyncio takes the path it takes on a Python built without
# OpenSSL. Set before the daemon's imports; a process that has ssl already keeps it.
sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]

from . import daemon  # noqa: E402
from . import log as log_mod  # noqa: E402


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
