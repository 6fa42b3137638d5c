"""The environment variables foresight reads, and nothing else of a unit's Environment=.

A unit's Environment= is its writer's: 60 lines of 1 MB each in a user's unit
were read and kept for every pass (134 MiB). What the estimators read is a
short list: llama.cpp's LLAMA_ARG_*, Ollama's OLLAMA_*, LM Studio's home,
TGI's flags as variables, HOME, and the variables its own ExecStart= names
($VAR, ${VAR}, expanded as systemd does). The rest is dropped on reading.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from .loadspec import LLAMA_ENV, TGI_ENV

PREFIXES = ("LLAMA_ARG_", "OLLAMA_", "LMSTUDIO_")
NAMES = frozenset({"HOME", "TGI_WIGGLE_ROOM", *LLAMA_ENV, *TGI_ENV})
VALUE_MAX = 8 * 1024  # a path (PATH_MAX) and then some; a longer value is no setting
_NAMED = re.compile(r"\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)\})")


def named_in(exec_start: Iterable[Sequence[str]]) -> set[str]:
    """The variables a command line names, as $VAR or ${VAR}."""
    return {a or b for argv in exec_start for arg in argv for a, b in _NAMED.findall(arg)}


def needed(assignments: Iterable[str], exec_start: Iterable[Sequence[str]] = ()) -> tuple[str, ...]:
    """The 'K=V' assignments foresight reads, each value within VALUE_MAX."""
    wanted = NAMES | named_in(exec_start)
    out = []
    for item in assignments:
        key, sep, value = item.partition("=")
        if sep and len(value) <= VALUE_MAX and (key in wanted or key.startswith(PREFIXES)):
            out.append(item)
    return tuple(out)
