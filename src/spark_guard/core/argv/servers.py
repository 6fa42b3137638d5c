"""Servers that load models on request, and the clients that ask them to.

`lms load KEY` (LM Studio) and `ollama run MODEL` or a curl preload to Ollama's
/api/generate hold nothing themselves: the memory of the load appears in the
server's process, another unit (the incident's `lms-load.service` ->
`lmstudio-server`). So a client's footprint is charged to its server's unit,
which is the unit to refuse or block (policy.charge_clients).

Pure: a command line in, the kind of server it is or asks, out. Which model a
client loads is argv/lmstudio.py's and argv/ollama.py's; what it will take,
foresight's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..snapshot import ServerKind
from . import lmstudio, ollama
from .loadspec import SpecError

LMSTUDIO = ServerKind.LMSTUDIO
OLLAMA = ServerKind.OLLAMA


def server_kind(argv: Sequence[str]) -> ServerKind | None:
    """The server this command line runs: LM Studio's (lmstudio.server: `llmster`, `lms
    daemon up`, `lms server start`, the app as a service) or Ollama's (`ollama serve`,
    ollama.server_settings); None for anything else."""
    if lmstudio.server(argv) is not None:
        return LMSTUDIO
    try:
        if ollama.server_settings(argv, {}) is not None:
            return OLLAMA
    except SpecError:
        return OLLAMA  # an Ollama server whose settings make no sense: still Ollama's
    return None


def client_kind(argv: Sequence[str]) -> ServerKind | None:
    """The server this command line asks to load a model here: `lms load` asks LM
    Studio's (not with --estimate-only, nor --host elsewhere), `ollama run` and a
    curl/wget to its API that loads a model ask Ollama's (ollama.client_load)."""
    try:
        load = lmstudio.client_load(argv)
        if load is not None and load.loads and not load.remote:
            return LMSTUDIO
    except SpecError:
        return LMSTUDIO  # options lms itself refuses: it asks, and fails
    try:
        if ollama.client_load(argv) is not None:
            return OLLAMA
    except SpecError:
        return OLLAMA  # a request it cannot read (a body that is not JSON): still a client
    return None
