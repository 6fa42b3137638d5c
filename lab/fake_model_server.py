"""A stand-in for LM Studio's `lms` and Ollama's `ollama`: a server that loads on request.

Installed under the real program's name (a copy named `lms` or `ollama`), it
answers the command lines the guard knows:

    lms server start | lms daemon up | ollama serve     the server: waits for loads
    lms load KEY ... | ollama run MODEL ...              a client: asks for one, waits

A client writes a request into the spool directory ($FAKE_SERVER_SPOOL, else
~/.fake-model-server) and waits for the server to answer; the server takes
$FAKE_LOAD_MIB (default 256) of anonymous memory for real, touched, as a
model load on unified memory would, and writes `loaded` next to the request.
The guard foresees the footprint from the real model files (a sparse GGUF of
the real model's shape); this process only has to be the one that allocates.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

SPOOL = Path(os.environ.get("FAKE_SERVER_SPOOL", Path.home() / ".fake-model-server"))
MIB = int(os.environ.get("FAKE_LOAD_MIB", "256"))


def serve() -> None:
    SPOOL.mkdir(parents=True, exist_ok=True)
    held: list[bytearray] = []
    print(f"fake model server: waiting for loads in {SPOOL}", flush=True)
    while True:
        for request in sorted(SPOOL.glob("*.request")):
            held.append(bytearray(b"\x01") * (MIB * 1024 * 1024))
            request.with_suffix(".loaded").write_text(f"{MIB}\n")
            request.unlink()
            print(f"fake model server: loaded {request.stem} ({MIB} MiB)", flush=True)
        time.sleep(0.1)


def load(model: str) -> int:
    SPOOL.mkdir(parents=True, exist_ok=True)
    name = f"{os.getpid()}"
    (SPOOL / f"{name}.request").write_text(model + "\n")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (SPOOL / f"{name}.loaded").exists():
            print(f"fake client: {model} loaded", flush=True)
            return 0
        time.sleep(0.1)
    print(f"fake client: {model}: no answer from the server", flush=True)
    return 1


def main(argv: list[str]) -> int:
    program = os.path.basename(argv[0])
    words = [a for a in argv[1:] if not a.startswith("-")]
    if words[:2] in (["server", "start"], ["daemon", "up"]) or words[:1] == ["serve"]:
        serve()
    if words[:1] in (["load"], ["run"]) and len(words) > 1:
        return load(words[1])
    print(f"{program}: not a command this stand-in knows: {argv[1:]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
