"""LM Studio's command lines: `lms load` (a client) and its servers. Pure.

    client_load(argv, env=None) -> LmsLoad | None
        `lms load ...`, seen through env/nice/taskset/... and through every command
        of a shell script (shell.commands); None for anything else. `$VAR`/`${VAR}`
        words are taken from `env` (the unit's Environment=, as systemd and the shell
        would). SpecError for a flag lms itself refuses (`--gpu 2`, `-c 0`, an
        unknown option). LmsLoad.loads is False for `--estimate-only` (LM Studio's own
        estimate: it loads nothing) and `--help`; LmsLoad.remote for a `--host` that
        is not this machine.
    first_client_load(command_lines, env=None) -> LmsLoad | None
        The first of a unit's command lines (ExecStart, ...) that is one.
    server(argv) -> str | None, is_server(argv) -> bool, first_server(command_lines)
        The kind of LM Studio server a command runs: "llmster", "lms daemon up",
        "lms server start", "LM Studio --run-as-service", "LM Studio" (the app, a
        server too), "LM Studio worker" (`<home>/.internal/utils/node`, where the
        engine runs and the memory is; the incident's PID 3354); None otherwise.

Where the model is and what it will hold is foresight/lmstudio.py's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..text import quoted
from .loadspec import SpecError
from .shell import commands

MAX_TOKENS = 1 << 32  # a context length past any model's

LMS = "lms"


LLMSTER = "llmster"


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


# `lms load`'s options (lms src/subcommands/load.ts, createClient.ts, logLevel.ts):
# the ones that take a value, and the flags; None: read past, not used here.
_VALUE_OPTIONS: dict[str, str | None] = {
    "--gpu": "gpu",
    "-c": "context_length",
    "--context-length": "context_length",
    "--parallel": "parallel",
    "--ttl": "ttl",
    "--identifier": "identifier",
    "--host": "host",
    "--port": "port",
    "--speculative-draft-model": "draft_model",
    "--speculative-draft-max-tokens": None,
    "--speculative-draft-min-tokens": None,
    "--speculative-draft-min-continue-probability": None,
    "--log-level": None,
}


_FLAG_OPTIONS: dict[str, str | None] = {
    "-y": "yes",
    "--yes": "yes",
    "--exact": "exact",
    "--estimate-only": "estimate_only",
    "-h": "help",
    "--help": "help",
    "--local": None,
    "--quiet": None,
    "--verbose": None,
    "--speculative-draft-mtp": None,
    "--no-speculative-draft-mtp": None,
    "--speculative-draft-simple": None,
}


@dataclass(frozen=True)
class LmsLoad:
    """One `lms load` command line, as lms would take it."""

    binary: str  # as given: lms, ~/.lmstudio/bin/lms, ...
    key: str | None  # the model key or path; None: lms asks on a terminal which one
    context_length: int | None = None  # -c/--context-length
    gpu: str | None = None  # --gpu: off, max or 0..1 (where layers go)
    parallel: int | None = None  # --parallel
    identifier: str | None = None
    ttl: int | None = None
    exact: bool = False  # --exact: the key is a model's path, matched exactly
    yes: bool = False  # -y: of several matches lms loads the first, without asking
    estimate_only: bool = False  # LM Studio's own estimate, printed; nothing is loaded
    help: bool = False
    host: str | None = None
    port: int | None = None
    draft_model: str | None = None  # --speculative-draft-model: a second model, its key
    notes: tuple[str, ...] = ()

    @property
    def loads(self) -> bool:
        """False where lms only prints something (--estimate-only, --help)."""
        return not (self.estimate_only or self.help)

    @property
    def remote(self) -> bool:
        """--host names another machine: the model is loaded there."""
        return self.host is not None and self.host.lower() not in LOOPBACK


def client_load(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LmsLoad | None:
    """The `lms load` this command line runs, or None; SpecError for what lms refuses."""
    for command in commands(argv, env):
        if os.path.basename(command[0]) == LMS and command[1:2] == ["load"]:
            return _load(command[0], command[2:])
    return None


def first_client_load(
    command_lines: Iterable[Sequence[str]], env: Mapping[str, str] | None = None
) -> LmsLoad | None:
    """The first command line (ExecStartPre, ExecStart, ...) that runs `lms load`."""
    for argv in command_lines:
        load = client_load(argv, env)
        if load is not None:
            return load
    return None


def _load(binary: str, args: Sequence[str]) -> LmsLoad:
    values: dict[str, tuple[str, str]] = {}  # field -> (option as given, value)
    flags: set[str] = set()
    positional: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            positional.extend(args[i:])
            break
        if arg.startswith("--"):
            name, eq, inline = arg.partition("=")
            if name in _VALUE_OPTIONS:
                if not eq:
                    if i >= len(args):
                        raise SpecError(f"lms load {name} needs a value")
                    inline = args[i]
                    i += 1
                target = _VALUE_OPTIONS[name]
                if target is not None:
                    values[target] = (name, inline)
            elif name in _FLAG_OPTIONS and not eq:
                flag = _FLAG_OPTIONS[name]
                if flag is not None:
                    flags.add(flag)
            else:
                raise SpecError(f"lms load {quoted(arg)}: not an option lms knows (it refuses)")
        elif arg.startswith("-") and len(arg) > 1:
            # Short options, clustered as commander takes them: -y, -c 4096, -c4096, -yc 4096.
            for j in range(1, len(arg)):
                name = "-" + arg[j]
                if name in _VALUE_OPTIONS:
                    value = arg[j + 1 :]
                    if not value:
                        if i >= len(args):
                            raise SpecError(f"lms load {name} needs a value")
                        value = args[i]
                        i += 1
                    target = _VALUE_OPTIONS[name]
                    if target is not None:
                        values[target] = (name, value)
                    break
                flag = _FLAG_OPTIONS.get(name, "?")
                if flag == "?":
                    raise SpecError(f"lms load {quoted(arg)}: not an option lms knows (it refuses)")
                if flag is not None:
                    flags.add(flag)
        else:
            positional.append(arg)
    notes = []
    gpu = _gpu(*values["gpu"]) if "gpu" in values else None
    if gpu is not None:
        notes.append(
            f"--gpu {gpu}: where the layers go; on unified memory CPU and GPU share one pool,"
            " so the total does not depend on it"
        )
    draft = values["draft_model"][1] if "draft_model" in values else None
    if len(positional) > 1:
        notes.append(f"{len(positional) - 1} more argument(s) after the model key left out")
    return LmsLoad(
        binary=binary,
        key=positional[0] if positional else None,
        context_length=_number(*values["context_length"], 1, MAX_TOKENS)
        if "context_length" in values
        else None,
        gpu=gpu,
        parallel=_number(*values["parallel"], 1, 1023) if "parallel" in values else None,
        identifier=values["identifier"][1] if "identifier" in values else None,
        ttl=_number(*values["ttl"], 1, MAX_TOKENS) if "ttl" in values else None,
        exact="exact" in flags,
        yes="yes" in flags,
        estimate_only="estimate_only" in flags,
        help="help" in flags,
        host=values["host"][1] if "host" in values else None,
        port=_number(*values["port"], 0, 65535) if "port" in values else None,
        draft_model=draft or None,
        notes=tuple(notes),
    )


def _gpu(flag: str, raw: str) -> str:
    """lms's gpuOptionParser: off, max, or a ratio from 0 to 1."""
    value = raw.strip().lower()
    if value in ("off", "max"):
        return value
    try:
        ratio = float(value)
    except ValueError:
        ratio = -1.0
    if not 0 <= ratio <= 1:  # nan too
        raise SpecError(f"lms load {flag} {quoted(raw)}: must be off, max or a number from 0 to 1")
    return f"{ratio:g}"


