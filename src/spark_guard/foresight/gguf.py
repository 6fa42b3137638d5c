"""A streaming, bounded reader of GGUF headers: metadata and the tensor list, never tensor data.

GGUF (llama.cpp's model format, versions 2 and 3): magic, version, tensor
count, metadata count, the metadata key/values, the tensor infos, then
aligned tensor data. Only the header is read, through a small buffer with
pread (no mmap: the guard mlockall()s itself, and a mapping of a 100 GB
file must never be part of what it locks).

Hostile input gets a ModelFileError naming the file, the offset and the problem,
never a crash, a hang or a large allocation: every count is checked
against the bytes left in the file before anything is read for it, strings
longer than the file are refused, arrays nest at most MAX_DEPTH deep, and
big arrays (a vocabulary of 250,000 tokens) are skipped, keeping only their
length. Split models (NAME-00001-of-00003.gguf) are read shard by shard.

The bytes left in a file are no bound at all for a sparse file (1 TiB costs
its owner a few kB of disk), so the reader also holds absolute caps that no
file size lifts: the header ends within MAX_HEADER bytes, at most
MAX_TENSORS tensors and MAX_METADATA keys, at most MAX_KEPT bytes of
metadata kept in memory, and a deadline, checked as it goes, for the whole
read. The file is opened O_NONBLOCK and must be a regular file (a FIFO
would block open() forever, a device would stream without end); symlinks
are followed (Hugging Face caches are symlinks), so the caller decides
whose rights the open runs with (predict.py: the unit owner's).
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .modelfile import (
    IdentityCache,
    ModelFileError,
    ModelTimeout,
    ModelUnreadable,
    identity,
    open_regular,
)

MAGIC = b"GGUF"
MAX_DEPTH = 4  # arrays of arrays of ... deeper than this are refused
KEEP_ARRAY = 4096  # arrays up to this length are kept (per-layer values); longer: length only
KEEP_STRING = 1 << 16  # string values up to 64 KiB are kept (a chat template); longer: skipped
MAX_KEY = 1 << 16  # GGUF keys are at most 65535 bytes
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 48  # per tensor, and the largest offset: far past any real model
CHUNK = 1 << 20

# Absolute caps, whatever the file's size claims. Measured on the real files of the tests
# (lab/testdata.py): the biggest header is Gemma 4's vocabulary (262,144 tokens and their
# merges) at 15.8 MB, read in 50-90 ms here; metadata runs to 14-46 keys. The biggest models
# have about a thousand tensors: DeepSeek-V3 and Kimi-K2 (61 layers, experts merged into one
# tensor per layer, as llama.cpp writes them) 1,000-1,100, Qwen3-235B-A22B (94 layers) about
# 1,100. Each cap leaves a wide margin over those and still bounds what a hostile header can
# cost: a few MB of memory and about a second of CPU (64 MiB of empty strings to skip).
MAX_HEADER = 64 << 20  # bytes read or skipped before the tensor data: 4x Gemma 4's 15.8 MB
MAX_TENSORS = 1 << 14  # 16,384 per file and per model: 15x DeepSeek-V3, and old GGUFs with
# one tensor per expert (Snowflake Arctic: 35 layers x 128 experts x 3 = 13,440) still fit;
# at ~325 bytes of Python objects each (measured), the list costs at most ~5 MB
MAX_METADATA = 1 << 12  # 4,096 keys per file: ~100x the 46 of the richest real header
MAX_NAME = 256  # tensor name bytes; llama.cpp itself refuses names of 64 (GGML_MAX_NAME) or more
MAX_KEPT = 1 << 20  # metadata bytes kept in memory (keys, strings, 8 per kept array element):
# the 20 real headers of the tests keep at most 14 kB (chat templates are the bulk)
MAX_SHARDS = 4096  # a split model's files (gguf-split's 5-digit names allow 99,999)
READ_SECONDS = 10.0  # one model, all shards: local reads take 3-80 ms a file (see above); the
# rest is room for a cold disk or a slow network mount, not for a header that never ends

# ggml type -> (elements per block, bytes per block); checked against gguf-py in the tests.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
    42: ("Q2_0", 64, 18),  # ggml-common.h block_q2_0: f16 scale + 64 x 2 bits (not in gguf-py 0.19)
}

# GGUF value types: (struct code, size) for scalars; 8 = string, 9 = array.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_STRING, _ARRAY = 8, 9
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class SkippedArray:
    """An array too long to keep: its element type and length."""

    type: int
    length: int


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]
    type: int
    offset: int  # from the start of the data section

    @property
    def elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def nbytes(self) -> int | None:
        """Bytes of data, as ggml_nbytes counts them; None for a type this reader does not know."""
        t = GGML_TYPES.get(self.type)
        if t is None:
            return None
        _, block, size = t
        return self.elements // block * size


@dataclass(frozen=True)
class Header:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[Tensor, ...]
    data_offset: int
    file_size: int
    big_endian: bool = False
    cost: int = field(default=0, compare=False)  # rough bytes of memory it holds, for caches

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def tensor_bytes(self) -> int:
        """Tensor data in this file; a tensor of unknown type counts up to the next offset."""
        total = 0
        ordered = sorted(self.tensors, key=lambda t: t.offset)
        data = self.file_size - self.data_offset
        for i, t in enumerate(ordered):
            n = t.nbytes
            if n is None:
                end = ordered[i + 1].offset if i + 1 < len(ordered) else data
                n = max(end - t.offset, 0)
            total += n
        return total


@dataclass
class _Reader:
    path: str
    fd: int
    size: int
    deadline: float | None = None  # time.monotonic() by which the read must be over
    pos: int = 0
    endian: str = "<"
    kept: int = 0  # metadata bytes kept so far, against MAX_KEPT
    _buf: bytes = b""
    _buf_at: int = 0

    def fail(self, problem: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: at byte {self.pos}: {problem}")

    def left(self) -> int:
        return self.size - self.pos

    def tick(self) -> None:
        """Called as the read goes on: past the deadline, it ends here."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ModelTimeout(f"{self.path}: at byte {self.pos}: header read past its deadline")

    def keep(self, n: int) -> None:
        self.kept += n
        if self.kept > MAX_KEPT:
            raise self.fail(f"more than {MAX_KEPT} bytes of metadata to keep")

    def _within_header(self, end: int) -> None:
        if end > MAX_HEADER:
            raise self.fail(f"header runs past {MAX_HEADER} bytes (no real model's is that big)")

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.left():
            raise self.fail(f"needs {n} bytes, only {self.left()} left in the file")
        self._within_header(self.pos + n)
        start = self.pos - self._buf_at
        if start < 0 or start + n > len(self._buf):
            if n > CHUNK:
                data = os.pread(self.fd, n, self.pos)
                if len(data) != n:
                    raise self.fail("file shrank while being read")
                self.pos += n
                return data
            self._buf = os.pread(self.fd, max(CHUNK, n), self.pos)
            self._buf_at = self.pos
            start = 0
            if len(self._buf) < n:
                raise self.fail("file shrank while being read")
        self.pos += n
        return self._buf[start : start + n]

    def skip(self, n: int) -> None:
        if n < 0 or n > self.left():
            raise self.fail(f"needs {n} bytes, only {self.left()} left in the file")
        self._within_header(self.pos + n)
        self.pos += n

    def _skip_strings(self, n: int) -> None:
        """Skip n length-prefixed strings: the hot loop of a vocabulary, kept tight.

        Within one buffer the loop only adds lengths: running off the buffer's end
        raises struct.error, and the position is checked against the file then.
        """
        unpack = struct.Struct(self.endian + "Q").unpack_from
        pos, fd = self.pos, self.fd
        while n:
            self.tick()
            buf = os.pread(fd, CHUNK, pos)
            limit = len(buf) - 8
            if limit < 0:
                self.pos = pos
                raise self.fail("string array runs past the end of the file")
            off = done = 0
            try:
                for done in range(1, n + 1):  # noqa: B007 (counts the strings skipped)
                    off += 8 + unpack(buf, off)[0]
            except (struct.error, OverflowError):  # the next length lies past the buffer
                done -= 1
            n -= done
            pos += off
            if pos > self.size:
                self.pos = self.size
                raise self.fail("string in an array is longer than the file")
            if pos > MAX_HEADER:
                self.pos = pos
                self._within_header(pos)
        self.pos = pos
        self._buf, self._buf_at = b"", 0

    def scalar(self, code: str, size: int) -> Any:
        return struct.unpack(self.endian + code, self.take(size))[0]

    def u32(self) -> int:
        return int(self.scalar("I", 4))

    def u64(self) -> int:
        return int(self.scalar("Q", 8))

    def count(self, what: str, min_each: int, cap: int | None = None) -> int:
        n = self.u64()
        if n * min_each > self.left():
            raise self.fail(f"{what} count {n} cannot fit in the {self.left()} bytes left")
        if cap is not None and n > cap:
            raise self.fail(f"{what} count {n} is over the limit of {cap}")
        if self.pos + n * min_each > MAX_HEADER:
            raise self.fail(f"{what} count {n} cannot fit in a header of {MAX_HEADER} bytes")
        return n

    def string(self, limit: int | None = None, *, keep: bool = True) -> str | None:
        """A string; None (skipped) when longer than `limit`. `keep`: count it against MAX_KEPT
        (tensor names are bounded by MAX_TENSORS x MAX_NAME instead)."""
        n = self.u64()
        if n > self.left():
            raise self.fail(f"string of {n} bytes is longer than the {self.left()} bytes left")
        if limit is not None and n > limit:
            self.skip(n)
            return None
        if keep:
            self.keep(n)
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return self.scalar(*scalar)
        if vtype == _STRING:
            return self.string(KEEP_STRING)
        if vtype == _ARRAY:
            if depth >= MAX_DEPTH:
                raise self.fail(f"arrays nested deeper than {MAX_DEPTH}")
            self.tick()
            etype = self.u32()
            esize = _SCALARS[etype][1] if etype in _SCALARS else 8  # strings, arrays: >= 8
            if etype not in _SCALARS and etype not in (_STRING, _ARRAY):
                raise self.fail(f"unknown array element type {etype}")
            n = self.count("array element", esize)
            if n > KEEP_ARRAY or (etype == _STRING and n > 64):
                self._skip_array(etype, n, depth)
                return SkippedArray(etype, n)
            self.keep(8 * n)
            if etype in _SCALARS:
                code, size = _SCALARS[etype]
                return list(struct.unpack(f"{self.endian}{n}{code}", self.take(n * size)))
            return [self.value(etype, depth + 1) for _ in range(n)]
        raise self.fail(f"unknown value type {vtype}")

    def _skip_array(self, etype: int, n: int, depth: int) -> None:
        if etype in _SCALARS:
            self.skip(n * _SCALARS[etype][1])
        elif etype == _STRING:
            self._skip_strings(n)
        else:
            for _ in range(n):
                self.value(_ARRAY, depth + 1)


