"""`spark-guard check-config [FILE]`: validate a config file, and say what its budget is on
this machine; exit 1 on errors, or on a budget that cannot protect anything."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import config as config_mod
from ..core.config import Config
from ..core.quantities import format_size
from ..system.procfs import ProcError, ProcFS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        type=Path,
        default=config_mod.DEFAULT_PATH,
        help=f"the file to check (default {config_mod.DEFAULT_PATH})",
    )


def budget_problems(c: Config, mem_total: int) -> list[str]:
    """What makes a valid config useless here: a reserve of nothing, or of everything (every
    loader refused, and nothing left to judge), a device floor of all the memory."""
    reserve = c.reserve_for(mem_total)
    floor = c.floor_for(mem_total)
    total = format_size(mem_total)
    out = []
    if reserve == 0:
        out.append("the reserve is 0 B: nothing is kept for a rescue (ssh, a shell)")
    elif reserve >= mem_total:
        out.append(
            f"the reserve {format_size(reserve)} is all of MemTotal {total}: every loader "
            "would be refused, and no figure can ever be above it"
        )
    if c.unified != "no" and floor >= mem_total:
        out.append(f"the device floor {format_size(floor)} is all of MemTotal {total}")
    return out


def run(args: argparse.Namespace) -> int:
    c = config_mod.load_for_command(args.file)
    if c is None:
        return 1
    said = (
        f"reserve the larger of {format_size(c.reserve)} and {c.reserve_percent:g}% of "
        f"MemTotal, steady phase: {c.steady}"
    )
    if not args.file.exists() and args.file == config_mod.DEFAULT_PATH:
        # The guard runs on its built-in defaults then: valid, but not a file's.
        said += f"; {args.file} is not there: the built-in defaults"
    try:
        mem_total = ProcFS(c.proc).memory().total
    except ProcError as e:
        print(f"{args.file}: ok ({said})")
        print(f"spark-guard: cannot say the budget on this machine: {e}", file=sys.stderr)
        return 0
    problems = budget_problems(c, mem_total)
    print(f"{args.file}: {'valid, but see below' if problems else 'ok'} ({said})")
    floor = c.floor_for(mem_total)
    print(
        f"on this machine (MemTotal {format_size(mem_total)}): reserve "
        f"{format_size(c.reserve_for(mem_total))}"
        + (
            f", device floor {format_size(floor)} (kept where memory is unified)"
            if c.unified != "no"
            else ""
        )
    )
    for problem in problems:
        print(f"spark-guard: {args.file}: {problem}", file=sys.stderr)
    return 1 if problems else 0