def _number(flag: str, raw: str, low: int, high: int) -> int:
    """An integer as lms's refined number parser takes it (JavaScript's +str)."""
    try:
        value = int(raw.strip())
    except ValueError:
        try:
            f = float(raw)
        except ValueError:
            f = 0.5  # not a number
        if not f.is_integer():
            raise SpecError(f"lms load {flag} {quoted(raw)}: not a whole number") from None
        value = int(f)
    if not low <= value <= high:
        raise SpecError(f"lms load {flag} {quoted(raw)}: must be in [{low}, {high}]")
    return value


def server(argv: Sequence[str]) -> str | None:
    """The kind of LM Studio server a command line runs, or None."""
    for command in commands(argv):
        kind = _server_kind(command)
        if kind is not None:
            return kind
    return None


def _server_kind(command: Sequence[str]) -> str | None:
    path = command[0]
    base = os.path.basename(path)
    if base == LLMSTER:
        return "llmster"
    if base == LMS:
        sub = command[1:3]
        if sub == ["daemon", "up"]:
            return "lms daemon up"
        if sub == ["server", "start"]:
            return "lms server start"
        return None
    if path.endswith("/.internal/utils/node"):
        return "LM Studio worker"
    if re.sub(r"[^a-z0-9]", "", base.lower()).startswith("lmstudio"):
        # The app (lm-studio, LM-Studio-0.3.30-x64.AppImage, ...): it serves models too.
        return "LM Studio --run-as-service" if "--run-as-service" in command else "LM Studio"
    return None


def is_server(argv: Sequence[str]) -> bool:
    return server(argv) is not None


def first_server(command_lines: Iterable[Sequence[str]]) -> str | None:
    for argv in command_lines:
        kind = server(argv)
        if kind is not None:
            return kind
    return None
