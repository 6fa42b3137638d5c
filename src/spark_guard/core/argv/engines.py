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
import re
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


# What a unit that runs `docker compose up` launches: every container of the project,
# whose engine labels them so (com.docker.compose.project).
COMPOSE = "compose:"
COMPOSE_PROJECT_LABEL = "com.docker.compose.project"
_COMPOSE_BINARIES = ("docker-compose", "podman-compose")
_PROJECT_CHARS = re.compile(r"[^a-z0-9_-]")


def project_name(raw: str) -> str:
    """A compose project's name as compose normalizes it: lower case, only [a-z0-9_-],
    starting with a letter or digit."""
    return _PROJECT_CHARS.sub("", raw.lower()).lstrip("_-")


def _compose_project(words: Sequence[str]) -> str | None:
    """`compose [OPTIONS] up` (attached: not -d) names its project by -p, or by the folder
    of its first -f file; without either it is the unit's working directory's, not known
    from the command line."""
    project = folder = None
    i = 0
    while i < len(words):
        w = words[i]
        flag, eq, value = w.partition("=")
        if flag in ("-p", "--project-name", "-f", "--file"):
            if not eq:
                value = words[i + 1] if i + 1 < len(words) else ""
                i += 1
            if flag in ("-p", "--project-name"):
                project = value
            elif folder is None and value.startswith("/"):
                folder = os.path.basename(os.path.dirname(value))
        elif w == "up":
            rest = words[i + 1 :]
            if any(r in ("-d", "--detach") or r.startswith("--detach=") for r in rest):
                return None
            name = project_name(project or folder or "")
            return f"{COMPOSE}{name}" if name else None
        elif not w.startswith("-"):
            return None  # another subcommand
        i += 1
    return None


def launched_container(argv: Sequence[str]) -> str | None:
    """The name of the container this command line runs in the foreground through a
    docker or podman client (`run --name X`, `start -a X`), behind wrappers and `sh -c`;
    `compose:PROJECT` for an attached `docker compose up` (every container of the
    project); None for anything else, or a name the engine would not take."""
    args = first_command(argv)
    if not args:
        return None
    binary = os.path.basename(args[0])
    if binary in _COMPOSE_BINARIES:
        return _compose_project(args[1:])
    if binary not in ENGINES:
        return None
    words = _after_globals(args)
    if words[:1] == ["compose"]:
        return _compose_project(words[1:])
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
