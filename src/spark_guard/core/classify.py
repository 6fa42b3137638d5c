"""Which units are model loaders, and which must never be touched. Pure.

A command line is read once (CommandLine: bounded, split, and asked what it
names and what it loads) by whoever reads it: the sensor keeps one per process
and one per ExecStart= of a unit run, so no pass splits a command line again.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import replace
from fnmatch import fnmatchcase

from .argv.engines import launched_container
from .argv.loadspec import SpecError, parse
from .argv.servers import client_kind, server_kind
from .config import Config
from .snapshot import (
    ARGV_MAX_ARGS,
    ARGV_MAX_BYTES,
    CONTAINER,
    MODEL_SUFFIXES,
    SYSTEM,
    USER_PREFIX,
    ContainerFacts,
    FootprintFrom,
    Loader,
    SeenUnit,
    ServerKind,
    UnitRef,
    manager_uid,
)
from .text import printable

_MODEL_FLAGS = {"-m", "--model", "--model-path", "--mmproj", "-md", "--model-draft"}
_SHARD = re.compile(r"-\d{5}-of-\d{5}(\.gguf)$", re.IGNORECASE)

# Shell words (sh -c '...') are split by shlex, about 35 ms per 64 KiB in Python; past
# this many characters of one command line, arguments are split on whitespace only.
SHELL_SPLIT_MAX = 8 * 1024
# A model path inside evidence and reasons (shown in the login note and the journal).
SHOWN_PATH_MAX = 512


def matches_any(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatchcase(name, g) for g in globs)


def config_name(ref: UnitRef) -> str:
    """How the config names it: the unit's name on any manager, `container:NAME` (a
    user's rootless container too, as her units are named by their names)."""
    return str(ref) if ref.manager == CONTAINER else ref.name


def is_protected(ref: UnitRef, config: Config, guard_unit: UnitRef | None = None) -> bool:
    """Units (and containers) the guard never acts on, whatever else matches.

    A name protects on its own level only: `[protected] units` are PID 1's (its sshd and
    gettys are the rescue window; a user's own unit named sshd@x.service is hers, and
    judged as any other), `user_units` every user manager's, and each `extra` entry says
    its level: NAME for PID 1, `user:NAME` for any user's, `user:UID:NAME` for one
    user's, `container:NAME` for a container."""
    if guard_unit is not None and ref == guard_unit:
        return True
    if ref.manager == CONTAINER:
        return matches_any(str(ref), config.protected_units)
    return matches_any(ref.name, protected_names(config, ref.manager))


def protected_names(config: Config, manager: str) -> tuple[str, ...]:
    """The unit name globs protected on `manager` (SYSTEM, or a user's `user:UID`)."""
    if manager == SYSTEM:
        plain = [e for e in config.extra_protected if not e.startswith((USER_PREFIX, "container:"))]
        return (*config.protected, *plain)
    uid = str(manager_uid(manager))
    out = list(config.user_protected)
    for entry in config.extra_protected:
        if not entry.startswith(USER_PREFIX):
            continue
        rest = entry[len(USER_PREFIX) :]
        who, sep, name = rest.partition(":")
        if sep and who.isdigit():
            if who == uid:
                out.append(name)
        else:
            out.append(rest)
    return tuple(out)


def canonical_model(path: str) -> str:
    """One name per model: split GGUF shards collapse to their common stem."""
    return _SHARD.sub(r"\1", os.path.normpath(path))


def bounded(argv: Iterable[str]) -> tuple[str, ...]:
    """The first ARGV_MAX_ARGS arguments within ARGV_MAX_BYTES; an argument cut by the
    byte limit is left out (a cut path would name a file nobody gave)."""
    out: list[str] = []
    size = 0
    for arg in argv:
        size += len(arg) + 1
        if len(out) >= ARGV_MAX_ARGS or size > ARGV_MAX_BYTES:
            break
        out.append(arg)
    return tuple(out)


def _tokens(argv: Sequence[str]) -> list[str]:
    """Arguments, with shell-wrapped command strings (sh -c '...') split too; the first
    ARGV_MAX_ARGS of them (a loader names itself and its model well before that)."""
    out: list[str] = []
    budget = SHELL_SPLIT_MAX
    prev = ""
    for arg in argv:
        if len(out) >= ARGV_MAX_ARGS:
            break
        # The value of -m/--model is one path, spaces and all ("DeepSeek V4.gguf").
        value = prev in _MODEL_FLAGS or arg.partition("=")[0] in _MODEL_FLAGS
        prev = arg
        if not value and (" " in arg or "\t" in arg or "\n" in arg):
            if len(arg) > budget:
                out.extend(arg.split())  # past the budget: whitespace, at C speed
                continue
            budget -= len(arg)
            try:
                out.extend(shlex.split(arg))
                continue
            except ValueError:
                pass
        out.append(arg)
    return out[:ARGV_MAX_ARGS]


