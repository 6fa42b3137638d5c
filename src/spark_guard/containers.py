"""Which containers are model loaders, and how the admin names one. Pure.

A container is a loader by its image (the images vendors' playbooks run a model
server from) or by its command, read with the same knowledge as a unit's
(classify.CommandLine: loader binaries, `python -m sglang`, llama-server's -m,
`ollama serve`). The evidence is returned as classify returns a unit's, as
printable strings. Behaviour (a GPU holder, a mapped .gguf) is the unit's
evidence already: a container's scope is seen like any unit's.

What the engine said is read into system.engine.Container there; this module
judges it. The daemon's sensor uses image_evidence() (the command is read as a
unit's ExecStart=); the commands (audit, rescue) list each engine's loaders
with tools/inventory.collect_containers().
"""

from __future__ import annotations

from .core.classify import SHOWN_PATH_MAX, command_line
from .core.config import DEFAULT_LOADER_BINARIES
from .core.snapshot import valid_name
from .core.text import printable
from .system.engine import Container

PREFIX = "container:"

# Images that serve a model. A reference is matched without its registry's Docker Hub
# spellings (docker.io/, index.docker.io/, library/), its tag and its digest.
LOADER_IMAGES = (
    "vllm/vllm-openai",
    "ollama/ollama",
    "lmsysorg/sglang",
    "ghcr.io/huggingface/text-generation-inference",
)
# llama.cpp's images serve only in their server tags (`:server`, `:server-cuda`...); the
# `:light` and `:full` ones are tools.
LLAMA_CPP_IMAGES = ("ghcr.io/ggml-org/llama.cpp", "ghcr.io/ggerganov/llama.cpp")
# NGC: nvcr.io/nvidia/<these> are inference servers (nvcr.io/nvidia/pytorch and the CUDA
# bases are not); every nvcr.io/nim/... image is a NIM, which is one.
NGC_INFERENCE = (
    "tritonserver",
    "tensorrt-llm",
    "tensorrt-llm/release",
    "vllm",
    "sglang",
    "nim",
    "ai-dynamo",
    "dynamo",
    "llama-stack",
)
_HUB = ("docker.io/", "index.docker.io/", "registry-1.docker.io/")


def split_image(image: str) -> tuple[str, str]:
    """(repository, tag) of an image reference, the repository lowercased and without
    Docker Hub's registry or `library/`; the tag "" where none is given."""
    ref = image.split("@", 1)[0]
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    repo, tag = (ref[:colon], ref[colon + 1 :]) if colon > slash else (ref, "")
    repo = repo.lower()
    for hub in _HUB:
        if repo.startswith(hub):
            repo = repo[len(hub) :]
            break
    repo = repo.removeprefix("library/")
    return repo, tag


def image_evidence(image: str) -> str | None:
    """`image:REPO` if the image is a known model server's; None otherwise."""
    repo, tag = split_image(image)
    if repo in LOADER_IMAGES:
        return f"image:{repo}"
    if repo in LLAMA_CPP_IMAGES and tag.startswith("server"):
        return f"image:{repo}:{printable(tag, 64)}"
    if repo.startswith("nvcr.io/nim/"):
        return f"image:{printable(repo, 256)}"
    if repo.startswith("nvcr.io/nvidia/"):
        rest = repo.removeprefix("nvcr.io/nvidia/")
        if rest in NGC_INFERENCE or rest.split("/", 1)[0] in NGC_INFERENCE:
            return f"image:{printable(repo, 256)}"
    return None


def command_evidence(
    command: tuple[str, ...], binaries: tuple[str, ...] = DEFAULT_LOADER_BINARIES
) -> list[str]:
    """What the command says, as classify says it of a unit's: exec:BINARY (or
    python -m MODULE), loads:MODEL, serves:KIND."""
    line = command_line(command)
    evidence: list[str] = []
    wanted = set(binaries)
    for name, module in line.programs:
        if name in wanted:
            evidence.append(f"exec:python -m {name}" if module else f"exec:{name}")
            break
    if line.loads:
        evidence.append(f"loads:{printable(line.loads, SHOWN_PATH_MAX)}")
    if line.serves:
        evidence.append(f"serves:{line.serves}")
    return evidence


def loader_evidence(
    container: Container, binaries: tuple[str, ...] = DEFAULT_LOADER_BINARIES
) -> tuple[str, ...]:
    """Why `container` is a model loader (printable strings); () if nothing says so."""
    found = image_evidence(container.image)
    evidence = [found] if found else []
    evidence += command_evidence(container.command, binaries)
    return tuple(evidence)


def is_ref(text: str) -> bool:
    return text.startswith(PREFIX)


def parse_ref(text: str) -> str:
    """NAME of `container:NAME`; ValueError (a printable message) for anything else: a name
    Docker would refuse, or one longer than it allows."""
    if not is_ref(text):
        raise ValueError(f"not a container reference: {printable(text, 128)} (container:NAME)")
    name = text[len(PREFIX) :]
    if not valid_name(name):
        raise ValueError(f"not a container name: {printable(name, 128)}")
    return name
