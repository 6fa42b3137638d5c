"""`spark-guard check-config [FILE]`: validate a config file; exit 1 on errors."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import config as config_mod
from ..core.quantities import format_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", type=Path, default=config_mod.DEFAULT_PATH)


def run(args: argparse.Namespace) -> int:
    c = config_mod.load_for_command(args.file)
    if c is None:
        return 1
    print(
        f"{args.file}: ok (reserve {format_size(c.reserve)} or {c.reserve_percent:g}% of "
        f"MemTotal, steady phase: {c.steady})"
    )
    return 0
