"""The container a unit's `docker run` (or `podman run`) launches.

The most common autostart of a containerized server is a unit that wraps the
engine's client: `ExecStart=/usr/bin/docker run --rm --name vllm ... IMAGE ...`
with Restart=always. The unit's cgroup holds the client; the loader runs in the
engine's scope. The client's command line names the container: `run --name X`
(or `container run`, `create`... only `run` starts one), `start -a X`. Pure: a
command line in, the container name out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..snapshot import valid_name
from .shell import first_command

ENGINES = ("docker", "podman")
# The clients' global options that take a value (before the subcommand).
_GLOBAL_VALUE = {
    "-H",
    "--host",
    "-c",
    "--context",
    "--config",
    "-l",
    "--log-level",
    "--tlscacert",
    "--tlscert",
    "--tlskey",
    "--url",
    "--connection",
    "--root",
    "--runroot",
    "--storage-driver",
    "--cgroup-manager",
    "--events-backend",
    "--identity",
    "--module",
}


def _after_globals(args: Sequence[str]) -> list[str]:
    """The client's words from its subcommand on (global options skipped)."""
    i = 1
    while i < len(args):
        a = args[i]
        if a in _GLOBAL_VALUE:
            i += 2
        elif a.startswith("-"):
            i += 1  # a flag, or --opt=value
        else:
            return list(args[i:])
    return []


def launched_container(argv: Sequence[str]) -> str | None:
    """The name of the container this command line runs in the foreground through a
    docker or podman client (`run --name X`, `start -a X`), behind wrappers and `sh -c`;
    None for anything else, or a name the engine would not take."""
    args = first_command(argv)
    if not args or os.path.basename(args[0]) not in ENGINES:
        return None
    words = _after_globals(args)
    if words[:1] == ["container"]:
        words = words[1:]
    if not words:
        return None
    name: str | None = None
    if words[0] == "run":
        for i, w in enumerate(words[1:], 1):
            if w == "--name" and i + 1 < len(words):
                name = words[i + 1]
                break
            if w.startswith("--name="):
                name = w.partition("=")[2]
                break
    elif words[0] == "start" and any(w in ("-a", "--attach") for w in words[1:]):
        rest = [w for w in words[1:] if not w.startswith("-")]
        name = rest[0] if rest else None
    return name if name is not None and valid_name(name) else None