def _named(tokens: Sequence[str]) -> list[str]:
    """Model paths named: *.gguf / *.safetensors, or any path after -m/--model."""
    found: list[str] = []
    for i, tok in enumerate(tokens):
        value = tok.split("=", 1)[1] if tok.startswith("--") and "=" in tok else tok
        after_flag = i > 0 and tokens[i - 1] in _MODEL_FLAGS
        if value.lower().endswith(MODEL_SUFFIXES) or (after_flag and "/" in value):
            found.append(canonical_model(value))
    return found


def _programs(tokens: Sequence[str]) -> tuple[tuple[str, bool], ...]:
    """(name, is a python -m module) of every word that could name a loader, in order."""
    found: dict[tuple[str, bool], None] = {}
    for i, tok in enumerate(tokens):
        found[(os.path.basename(tok), False)] = None
        # `python -m vllm.entrypoints...` names the loader as a module.
        if i > 0 and tokens[i - 1] == "-m":
            found[(tok.split(".", 1)[0], True)] = None
    return tuple(found)


def _loads(argv: Sequence[str]) -> str | None:
    """The model a known loader's command line loads (llama.cpp's -m), by loadspec's reading.

    loadspec splits a `sh -c` script with shlex: a script longer than SHELL_SPLIT_MAX is
    not read as a loader's (a loader's is a line; a user's 64 KiB one costs 35 ms).
    """
    args = [
        "" if i and argv[i - 1] == "-c" and len(arg) > SHELL_SPLIT_MAX else arg
        for i, arg in enumerate(argv)
    ]
    try:
        spec = parse(args)
    except SpecError:
        return None  # a loader that cannot start loads nothing
    if spec is None or spec.kind != "llama.cpp" or not spec.model:
        return None  # SGLang's and TGI's model is a directory or a Hub id, not a mapped file
    return canonical_model(spec.model)


class CommandLine(tuple[str, ...]):
    """One command line, bounded, read once: a tuple of its arguments (so it stands wherever
    an argv does) that also knows what it names and what it loads.

    `named`: model paths it mentions, for display and for telling loaders apart; a path
    after `sleep infinity` is named too. `loads`: the model a known loader's command line
    (loadspec: llama-server -m, behind env/nice/sh -c) would load; None for anything else.
    """

    named: tuple[str, ...]
    loads: str | None
    programs: tuple[tuple[str, bool], ...]
    # A server that loads on request (servers.py): the kind it runs, or the kind it asks.
    serves: ServerKind | None
    asks: ServerKind | None
    # The container a docker/podman client runs in the foreground (argv/engines.py).
    launches: str | None

    def __new__(cls, argv: Iterable[str]) -> CommandLine:
        args = bounded(argv)
        line = super().__new__(cls, args)
        tokens = _tokens(args)
        line.named = tuple(_named(tokens))
        line.programs = _programs(tokens)
        line.loads = _loads(args)  # loadspec unwraps wrappers and shells from the raw words
        line.serves = server_kind(args)
        line.asks = client_kind(args)
        line.launches = launched_container(args)
        return line


def command_line(argv: Sequence[str]) -> CommandLine:
    """`argv` read once; one the sensor already read is returned as it is."""
    return argv if isinstance(argv, CommandLine) else CommandLine(argv)


def model_files(argvs: Iterable[Sequence[str]]) -> list[str]:
    """Model paths named on command lines: *.gguf / *.safetensors or after -m/--model."""
    return [m for argv in argvs for m in command_line(argv).named]


def loaded_models(seen: SeenUnit) -> tuple[str, ...]:
    """Models the unit loads on real evidence: mapped by its processes, or given to a known
    loader on its command line. A path merely named (`sleep infinity /m.gguf`) is not.
    A container's paths are its own: each is named by what it is on the host."""
    lines = (command_line(a) for a in seen.exec_start + seen.cmdlines)
    found = [line.loads for line in lines if line.loads]
    found += [canonical_model(m) for m in seen.mapped_models]
    if seen.container is not None:
        found = [on_host(m, seen.container) for m in found]
    return tuple(dict.fromkeys(found))


def on_host(path: str, container: ContainerFacts) -> str:
    """A path inside a container, as the host knows the file: below the deepest bind mount
    that holds it, the mount's source; else a file of its image's own layers, named by
    the image (two containers of one image load the same file; a host path of the same
    text is another file)."""
    best: tuple[str, str] | None = None
    for source, dest in container.mounts:
        d = dest.rstrip("/") or "/"
        inside = path == d or path.startswith(d + "/") or d == "/"
        if inside and (best is None or len(d) > len(best[1])):
            best = (source, d)
    if best is None:
        return f"image:{container.image}:{path}"
    source, d = best
    rest = path[len(d) :] if d != "/" else path
    return canonical_model(source.rstrip("/") + "/" + rest.lstrip("/"))


