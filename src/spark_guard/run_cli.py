"""`spark-guard run`: the guard itself, the daemon behind spark-guard.service.

This front door and the daemon must stay clear of the admin's tools (the
*_cli modules and what they import): the guard has to stay small and start fast.
"""

from __future__ import annotations

import argparse
import os
import sys

# The daemon speaks no TLS: its sockets are unix sockets (systemd, the container engines,
# the journal). But structlog imports asyncio, and asyncio imports ssl when it can, and
# OpenSSL's start-up costs about 4 MB that mlockall() then keeps resident. While the
# daemon's modules are imported a None entry makes `import ssl` fail, so asyncio takes the
# path it takes on a Python built without OpenSSL. The entry goes afterwards: the metrics
# (prometheus_client, only where a textfile directory exists) still load ssl if they run.
_blocked = "ssl" not in sys.modules
if _blocked:
    sys.modules["ssl"] = None  # type: ignore[assignment]
try:
    from . import daemon
    from . import log as log_mod
finally:
    if _blocked and sys.modules.get("ssl", False) is None:
        del sys.modules["ssl"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="decide and log, but do not act")
    parser.add_argument(
        "--log",
        choices=("auto", "journal", "console"),
        default="auto",
        help="where events go (auto: the journal when run by systemd)",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning"),
        default="info",
        help="the least severe event logged (default info)",
    )


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        # It runs, and says at once what it cannot do, rather than "watching" in silence.
        print(
            "spark-guard run: not root: it watches, but cannot stop, mask or disable PID "
            "1's units or other users', write its records or make room; run it as root "
            "(the package's spark-guard.service)",
            file=sys.stderr,
        )
    log_mod.configure(args.log, level=args.log_level)
    return daemon.run(args.config, dry_run=args.dry_run, log=log_mod.get_logger())
