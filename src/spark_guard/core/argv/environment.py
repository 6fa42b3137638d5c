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
KEPT_MAX = 64  # assignments kept: the estimators read a dozen
KEPT_BYTES = 16 * 1024  # and in all
_NAMED = re.compile(r"\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)\})")


def named_in(exec_start: Iterable[Sequence[str]]) -> set[str]:
    """The variables a command line names, as $VAR or ${VAR}."""
    return {a or b for argv in exec_start for arg in argv for a, b in _NAMED.findall(arg)}


def needed(assignments: Iterable[str], exec_start: Iterable[Sequence[str]] = ()) -> tuple[str, ...]:
    """The 'K=V' assignments foresight reads, each value within VALUE_MAX, at most KEPT_MAX
    of them and KEPT_BYTES in all: the last ones, as a later assignment wins in systemd."""
    wanted = NAMES | named_in(exec_start)
    kept = [
        item
        for item in assignments
        if (parts := item.partition("="))[1]
        and len(parts[2]) <= VALUE_MAX
        and (parts[0] in wanted or parts[0].startswith(PREFIXES))
    ]
    out: list[str] = []
    left = KEPT_BYTES
    for item in reversed(kept):  # the last: systemd's later assignment wins
        if len(item) > left or len(out) >= KEPT_MAX:
            break
        out.append(item)
        left -= len(item)
    return tuple(reversed(out))
