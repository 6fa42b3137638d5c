"""Which units are model loaders, and which must never be touched. Pure."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable
from fnmatch import fnmatchcase

from .config import Config
from .snapshot import Loader, UnitRef, UnitUsage

MODEL_SUFFIXES = (".gguf", ".safetensors")
_MODEL_FLAGS = {"-m", "--model", "--model-path", "--mmproj", "-md", "--model-draft"}
_SHARD = re.compile(r"-\d{5}-of-\d{5}(\.gguf)$", re.IGNORECASE)


def matches_any(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatchcase(name, g) for g in globs)


def is_protected(ref: UnitRef, config: Config, guard_unit: UnitRef | None = None) -> bool:
    """Units the guard never acts on, whatever else matches."""
    if guard_unit is not None and ref == guard_unit:
        return True
    return matches_any(ref.name, config.protected_units)


def _tokens(argv: tuple[str, ...]) -> list[str]:
    """Arguments, with shell-wrapped command strings (sh -c '...') split too."""
    out: list[str] = []
    for arg in argv:
        if " " in arg:
            try:
                out.extend(shlex.split(arg))
                continue
            except ValueError:
                pass
        out.append(arg)
    return out


def canonical_model(path: str) -> str:
    """One name per model: split GGUF shards collapse to their common stem."""
    return _SHARD.sub(r"\1", os.path.normpath(path))


def model_files(argvs: Iterable[tuple[str, ...]]) -> list[str]:
    """Model paths named on command lines: *.gguf / *.safetensors or after -m/--model."""
    found: list[str] = []
    for argv in argvs:
        tokens = _tokens(argv)
        for i, tok in enumerate(tokens):
            value = tok.split("=", 1)[1] if tok.startswith("--") and "=" in tok else tok
            after_flag = i > 0 and tokens[i - 1] in _MODEL_FLAGS
            if value.lower().endswith(MODEL_SUFFIXES) or (after_flag and "/" in value):
                found.append(canonical_model(value))
    return found


def _binary_evidence(argvs: Iterable[tuple[str, ...]], binaries: tuple[str, ...]) -> str | None:
    wanted = set(binaries)
    for argv in argvs:
        tokens = _tokens(argv)
        for i, tok in enumerate(tokens):
            base = os.path.basename(tok)
            # `python -m vllm.entrypoints...` names the loader as a module.
            module = tok.split(".", 1)[0] if i > 0 and tokens[i - 1] == "-m" else None
            if base in wanted or module in wanted:
                return base if base in wanted else f"python -m {module}"
    return None


def expected_footprint(ref: UnitRef, config: Config) -> int | None:
    """The admin's figure for this unit, from [loaders.footprint] (globs allowed)."""
    exact = config.footprint.get(ref.name)
    if exact is not None:
        return exact
    for glob, size in config.footprint.items():
        if fnmatchcase(ref.name, glob):
            return size
    return None


def classify(usage: UnitUsage, config: Config, guard_unit: UnitRef | None = None) -> Loader | None:
    """A Loader with its evidence, or None if nothing marks the unit as one.

    Only services are loaders: slices and scopes are not restarted by the
    manager and are not what autostarts a model.
    """
    ref = usage.ref
    if not ref.name.endswith(".service") or is_protected(ref, config, guard_unit):
        return None
    evidence: list[str] = []
    lowered = ref.name.lower()
    for pattern in config.loader_patterns:
        if pattern.lower() in lowered:
            evidence.append(f"name:{pattern}")
            break
    argvs = usage.exec_start + usage.cmdlines
    binary = _binary_evidence(argvs, config.loader_binaries)
    if binary:
        evidence.append(f"exec:{binary}")
    named = model_files(argvs)
    if named:
        evidence.append(f"model-arg:{named[0]}")
    if usage.gpu_pids:
        evidence.append(f"gpu-process:{len(usage.gpu_pids)}")
    if usage.mapped_models:
        evidence.append(f"mapped:{usage.mapped_models[0]}")
    if not evidence:
        return None
    models = tuple(dict.fromkeys(named + [canonical_model(m) for m in usage.mapped_models]))
    # The admin's figure wins over the estimate; neither: footprint unknown, the trend guards.
    expected = expected_footprint(ref, config)
    if expected is not None:
        return Loader(usage, tuple(evidence), models, expected, "config")
    if usage.predicted is not None:
        return Loader(usage, tuple(evidence), models, usage.predicted, "estimate")
    return Loader(usage, tuple(evidence), models, None)
