"""A streaming, bounded reader of safetensors headers and of a model directory's config.json.

safetensors (Hugging Face's weight format, what vLLM, SGLang and TGI load):
an 8-byte little-endian length N, then N bytes of UTF-8 JSON,
{"__metadata__": {...}, "<tensor>": {"dtype": "BF16", "shape": [..],
"data_offsets": [begin, end]}, ...}, then the tensor data. The weight bytes
are exact from the header alone: the sum of end - begin over the tensors,
each checked against dtype size x product(shape), within the data, and not
overlapping another. Tensor data is never read.

A sharded model is a directory with `model.safetensors.index.json`, whose
"weight_map" names the shard of each tensor; the model's weights are the sum
over the distinct shards' headers. A model directory (what vLLM, SGLang and
TGI are given) resolves to its index, or else to its `*.safetensors` files.
`config.json` beside them gives the attention shape for the KV cache.

Hostile input gets a ModelFileError naming the file and the problem, one
line, never a crash, a hang or a large allocation. The JSON is never parsed
whole: it is read CHUNK bytes at a time, and each tensor's entry is decoded
alone (json's C scanner, one small value at a time) and summed, so memory
does not follow the header's size. Absolute caps that no file size lifts:
a header of at most MAX_HEADER bytes, MAX_TENSORS tensors a file and
MAX_MODEL_TENSORS a model, MAX_RANK dimensions, MAX_SHARDS shard files, an
index of at most MAX_INDEX bytes, a config.json of at most MAX_CONFIG, and a
deadline checked as it reads. Files are opened O_NONBLOCK and must be regular
files (a FIFO would block, a device stream without end); the shards and
config.json are opened relative to the model directory's fd, by plain names
only (a name from an index is a user's text: no "/", no ".."); symlinks are
followed (Hugging Face caches are symlinks), so the caller decides whose
rights the opens run with (predict.py: the unit owner's).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
import struct
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.text import quoted
from .modelfile import (
    IdentityCache,
    ModelFileError,
    ModelOpenError,
    ModelTimeout,
    ModelUnreadable,
    identity,
    open_regular,
)

# Absolute caps. The reference implementation (huggingface/safetensors) refuses headers over
# 100,000,000 bytes; the same cap here means no file it would open is refused for its header's
# size, and since the header is streamed (a chunk and one entry at a time), the cap bounds the
# time a header costs (reading and scanning 100 MB: well under a second), not the memory.
MAX_HEADER = 100_000_000
# Tensors per file: a real shard holds hundreds to a few thousand (DeepSeek-V3's 163 shards
# about 560 each; Kimi-K2-Thinking's 62 about 3,300). The most a real single file could
# hold is a quantized MoE saved unsharded: Qwen3-30B-A3B in GPTQ (48 layers x 128 experts
# x 3 projections x 4 tensors) is ~74,000. 262,144 is 3.5x that, about 36 MB of header,
# read in ~2 s here. Per tensor the reader keeps 16 bytes (its offsets, for the overlap
# check): a file at the cap costs ~4 MB, ~10 MB more while out-of-order offsets are sorted.
MAX_TENSORS = 1 << 18
# Tensors per model, all shards: the largest real models list ~90,000 (DeepSeek-V3 in FP8:
# 58 MoE layers x 256 experts x 3 x weight + scale) to ~210,000 (Kimi-K2-Thinking in INT4:
# 60 x 384 x 3 x packed weight, scale, shape). 2.5x the largest. Parsing costs ~7 us a tensor
# here, so a model at the cap reads in ~4 s, within the deadline.
MAX_MODEL_TENSORS = 1 << 19
MAX_RANK = 8  # dimensions of one tensor: a Conv3d weight (vision towers) has 5
MAX_ELEMENTS = 1 << 48  # per tensor: far past any real model (as gguf.MAX_ELEMENTS)
MAX_OFFSET = 1 << 50  # a data offset: 1 PiB
MAX_NAME = 1024  # characters of a tensor name (real ones: under 120)
MAX_ENTRY = 4096  # characters of one tensor's entry (dtype, shape, offsets: ~100)
MAX_METADATA = 1 << 20  # characters of "__metadata__" (string -> string; real: under 1 kB)
MAX_SHARDS = 4096  # distinct files an index names (Llama-3.1-405B in BF16: 191)
MAX_SHARD_NAME = 255  # a file name (NAME_MAX)
# The index lists every tensor once (~100 bytes each): Kimi-K2-Thinking's ~210,000 make
# ~21 MB. It is streamed like a header; only the distinct shard names are kept.
MAX_INDEX = 64 << 20
MAX_CONFIG = 1 << 20  # config.json: real ones are 1-50 kB; parsed whole (json.loads)
MAX_DIR_ENTRIES = 1 << 14  # names looked at in a model directory (real: tens to hundreds)
CHUNK = 1 << 20
READ_SECONDS = 10.0  # one model, all shards, as gguf.READ_SECONDS

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SUFFIX = ".safetensors"

# safetensors dtype -> bits per element (the dtypes of safetensors 0.8: Dtype::bitsize).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_WS = re.compile(r"[ \t\n\r]*")
# json's own string scanner (C): (text, index after the opening quote, strict) -> (str, end).
_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class Shard:
    """One safetensors file's header, summed: what the estimate needs of it."""

    path: str
    tensors: int
    tensor_bytes: int
    header_bytes: int  # N, the JSON's length
    file_size: int


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape in config.json (text_config first, for multimodal configs)."""

    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    dtype: str | None  # torch_dtype (transformers >= 4.56: "dtype") as written, for display
    notes: tuple[str, ...] = ()

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token, every layer counted as full attention."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Model:
    """A safetensors model as the footprint needs it: every shard's weights, and the config."""

    path: str  # as given: a directory, an index, or one file
    files: tuple[str, ...]  # the shard files read, by path
    tensors: int
    tensor_bytes: int
    config: ModelConfig | None  # None: not asked for
    cost: int = field(default=0, compare=False)  # rough bytes of memory it holds, for caches