def launched_containers(seen: SeenUnit) -> tuple[str, ...]:
    """The containers the unit's docker or podman client runs (`run --name X`): a unit
    that wraps `docker run` is what brings its container back (Restart=)."""
    lines = (command_line(a) for a in seen.exec_start + seen.cmdlines)
    return tuple(dict.fromkeys(ln.launches for ln in lines if ln.launches))


def _binary_evidence(lines: Iterable[CommandLine], binaries: tuple[str, ...]) -> str | None:
    wanted = set(binaries)
    for line in lines:
        for name, module in line.programs:
            if name in wanted:
                return f"python -m {name}" if module else name
    return None


def names_word(name: str, pattern: str) -> bool:
    """Whether `pattern` begins a word of `name` (after its start or a character that is
    not a letter or digit): "llama" names llama-server.service and llama3.service, not
    ollama.service, whose "llama" is inside a word."""
    i = name.find(pattern)
    while i >= 0:
        if i == 0 or not name[i - 1].isalnum():
            return True
        i = name.find(pattern, i + 1)
    return False


def expected_footprint(ref: UnitRef, config: Config) -> int | None:
    """The admin's figure for this unit, from [loaders.footprint] (globs allowed)."""
    name = config_name(ref)
    exact = config.footprint.get(name)
    if exact is not None:
        return exact
    for glob, size in config.footprint.items():
        if fnmatchcase(name, glob):
            return size
    return None


def classify(seen: SeenUnit, config: Config, guard_unit: UnitRef | None = None) -> Loader | None:
    """A Loader with its evidence, or None if nothing marks the unit as one.

    Services and containers are loaders, and groups of a user's processes that are no
    unit the guard can block (SeenUnit.group: her scopes, cgroups, jobs in system
    units; a stop kills them). Root's scopes are not judged: they are its sessions,
    not restarted by a manager, not what autostarts a model (a container's scope is
    seen as its container, whose engine restarts it).
    """
    ref = seen.ref
    if not (ref.name.endswith(".service") or ref.is_container or seen.group) or is_protected(
        ref, config, guard_unit
    ):
        return None
    evidence: list[str] = []
    if seen.container is not None and seen.container.image_evidence:
        evidence.append(seen.container.image_evidence)
    lowered = ref.name.lower()
    for pattern in config.loader_patterns:
        if names_word(lowered, pattern.lower()):
            evidence.append(f"name:{pattern}")
            break
    lines = [command_line(a) for a in seen.exec_start + seen.cmdlines]
    binary = _binary_evidence(lines, config.loader_binaries)
    if binary:
        evidence.append(f"exec:{binary}")
    # Evidence is shown (journal, status, login note): paths in it are a user's text.
    named = [m for line in lines for m in line.named]
    if named:
        evidence.append(f"model-arg:{printable(named[0], SHOWN_PATH_MAX)}")
    loads = [line.loads for line in lines if line.loads]
    if loads:
        evidence.append(f"loads:{printable(loads[0], SHOWN_PATH_MAX)}")
    if seen.gpu_pids:
        evidence.append(f"gpu-process:{len(seen.gpu_pids)}")
    if seen.mapped_models:
        evidence.append(f"mapped:{printable(seen.mapped_models[0], SHOWN_PATH_MAX)}")
    # A server that loads on request, or a client that asks one (a curl preload is
    # nothing but this): servers.py.
    serves = next((line.serves for line in lines if line.serves), ServerKind.NONE)
    asks = next((line.asks for line in lines if line.asks), ServerKind.NONE)
    if serves:
        evidence.append(f"serves:{serves}")
    if asks:
        evidence.append(f"asks:{asks}")
    if not evidence:
        return None
    if any(a is not b for a, b in zip(lines, seen.exec_start + seen.cmdlines, strict=True)):
        # Plain argv (a one-shot command's): keep what was read, so no one reads it again.
        n = len(seen.exec_start)
        seen = replace(seen, exec_start=tuple(lines[:n]), cmdlines=tuple(lines[n:]))
    # Every model it names or loads, for display; the duplicate rule asks loaded_models().
    models = tuple(dict.fromkeys(named + loads + [canonical_model(m) for m in seen.mapped_models]))
    # The admin's figure wins over the estimate; neither: footprint unknown, the trend guards.
    expected = expected_footprint(ref, config)
    # A server that loads on request, or a client that asks one (servers.py).
    source = (
        FootprintFrom.CONFIG
        if expected is not None
        else FootprintFrom.UNKNOWN
        if seen.predicted is None
        else FootprintFrom.ESTIMATE
    )
    expected = expected if expected is not None else seen.predicted
    return Loader(seen, tuple(evidence), models, expected, source, serves=serves, asks=asks)
