"""Command line: thin front doors over the same sense -> decide -> act core.

Each command is a module of its own with `add_arguments(parser)` and
`run(args) -> int`; this file only lists them and dispatches. Only the chosen
command's module is imported: `spark-guard run` (the daemon) must not load the
admin's tools, and a tool must not load the others.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from . import __version__
from . import config as config_mod
from .exits import EPILOGS
from .jsonout import MODES


class Command(NamedTuple):
    module: str  # spark_guard.<module> (dotted) has add_arguments(parser) and run(args) -> int
    help: str  # the line in `spark-guard --help`, known without importing the module
    config: bool = True  # takes --config (check-config takes its file as an argument)


# Every command, in the order --help lists them.
COMMANDS: dict[str, Command] = {
    "run": Command("run_cli", "run the guard (the daemon behind spark-guard.service)"),
    "check-config": Command(
        "tools.check_config_cli", "validate a config file; non-zero exit on errors", config=False
    ),
    "dump": Command("tools.dump_cli", "sense and decide once, print what the guard sees"),
    "preflight": Command(
        "tools.preflight_cli",
        "would this load fit now? exit 0 fits, 1 not, 4 cannot say (as ExecStartPre=)",
    ),
    "audit": Command(
        "tools.audit_cli",
        "every model loader on every level, what can wedge the machine, the fixes",
    ),
    "status": Command("tools.status_cli", "what the running guard sees and has done"),
    "harden": Command(
        "tools.harden_cli", "write a hardening drop-in for a loader unit (shows it, asks first)"
    ),
    "rescue": Command(
        "tools.rescue_cli", "stop, mask and disable the model loaders now, on every level"
    ),
    "doctor": Command(
        "tools.doctor.cli", "why a model server died or the GPU fell off: Xid, driver, card, logs"
    ),
    "release": Command(
        "tools.release_cli",
        "undo what the guard did to a unit: unmask, re-enable with the same links",
    ),
}


def _module(command: Command) -> ModuleType:
    return importlib.import_module(f".{command.module}", __package__)


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spark-guard",
        description=(
            "Keeps the rescue window open: stops model-loader units that threaten"
            " the memory budget."
        ),
    )
    parser.add_argument("--version", action="version", version=f"spark-guard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command_parser = sub.add_parser(name, help=command.help)
        # Only the chosen command needs its arguments; the others just name themselves in --help.
        if name == chosen:
            _module(command).add_arguments(command_parser)
            command_parser.epilog = command_parser.epilog or EPILOGS.get(name)
            if name != "run":
                # As systemctl takes them: nothing here pages, and -q keeps stdout quiet
                # (the exit status and the errors on stderr still say it).
                command_parser.add_argument(
                    "--no-pager", action="store_true", help="accepted; nothing is paged"
                )
                command_parser.add_argument(
                    "-q", "--quiet", action="store_true", help="print nothing on stdout"
                )
            if command.config:
                command_parser.add_argument(
                    "--config",
                    type=Path,
                    default=config_mod.DEFAULT_PATH,
                    help=f"the budget file (default {config_mod.DEFAULT_PATH})",
                )
    return parser


# Options whose value may begin with "-" (journalctl's `--since -1h`): argparse would take
# the value for an option; it is joined to its option instead, as `--since=-1h`.
_DASH_VALUES = ("--since",)


def _join_dash_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _DASH_VALUES and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


# The top level's own options; every other option before the command is the command's.
_TOP_LEVEL = ("-h", "--help", "--version")


def _options_after_command(argv: list[str]) -> list[str]:
    """`spark-guard --config FILE -q audit` as `spark-guard audit --config FILE -q`: every
    command takes --config, -q, --no-pager and --json, and an admin writes them where
    systemctl would take an option."""
    before: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in _TOP_LEVEL:
        took = 2 if argv[i] == "--config" else 1
        before += argv[i : i + took]
        i += took
    if not before or i >= len(argv):
        return argv
    return [argv[i], *before, *argv[i + 1 :]]


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser


def _json_modes(argv: list[str]) -> tuple[list[str], str | None]:
    """`--json=pretty|short` (systemd's spelling) to the plain `--json` every command
    takes, and the mode; anything else after `--json=` is a usage error."""
    out, mode = [], None
    for arg in argv:
        if arg.startswith("--json="):
            mode = arg.partition("=")[2]
            if mode not in MODES:
                print(
                    f"spark-guard: --json={mode}: expected --json=pretty or --json=short",
                    file=sys.stderr,
                )
                raise SystemExit(2)
            arg = "--json"
        out.append(arg)
    return out, mode


def main(argv: list[str] | None = None) -> int:
    argv = _join_dash_values(sys.argv[1:] if argv is None else argv)
    argv, json_mode = _json_modes(argv)
    argv = _options_after_command(argv)
    # No top-level option takes a value, so the first word that is not an option is the command.
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    try:
        try:
            parser = _parser(chosen)
            args, extra = parser.parse_known_args(argv)
            if extra:
                # Said with the command's own usage, not the top level's.
                _command_parser(parser, args.command).error(
                    f"unrecognized arguments: {' '.join(extra)}"
                )
        except SystemExit:
            sys.stdout.flush()  # --help's text, here, where a closed pipe is caught
            raise
        if json_mode is not None and getattr(args, "json", False):
            args.json = json_mode
        if getattr(args, "quiet", False):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the command)
        code = int(_module(COMMANDS[args.command]).run(args))
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a traceback
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): the tool ends quietly, as coreutils' do. Not by
        # SIGPIPE's default: that would kill a command writing to a closed engine socket
        # mid-rescue, and a test that calls main() in its own process.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