# --- opening, with the caller's rights, never blocking --------------------------------------


def _open(path: str, *, dir_fd: int | None = None, shown: str | None = None) -> int:
    try:
        return os.open(path, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise ModelOpenError(shown or path, e) from None


def _fstat(fd: int, shown: str) -> os.stat_result:
    try:
        return os.fstat(fd)
    except OSError as e:
        raise ModelUnreadable(f"{shown}: cannot read: {e.strerror}") from None


# --- a JSON document read a chunk at a time ---------------------------------------------


class _Stream:
    """One JSON value in bytes [start, start + length) of a file, never held whole.

    Text is decoded from CHUNK-sized reads into a window; names are decoded with
    json's scanstring and small values with raw_decode (both C), each at most its
    limit long, and the window keeps only what is not yet consumed.
    """

    def __init__(
        self, path: str, fd: int, start: int, length: int, deadline: float | None, what: str
    ) -> None:
        self.path = path
        self.fd = fd
        self.at = start
        self.end = start + length
        self.deadline = deadline
        self.what = what
        self.buf = ""
        self.pos = 0
        self.eof = length <= 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")

    def fail(self, problem: str) -> ModelFileError:
        where = f"{self.path}: {self.what}: " if self.what else f"{self.path}: "
        return ModelFileError(where + problem)

    def tick(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ModelTimeout(f"{self.path}: read past its deadline")

    def more(self) -> bool:
        """The next chunk into the window; False at the end of the range."""
        if self.eof:
            return False
        self.tick()
        n = min(CHUNK, self.end - self.at)
        data = os.pread(self.fd, n, self.at)
        if len(data) != n:
            raise self.fail("file shrank while being read")
        self.at += n
        self.eof = self.at >= self.end
        try:
            text = self._utf8.decode(data, self.eof)
        except UnicodeDecodeError:
            raise self.fail("not valid UTF-8") from None
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def first(self) -> str:
        """The first character, without skipping whitespace ('' when empty)."""
        while not self.buf and self.more():
            pass
        return self.buf[:1]

    def peek(self) -> str:
        """The next character that is not whitespace ('' at the end)."""
        pos, buf = self.pos, self.buf
        if pos < len(buf) and buf[pos] not in " \t\n\r":
            return buf[pos]  # the common case, without the regular expression
        while True:
            m = _WS.match(self.buf, self.pos)
            assert m is not None  # `*` matches the empty string
            self.pos = m.end()
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos : self.pos + 1]

    def expect(self, ch: str) -> None:
        got = self.peek()
        if got != ch:
            raise self.fail(f"expected {ch!r}, found {got!r}" if got else f"ends before {ch!r}")
        self.pos += 1

    def _truncated(self, e: json.JSONDecodeError) -> bool:
        """Whether a decoding error may only be the window's end (more text would mend it)."""
        return not self.eof and (e.msg.startswith("Unterminated") or e.pos >= len(self.buf) - 16)

    def string(self, limit: int) -> str:
        """A JSON string at the position (after peek() said '"'), at most `limit` long."""
        while True:
            try:
                s, end = _scanstring(self.buf, self.pos + 1, True)
            except json.JSONDecodeError as e:
                if not self._truncated(e):
                    raise self.fail(f"bad string: {e.msg}") from None
                if len(self.buf) - self.pos > limit + 2:
                    raise self.fail(f"a name longer than {limit} characters") from None
                self.more()
                continue
            if end - self.pos > limit + 2:
                raise self.fail(f"a name longer than {limit} characters")
            self.pos = end
            return s

    def value(self, limit: int) -> Any:
        """One JSON value at the position, at most `limit` characters of text."""
        while True:
            try:
                v, end = _decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if not self._truncated(e):
                    raise self.fail(f"not valid JSON: {e.msg}") from None
                if len(self.buf) - self.pos > limit:
                    raise self.fail(f"a value longer than {limit} characters") from None
                self.more()
                continue
            except RecursionError:
                raise self.fail("values nested too deeply") from None
            except ValueError:  # an integer of more digits than Python converts
                raise self.fail("a number with too many digits") from None
            # A number that ends where the window does may go on in the next chunk.
            if end == len(self.buf) and not self.eof and isinstance(v, int | float):
                self.more()
                continue
            if end - self.pos > limit:
                raise self.fail(f"a value longer than {limit} characters")
            self.pos = end
            return v

    def members(self) -> Iterator[str]:
        """The names of the object at the position; the caller consumes each value."""
        self.expect("{")
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            got = self.peek()
            if got != '"':
                raise self.fail(f"expected a quoted name, found {got!r}" if got else "ends early")
            name = self.string(MAX_NAME)
            self.expect(":")
            self.peek()  # the value starts at the position: raw_decode skips no whitespace
            yield name
            got = self.peek()
            self.pos += 1
            if got == "}":
                return
            if got != ",":
                raise self.fail(f"expected ',' or '}}', found {got!r}" if got else "ends early")

    def finish(self) -> None:
        """Only whitespace may follow (safetensors pads its header with spaces)."""
        if self.peek():
            raise self.fail("data after the JSON object")


# --- one file's header ------------------------------------------------------------------


def _tensor(s: _Stream, name: str, entry: Any, data_len: int) -> tuple[int, int, int]:
    """(bytes, begin, end) of one tensor's entry, checked."""

    def bad(problem: str) -> ModelFileError:
        return s.fail(f"tensor {quoted(name, 80)}: {problem}")

    if not isinstance(entry, dict):
        raise bad("not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        shown = quoted(dtype, 24) if isinstance(dtype, str) else repr(dtype)[:24]
        raise bad(f"unknown dtype {shown}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise bad(f"shape {shape!r:.120} is not a list of at most {MAX_RANK} dimensions")
    elements = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_ELEMENTS:
            raise bad(f"shape {shape!r:.120} is not whole numbers in [0, 2^48]")
        elements *= d
    if elements > MAX_ELEMENTS:
        raise bad(f"shape {shape} is over 2^48 elements")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise bad(f"data_offsets {offsets!r:.120} are not [begin, end]")
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= MAX_OFFSET:
        raise bad(f"data_offsets {offsets!r:.120} are not offsets with 0 <= begin <= end <= 2^50")
    bits = elements * DTYPE_BITS[dtype]
    if bits % 8:
        raise bad(f"{dtype} x {shape} is not a whole number of bytes")
    if end - begin != bits // 8:
        held, needed = end - begin, bits // 8
        raise bad(f"data_offsets [{begin}, {end}] hold {held} bytes, {dtype} x {shape} is {needed}")
    if end > data_len:
        raise bad(f"data_offsets end at {end}, past the {data_len} bytes of data in the file")
    return end - begin, begin, end


def _overlap(begins: array[int], ends: array[int]) -> bool:
    """Whether two non-empty ranges overlap.

    None do exactly when, with the begins and the ends each sorted, every begin
    after the first is at or past the end before it: at any point the ranges
    begun minus the ranges ended is then at most one.
    """
    b = sorted(begins)
    e = sorted(ends)
    return any(b[i + 1] < e[i] for i in range(len(b) - 1))


def _parse(path: str, fd: int, size: int, deadline: float | None) -> Shard:
    if size < 8:
        raise ModelFileError(f"{path}: not a safetensors file ({size} bytes)")
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise ModelFileError(f"{path}: file shrank while being read")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER:
        raise ModelFileError(f"{path}: header of {n} bytes is over the limit of {MAX_HEADER}")
    if n > size - 8:
        raise ModelFileError(
            f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)"
        )
    data_len = size - 8 - n
    s = _Stream(path, fd, 8, n, deadline, "header")
    if s.first() != "{":
        raise ModelFileError(f"{path}: not a safetensors file (its header is not a JSON object)")
    count = total = 0
    begins, ends = array("Q"), array("Q")
    ordered, last_end = True, 0
    for name in s.members():
        if name == "__metadata__":
            meta = s.value(MAX_METADATA)
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise s.fail("__metadata__ is not an object of strings")
            continue
        count += 1
        if count > MAX_TENSORS:
            raise s.fail(f"more than {MAX_TENSORS} tensors")
        if not count % 1024:
            s.tick()
        nbytes, begin, end = _tensor(s, name, s.value(MAX_ENTRY), data_len)
        total += nbytes
        if nbytes:
            begins.append(begin)
            ends.append(end)
            if begin < last_end:
                ordered = False
            last_end = max(last_end, end)
    s.finish()
    if not ordered and _overlap(begins, ends):
        raise ModelFileError(f"{path}: header: tensors' data_offsets overlap")
    return Shard(path, count, total, n, size)


def read_header(
    path: str,
    *,
    deadline: float | None = None,
    opened: tuple[int, os.stat_result] | None = None,
) -> Shard:
    """One safetensors file's header, summed; ModelFileError for anything unsound.

    `deadline` (time.monotonic()) defaults to READ_SECONDS from now. `opened`: an
    fd from open_regular() (not closed here) and its stat.
    """
    if deadline is None:
        deadline = time.monotonic() + READ_SECONDS
    fd, st = opened if opened is not None else open_regular(path)
    try:
        return _parse(path, fd, st.st_size, deadline)
    except OSError as e:
        raise ModelUnreadable(f"{path}: cannot read: {e.strerror}") from None
    finally:
        if opened is None:
            os.close(fd)


# --- the index of a sharded model -------------------------------------------------------


def _plain_name(name: Any, index: str) -> str:
    """A shard's file name from an index: a user's text, so one plain name in the directory."""
    if not isinstance(name, str):
        raise ModelFileError(f"{index}: weight_map: a file name that is not a string")
    if (
        not name
        or "/" in name
        or "\0" in name
        or name in (".", "..")
        or len(name.encode("utf-8", "replace")) > MAX_SHARD_NAME
    ):
        raise ModelFileError(
            f"{index}: weight_map: {quoted(name, 80)} is not a file name in the model's directory"
        )
    return name


def _read_index(shown: str, fd: int, size: int, deadline: float | None) -> list[str]:
    """The distinct shard names of an index's weight_map, in the order first named."""
    if size > MAX_INDEX:
        raise ModelFileError(f"{shown}: {size} bytes, over the limit of {MAX_INDEX}")
    s = _Stream(shown, fd, 0, size, deadline, "")
    names: dict[str, None] = {}
    seen_map = False
    for key in s.members():
        if key != "weight_map":
            s.value(MAX_METADATA)  # "metadata": {"total_size": ...}; read, not used
            continue
        seen_map = True
        if s.peek() != "{":
            raise s.fail("weight_map is not an object")
        for count, _tensor_name in enumerate(s.members(), 1):
            if count > MAX_MODEL_TENSORS:
                raise s.fail(f"weight_map names more than {MAX_MODEL_TENSORS} tensors")
            if not count % 1024:
                s.tick()
            if s.peek() != '"':
                raise s.fail("weight_map: a file name that is not a string")
            name = _plain_name(s.string(MAX_NAME), shown)
            if name not in names:
                names[name] = None
                if len(names) > MAX_SHARDS:
                    raise s.fail(f"weight_map names more than {MAX_SHARDS} files")
    s.finish()
    if not seen_map:
        raise ModelFileError(f"{shown}: no weight_map")
    if not names:
        raise ModelFileError(f"{shown}: weight_map names no file")
    return list(names)


# --- config.json ------------------------------------------------------------------------


def _whole(cfg: str, key: str, value: Any, cap: int) -> int:
    if type(value) is not int or not 0 < value <= cap:
        raise ModelFileError(f"{cfg}: {key} {value!r:.40}: not a whole number in [1, {cap}]")
    return value


def parse_config(data: bytes, path: str) -> ModelConfig:
    """config.json's attention shape; ModelFileError naming the key for what does not fit."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ModelFileError(f"{path}: values nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise ModelFileError(f"{path}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise ModelFileError(f"{path}: not a JSON object")
    text = doc.get("text_config")
    scopes = [text, doc] if isinstance(text, dict) else [doc]

    def get(key: str) -> Any:
        for scope in scopes:
            if scope.get(key) is not None:
                return scope[key]
        return None

    notes: list[str] = []
    if get("num_hidden_layers") is None or get("num_attention_heads") is None:
        raise ModelFileError(f"{path}: no num_hidden_layers and num_attention_heads")
    layers = _whole(path, "num_hidden_layers", get("num_hidden_layers"), 1 << 12)
    heads = _whole(path, "num_attention_heads", get("num_attention_heads"), 1 << 14)
    kv_raw = get("num_key_value_heads")
    kv_heads = heads if kv_raw is None else _whole(path, "num_key_value_heads", kv_raw, 1 << 14)
    if get("head_dim") is not None:
        head_dim = _whole(path, "head_dim", get("head_dim"), 1 << 14)
    elif get("hidden_size") is not None:
        hidden = _whole(path, "hidden_size", get("hidden_size"), 1 << 20)
        head_dim = hidden // heads
        if head_dim < 1:
            raise ModelFileError(f"{path}: hidden_size {hidden} < num_attention_heads {heads}")
    else:
        raise ModelFileError(f"{path}: no head_dim or hidden_size")
    mpe_raw = get("max_position_embeddings")
    mpe = None if mpe_raw is None else _whole(path, "max_position_embeddings", mpe_raw, 1 << 30)
    dtype = get("torch_dtype") or get("dtype")
    dtype = dtype if isinstance(dtype, str) else None
    layer_types = get("layer_types")
    kinds = set(layer_types) - {"full_attention"} if isinstance(layer_types, list) else set()
    kinds = {k for k in kinds if isinstance(k, str)}
    if get("sliding_window") is not None and get("use_sliding_window") is not False:
        kinds.add("sliding_attention")
    if kinds:
        shown = ", ".join(sorted(quoted(k, 24) for k in kinds)[:4])
        notes.append(f"layers of {shown} counted as full attention (an upper bound)")
    if get("kv_lora_rank") is not None:
        notes.append("MLA (kv_lora_rank): KV by the config's plain head counts")
    return ModelConfig(layers, heads, kv_heads, head_dim, mpe, dtype, tuple(notes))


def _read_config(dir_fd: int, directory: str, deadline: float | None) -> ModelConfig:
    shown = os.path.join(directory, CONFIG_NAME)
    if deadline is not None and time.monotonic() > deadline:
        raise ModelTimeout(f"{shown}: read past its deadline")
    fd, _ = open_regular(CONFIG_NAME, dir_fd=dir_fd, shown=shown)
    try:
        data = b""
        while len(data) <= MAX_CONFIG:
            chunk = os.read(fd, MAX_CONFIG + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise ModelUnreadable(f"{shown}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG:
        raise ModelFileError(f"{shown}: over the limit of {MAX_CONFIG} bytes")
    return parse_config(data, shown)


# --- a model: a directory, an index, or one file ----------------------------------------


ShardCache = IdentityCache["Shard | ModelFileError"]


def shard_cache(max_items: int = 4096) -> ShardCache:
    """Shards (and the problems of files that are not sound ones) by path and identity:
    a Shard is a few hundred bytes, so bounded by count."""
    return IdentityCache(max_items)


def _list(path: str, dir_fd: int, deadline: float | None) -> tuple[str | None, list[str]]:
    """(the index's name, or None; the *.safetensors names) in a model directory."""
    index, files = None, []
    try:
        with os.scandir(dir_fd) as entries:
            for i, entry in enumerate(entries, 1):
                if i > MAX_DIR_ENTRIES:
                    raise ModelFileError(f"{path}: more than {MAX_DIR_ENTRIES} directory entries")
                if not i % 1024 and deadline is not None and time.monotonic() > deadline:
                    raise ModelTimeout(f"{path}: read past its deadline")
                if entry.name == INDEX_NAME:
                    index = entry.name
                elif entry.name.endswith(SUFFIX):
                    files.append(entry.name)
    except OSError as e:
        raise ModelUnreadable(f"{path}: cannot list: {e.strerror}") from None
    if len(files) > MAX_SHARDS and index is None:
        raise ModelFileError(f"{path}: more than {MAX_SHARDS} {SUFFIX} files")
    return index, sorted(files)


def _shard(
    dir_fd: int, directory: str, name: str, deadline: float, cache: ShardCache | None
) -> Shard:
    shown = os.path.join(directory, name)
    if time.monotonic() > deadline:
        raise ModelTimeout(f"{shown}: read past its deadline")
    fd, st = open_regular(name, dir_fd=dir_fd, shown=shown)
    try:
        ident = identity(st)
        got = cache.get(shown, ident) if cache is not None else None
        if isinstance(got, ModelFileError):
            raise ModelFileError(str(got)) from None  # a fresh one: no traceback growing
        if got is not None:
            return got
        try:
            shard = read_header(shown, deadline=deadline, opened=(fd, st))
        except (ModelUnreadable, ModelTimeout):
            raise  # may read fine later: not remembered
        except ModelFileError as e:
            if cache is not None:
                cache.put(shown, ident, ModelFileError(str(e)))
            raise
        if cache is not None:
            cache.put(shown, ident, shard)
        return shard
    finally:
        os.close(fd)


def _resolve(path: str, deadline: float) -> tuple[str, int, str | None, list[str]]:
    """(the model's directory, an fd for it, the index's name or None, the shard names)."""
    fd = _open(path)
    try:
        st = _fstat(fd, path)
        if stat.S_ISDIR(st.st_mode):
            index, names = _list(path, fd, deadline)
            if index is None and not names:
                raise ModelFileError(f"{path}: no {INDEX_NAME} and no *{SUFFIX} file")
            fd, dir_fd = -1, fd
            return path, dir_fd, index, names
        if not stat.S_ISREG(st.st_mode):
            raise ModelFileError(f"{path}: not a regular file or a directory")
    finally:
        if fd >= 0:
            os.close(fd)
    # One file: an index, or a single .safetensors; its directory holds the rest.
    directory = os.path.dirname(path) or "."
    dir_fd = _open(directory)
    try:
        if not stat.S_ISDIR(_fstat(dir_fd, directory).st_mode):
            raise ModelFileError(f"{directory}: not a directory")
    except BaseException:
        os.close(dir_fd)
        raise
    base = os.path.basename(path)
    return (
        (directory, dir_fd, base, [])
        if base.endswith(".json")
        else (directory, dir_fd, None, [base])
    )


def read_model(
    path: str,
    *,
    deadline: float | None = None,
    cache: ShardCache | None = None,
    config: bool = True,
) -> Model:
    """A model: a directory, its index, or one .safetensors file; every shard's weights
    and (with `config`) config.json's attention shape. ModelFileError for the first
    problem, naming its file.

    `deadline` (time.monotonic()) is for everything together, READ_SECONDS from now by
    default. Every file is opened relative to the model directory's fd, and its name
    must be a plain one; with `cache`, a shard whose identity is unchanged is not
    parsed again (it is still opened, with the caller's rights).
    """
    if deadline is None:
        deadline = time.monotonic() + READ_SECONDS
    directory, dir_fd, index, names = _resolve(path, deadline)
    try:
        if index is not None:
            shown = os.path.join(directory, index)
            ifd, ist = open_regular(index, dir_fd=dir_fd, shown=shown)
            try:
                names = _read_index(shown, ifd, ist.st_size, deadline)
            except OSError as e:
                raise ModelUnreadable(f"{shown}: cannot read: {e.strerror}") from None
            finally:
                os.close(ifd)
        shards = []
        tensors = 0
        for name in names:
            shard = _shard(dir_fd, directory, name, deadline, cache)
            tensors += shard.tensors
            if tensors > MAX_MODEL_TENSORS:
                raise ModelFileError(
                    f"{shard.path}: the model holds over {MAX_MODEL_TENSORS} tensors"
                )
            shards.append(shard)
        cfg = _read_config(dir_fd, directory, deadline) if config else None
    finally:
        os.close(dir_fd)
    files = tuple(s.path for s in shards)
    return Model(
        path=path,
        files=files,
        tensors=tensors,
        tensor_bytes=sum(s.tensor_bytes for s in shards),
        config=cfg,
        cost=512 + sum(len(f) + 64 for f in files),
    )