def read_header(
    path: str,
    *,
    deadline: float | None = None,
    opened: tuple[int, os.stat_result] | None = None,
) -> Header:
    """One GGUF file's header; ModelFileError for anything that is not a sound one.

    `deadline` (time.monotonic()) defaults to READ_SECONDS from now. `opened`: an
    fd from open_regular() (not closed here) and its stat, for a caller that
    looked at the file's identity first.
    """
    if deadline is None:
        deadline = time.monotonic() + READ_SECONDS
    fd, st = opened if opened is not None else open_regular(path)
    try:
        r = _Reader(path, fd, st.st_size, deadline)
        return _parse(r)
    except OSError as e:
        raise ModelUnreadable(f"{path}: cannot read: {e.strerror}") from None
    finally:
        if opened is None:
            os.close(fd)


def _parse(r: _Reader) -> Header:
    if r.size < 4 or r.take(4) != MAGIC:
        raise ModelFileError(f"{r.path}: not a GGUF file (no GGUF magic)")
    if r.size < 24:  # magic, version, tensor count, metadata count
        raise ModelFileError(f"{r.path}: truncated: {r.size} bytes, a GGUF header needs 24")
    raw = r.take(4)
    version = struct.unpack("<I", raw)[0]
    if version not in (2, 3) and struct.unpack(">I", raw)[0] in (2, 3):
        r.endian, version = ">", struct.unpack(">I", raw)[0]
    if version == 1:
        raise ModelFileError(f"{r.path}: GGUF version 1 is not supported (convert it again)")
    if version not in (2, 3):
        raise ModelFileError(f"{r.path}: unknown GGUF version {version}")
    n_tensors = r.count("tensor", 8 + 4 + 8 + 4 + 8, MAX_TENSORS)
    n_kv = r.count("metadata", 8 + 1 + 4 + 1, MAX_METADATA)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        r.tick()
        key = r.string(MAX_KEY)
        if key is None:
            raise r.fail(f"metadata key longer than {MAX_KEY} bytes")
        metadata[key] = r.value(r.u32())
    tensors = []
    for _ in range(n_tensors):
        r.tick()
        name = r.string(MAX_NAME, keep=False)
        if name is None:
            raise r.fail(f"tensor name longer than {MAX_NAME} bytes")
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = tuple(r.u64() for _ in range(n_dims))
        ttype = r.u32()
        offset = r.u64()
        tensor = Tensor(name, dims, ttype, offset)
        if tensor.elements > MAX_ELEMENTS or offset > MAX_ELEMENTS:
            raise r.fail(f"tensor {name!r} claims {tensor.elements} elements at offset {offset}")
        tensors.append(tensor)
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{r.path}: general.alignment {alignment!r} is not a power of two")
    data_offset = -(-r.pos // alignment) * alignment
    # A download cut short keeps its whole header: its tensors run past the end of the
    # file, and llama.cpp refuses it ("tensor data is not within the file bounds").
    for t in tensors:
        n = t.nbytes
        if n is not None and data_offset + t.offset + n > r.size:
            raise ModelFileError(
                f"{r.path}: truncated: tensor {t.name!r} ends at byte "
                f"{data_offset + t.offset + n}, the file has {r.size} (a download cut short?)"
            )
    cost = r.kept + 512 * len(tensors)  # a Tensor, its name and dims: a few hundred bytes
    return Header(
        r.path, version, metadata, tuple(tensors), data_offset, r.size, r.endian == ">", cost
    )


def shard_paths(path: str) -> list[str]:
    """All shards of a split model, given any one; [path] for a single file."""
    m = _SHARD.match(os.path.basename(path))
    if not m or not 1 <= int(m.group("no")) <= int(m.group("count")):
        return [path]  # not a shard name llama.cpp would write ("-00001-of-00000")
    count = int(m.group("count"))
    stem = os.path.join(os.path.dirname(path), m.group("stem"))
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


@dataclass(frozen=True)
class Model:
    """A model as the estimate needs it: the first shard's metadata, every shard's tensors."""

    path: str
    metadata: dict[str, Any]
    tensors: tuple[Tensor, ...]
    tensor_bytes: int
    shards: int
    cost: int = field(default=0, compare=False)  # rough bytes of memory it holds, for caches

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


HeaderCache = IdentityCache["Header | ModelFileError"]


def _cost(item: Header | ModelFileError) -> int:
    return max(item.cost, 1) if isinstance(item, Header) else 256 + len(str(item))


def header_cache(max_cost: int = 16 << 20) -> HeaderCache:
    """Headers, and the problems of files that are not sound ones, by path and identity:
    bounded by what the entries hold (Header.cost), not by their number, since a hostile
    header costs far more than a real one."""
    return IdentityCache(max_cost, _cost)


def read_model(
    path: str,
    *,
    deadline: float | None = None,
    cache: HeaderCache | None = None,
    opener: Callable[[str], tuple[int, os.stat_result]] | None = None,
) -> Model:
    """A model, all its shards; ModelFileError for the first problem, naming its file.

    `deadline` (time.monotonic()) is for all shards together, READ_SECONDS from now
    by default. With `cache`, a shard whose identity (device, inode, size, mtime) is
    unchanged is not parsed again; it is still opened, with the caller's rights.
    `opener` opens each shard (an fd and its stat) instead of open_regular: a
    container's model is reached without following any symlink (foresight/containers.py).
    """
    if deadline is None:
        deadline = time.monotonic() + READ_SECONDS
    paths = shard_paths(path)
    if len(paths) > MAX_SHARDS:
        raise ModelFileError(f"{path}: split into {len(paths)} files (at most {MAX_SHARDS})")
    headers = []
    n_tensors = 0
    for p in paths:
        if time.monotonic() > deadline:
            raise ModelTimeout(f"{p}: header read past its deadline")
        fd, st = (opener or open_regular)(p)
        try:
            ident = identity(st)
            h = cache.get(p, ident) if cache is not None else None
            if isinstance(h, ModelFileError):
                # A fresh one: a re-raise grows its traceback.
                raise ModelFileError(str(h)) from None
            if h is None:
                try:
                    h = read_header(p, deadline=deadline, opened=(fd, st))
                except (ModelUnreadable, ModelTimeout):
                    raise  # may read fine later: not remembered
                except ModelFileError as e:
                    if cache is not None:
                        cache.put(p, ident, ModelFileError(str(e)))  # the same until it changes
                    raise
                if cache is not None:
                    cache.put(p, ident, h)
        finally:
            os.close(fd)
        n_tensors += len(h.tensors)
        if n_tensors > MAX_TENSORS:
            raise ModelFileError(f"{p}: the model's shards hold over {MAX_TENSORS} tensors")
        headers.append(h)
    first = headers[0]
    declared = first.get("split.count")
    if declared is not None and declared != len(paths):
        raise ModelFileError(
            f"{paths[0]}: split.count says {declared} shards, the name {len(paths)}"
        )
    tensors = tuple(t for h in headers for t in h.tensors)
    return Model(
        path=paths[0],
        metadata=first.metadata,
        tensors=tensors,
        tensor_bytes=sum(h.tensor_bytes for h in headers),
        shards=len(paths),
        cost=sum(h.cost for h in headers) + 8 * len(tensors),
    )
