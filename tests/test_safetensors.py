"""safetensors models: the bounded header reader, config.json, and SGLang's and TGI's footprint.

The files are written here by hand (the format is an 8-byte length and JSON; the
`safetensors` package is not a dependency), with sparse tensor data, and the reader's
sums are checked against what the writer laid out: the data region of a contiguous file
is exactly its tensors' bytes, and numpy's item sizes say what each standard dtype holds.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lab.accounts import User
from spark_guard.core.argv.loadspec import parse
from spark_guard.core.classify import CommandLine
from spark_guard.core.quantities import format_size
from spark_guard.foresight import safetensors as st
from spark_guard.foresight.modelfile import ModelFileError, ModelTimeout
from spark_guard.foresight.predict import (
    PENDING,
    Prediction,
    Predictor,
    sglang_prediction,
)
from spark_guard.foresight.safetensors import parse_config, read_header, read_model, shard_cache

GiB = 1 << 30
MEM_TOTAL = 128 * GiB
SRC = Path(__file__).parent.parent / "src"

Tensor = tuple[str, str, list[int]]


def nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * st.DTYPE_BITS[dtype] // 8


def header_bytes(tensors: list[Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """A header as safetensors writes it: offsets in order, padded with spaces to 8."""
    doc: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(doc).encode()
    return text + b" " * (-len(text) % 8)


def write(
    path: Path,
    tensors: list[Tensor],
    metadata: dict[str, str] | None = None,
    *,
    header: bytes | None = None,
    data: int | None = None,
) -> Path:
    """A safetensors file whose tensor data is a hole (a sparse file: a few kB of disk)."""
    head = header_bytes(tensors, metadata) if header is None else header
    if data is None:
        data = sum(nbytes(d, s) for _, d, s in tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + data)
    return path


LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def llama_like(n_layers: int = 4) -> list[Tensor]:
    """A small Llama-shaped tensor list (GQA: 8 KV heads of 128)."""
    tensors: list[Tensor] = [("model.embed_tokens.weight", "BF16", [32000, 4096])]
    for i in range(n_layers):
        p = f"model.layers.{i}"
        tensors += [
            (f"{p}.self_attn.q_proj.weight", "BF16", [4096, 4096]),
            (f"{p}.self_attn.k_proj.weight", "BF16", [1024, 4096]),
            (f"{p}.self_attn.v_proj.weight", "BF16", [1024, 4096]),
            (f"{p}.self_attn.o_proj.weight", "BF16", [4096, 4096]),
            (f"{p}.mlp.gate_up_proj.weight", "F8_E4M3", [28672, 4096]),
            (f"{p}.mlp.gate_up_proj.weight_scale", "F32", [224, 32]),
            (f"{p}.mlp.down_proj.weight", "F4", [4096, 14336]),
            (f"{p}.input_layernorm.weight", "F16", [4096]),
        ]
    return [*tensors, ("lm_head.weight", "BF16", [32000, 4096])]


def model_dir(
    root: Path, tensors: list[Tensor], shards: int = 1, config: dict[str, Any] | None = None
) -> Path:
    """A model directory as `save_pretrained` leaves it: shards, an index, config.json."""
    root.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        write(root / "model.safetensors", tensors)
    else:
        weight_map = {}
        per = -(-len(tensors) // shards)
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = tensors[i * per : (i + 1) * per]
            write(root / name, part)
            weight_map.update({t[0]: name for t in part})
        total = sum(nbytes(d, s) for _, d, s in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / st.INDEX_NAME).write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(json.dumps(LLAMA_8B if config is None else config))
    return root


def data_region(path: Path) -> int:
    """Bytes after the header: for a contiguous file, its tensors' bytes exactly."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


# --- the header reader ------------------------------------------------------------------


def test_weights_are_the_sum_of_the_header_checked_against_the_data_and_numpy(tmp_path):
    tensors = llama_like()
    path = write(tmp_path / "model.safetensors", tensors, {"format": "pt"})
    shard = read_header(str(path))
    assert shard.tensors == len(tensors) == 1 + 4 * 8 + 1
    assert shard.tensor_bytes == data_region(path)  # what the writer laid out
    # Independently, with numpy's item sizes where numpy has the dtype.
    sizes = {"BF16": 2, "F16": np.dtype(np.float16).itemsize, "F32": np.dtype(np.float32).itemsize}
    sizes["F8_E4M3"] = np.dtype(np.uint8).itemsize
    expected = 0
    for _, dtype, shape in tensors:
        elements = int(np.prod(shape, dtype=np.int64))
        expected += elements // 2 if dtype == "F4" else elements * sizes[dtype]
    assert shard.tensor_bytes == expected
    assert path.stat().st_blocks * 512 < 1 << 20  # the data is a hole: nothing was read


def test_a_header_across_many_chunks_of_the_stream_sums_exactly(tmp_path):
    # 20,000 experts' tensors: ~2.5 MB of JSON, read a MiB at a time, names cut at the edges.
    tensors: list[Tensor] = [
        (f"model.layers.{i // 128}.mlp.experts.{i % 128}.down_proj.weight", "BF16", [2048, 768])
        for i in range(20000)
    ]
    path = write(tmp_path / "moe.safetensors", tensors)
    shard = read_header(str(path))
    assert shard.header_bytes > 2 * st.CHUNK
    assert (shard.tensors, shard.tensor_bytes) == (20000, data_region(path))
    assert shard.tensor_bytes == 20000 * 2048 * 768 * 2


def test_entries_out_of_offset_order_and_empty_tensors_are_read(tmp_path):
    # Older writers order the JSON by name, not by offset; an empty tensor holds nothing.
    doc = {
        "z": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "a": {"dtype": "I64", "shape": [2, 2], "data_offsets": [16, 48]},
        "empty": {"dtype": "BOOL", "shape": [0, 7], "data_offsets": [16, 16]},
        "m": {"dtype": "U8", "shape": [], "data_offsets": [48, 49]},
    }
    head = json.dumps(dict(sorted(doc.items()))).encode()
    shard = read_header(str(write(tmp_path / "o.safetensors", [], header=head, data=49)))
    assert (shard.tensors, shard.tensor_bytes) == (4, 49)


def hostile(tmp_path: Path, head: bytes, data: int = 64, *, raw: bytes | None = None) -> str:
    """The one-line problem the reader finds in a file with this header."""
    path = tmp_path / "hostile.safetensors"
    if raw is None:
        write(path, [], header=head, data=data)
    else:
        path.write_bytes(raw)
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError) as err:
            read_header(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert peak < 4 * 2**20  # never sized by what the header claims
    return message


def entry(dtype: Any = "F16", shape: Any = (4,), offsets: Any = (0, 8)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def one(value: Any) -> bytes:
    return json.dumps({"w": value}).encode()


@pytest.mark.parametrize(
    ("head", "problem"),
    [
        (b"", "not a safetensors file (its header is not a JSON object)"),
        (b"GGUF\x03\x00\x00\x00", "not a safetensors file (its header is not a JSON object)"),
        (b'["w"]', "not a safetensors file (its header is not a JSON object)"),
        (b' {"w": 1}', "not a safetensors file (its header is not a JSON object)"),
        (b'{"w": ', "header: not valid JSON"),
        (b'{"w": {"dtype": "F16"', "header: not valid JSON"),
        (b'{"w" {}}', "header: expected ':'"),
        (one(entry())[:-1] + b", }", "header: expected a quoted name"),
        (b"{'w': 1}", "header: expected a quoted name"),
        (one(entry()) + b" trailing", "header: data after the JSON object"),
        (b'{"\xff": {}}', "header: not valid UTF-8"),
        (one(7), "tensor 'w': not an object"),
        (one(entry(dtype="Q4_K")), "tensor 'w': unknown dtype 'Q4_K'"),
        (one(entry(dtype=16)), "tensor 'w': unknown dtype 16"),
        (one(entry(shape=(-4,))), "tensor 'w': shape [-4] is not whole numbers"),
        (one(entry(shape=(4.0,))), "tensor 'w': shape [4.0] is not whole numbers"),
        (one(entry(shape=(True,))), "tensor 'w': shape [True] is not whole numbers"),
        (one(entry(shape=(1,) * 9)), "is not a list of at most 8 dimensions"),
        (one(entry(shape=(2**30, 2**30))), "tensor 'w': shape [1073741824, 1073741824] is over"),
        (one(entry(shape=(2**60,))), "tensor 'w': shape [1152921504606846976] is not whole"),
        (one(entry(offsets=(0,))), "tensor 'w': data_offsets [0] are not [begin, end]"),
        (one(entry(offsets=(8, 0))), "tensor 'w': data_offsets [8, 0] are not offsets"),
        (one(entry(offsets=(-8, 0))), "tensor 'w': data_offsets [-8, 0] are not offsets"),
        (one(entry(offsets=(0, 9))), "data_offsets [0, 9] hold 9 bytes, F16 x [4] is 8"),
        (one(entry("F4", (3,), (0, 1))), "tensor 'w': F4 x [3] is not a whole number of bytes"),
        (one(entry(shape=(64,), offsets=(0, 128))), "data_offsets end at 128, past the 64 bytes"),
        (
            json.dumps({"a": entry(offsets=(8, 16)), "b": entry(offsets=(0, 8)), "c": entry()}),
            "header: tensors' data_offsets overlap",
        ),
        (
            json.dumps({"a": entry(), "a ": entry(shape=(2,), offsets=(4, 8))}),
            "header: tensors' data_offsets overlap",
        ),
        (json.dumps({"__metadata__": {"n": 1}}), "__metadata__ is not an object of strings"),
        (json.dumps({"__metadata__": [1]}), "__metadata__ is not an object of strings"),
        (b'{"w": {"dtype": "F16", "shape": [' + b"9" * 5000 + b"]}}", "too many digits"),
        (b'{"__metadata__": ' + b"[" * 3000 + b"]" * 3000 + b"}", "nested too deeply"),
    ],
    ids=lambda x: x if isinstance(x, str) and len(x) < 40 else None,
)
def test_hostile_headers_get_one_clear_line_and_cost_nothing(tmp_path, head, problem):
    head = head.encode() if isinstance(head, str) else head
    assert problem in hostile(tmp_path, head)


def test_the_length_and_the_file_size(tmp_path):
    assert "not a safetensors file (7 bytes)" in hostile(tmp_path, b"", raw=b"\x01" * 7)
    message = hostile(tmp_path, b"", raw=struct.pack("<Q", 64) + b"{}")
    assert "header of 64 bytes runs past the end of the file (10 bytes)" in message
    message = hostile(tmp_path, b"", raw=struct.pack("<Q", st.MAX_HEADER + 1) + b"{}")
    assert f"header of {st.MAX_HEADER + 1} bytes is over the limit of {st.MAX_HEADER}" in message
    message = hostile(tmp_path, b"", raw=struct.pack("<Q", 2**64 - 1) + b"{}")
    assert "header of 18446744073709551615 bytes is over the limit" in message


def test_a_truncated_header_fails_cleanly_at_every_length(tmp_path):
    full = header_bytes(llama_like(2), {"format": "pt"})
    for cut in range(0, len(full), 7):
        with pytest.raises(ModelFileError):
            read_header(str(write(tmp_path / "cut.safetensors", [], header=full[:cut])))


def test_the_tensor_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "MAX_TENSORS", 100)
    ok = [(f"t{i}", "U8", [1]) for i in range(100)]
    assert read_header(str(write(tmp_path / "ok.safetensors", ok))).tensors == 100
    over = write(tmp_path / "over.safetensors", [*ok, ("t100", "U8", [1])])
    with pytest.raises(ModelFileError, match=r"header: more than 100 tensors$"):
        read_header(str(over))


# Run in a fresh interpreter: its peak RSS (VmHWM) before and after the read, and the time.
MEASURE = """
import re, sys, time
from spark_guard.foresight.safetensors import read_header
from spark_guard.foresight.modelfile import ModelFileError
def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
before = hwm()
t = time.monotonic()
try:
    read_header(sys.argv[1])
    print("parsed")
except ModelFileError as e:
    print(e)
print(time.monotonic() - t)
print(hwm() - before)
"""


def measured_read(path: Path) -> tuple[str, float, int]:
    """(message, seconds, peak RSS growth in KiB) of reading `path` in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    message, seconds, grown = out.stdout.splitlines()
    return message, float(seconds), int(grown)


def test_a_header_of_99_mb_streams_in_bounded_memory(tmp_path):
    # Under the cap: a sparse 1 TiB file whose 99 MB header is zeros, one of spaces (read to
    # the end, a chunk at a time), one long name and one long value.
    cases = {
        "zeros": b"",
        "spaces": b"{" + b" " * (99_000_000 - 1),
        "name": b'{"' + b"n" * (99_000_000 - 2),
        "value": b'{"w": [' + b"1," * 20_000_000,
    }
    for what, head in cases.items():
        path = tmp_path / f"{what}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 99_000_000) + head)
            f.truncate(1 << 40)
        message, seconds, grown_kib = measured_read(path)
        path.unlink()  # ~100 MB of disk each (the zeros' excepted: a hole)
        assert message.startswith(f"{path}: "), message
        assert seconds < 3 and grown_kib < 16 * 1024, (what, seconds, grown_kib)
        expected = {
            "zeros": "not a safetensors file",
            "spaces": "header: ends early",
            "name": "a name longer than 1024 characters",
            "value": "a value longer than 4096 characters",
        }[what]
        assert expected in message


def test_a_read_past_its_deadline_ends_itself(tmp_path):
    path = write(tmp_path / "m" / "model.safetensors", llama_like(1))
    with pytest.raises(ModelTimeout, match="read past its deadline"):
        read_header(str(path), deadline=time.monotonic() - 1)
    with pytest.raises(ModelTimeout):
        read_model(str(path.parent), deadline=time.monotonic() - 1, config=False)


# --- models: a directory, an index, shards ----------------------------------------------


def test_a_sharded_model_is_the_sum_of_its_distinct_shards(tmp_path):
    tensors = llama_like(6)
    d = model_dir(tmp_path / "Llama", tensors, shards=3)
    # Mistral's repositories also hold a consolidated file the index does not name.
    write(d / "consolidated.safetensors", tensors)
    model = read_model(str(d))
    shards = sorted(d.glob("model-*.safetensors"))
    assert model.files == tuple(str(p) for p in shards)
    assert model.tensors == len(tensors)
    assert model.tensor_bytes == sum(data_region(p) for p in shards)
    assert (
        model.tensor_bytes == json.loads((d / st.INDEX_NAME).read_text())["metadata"]["total_size"]
    )
    # The index named directly, and a trailing slash, read the same model.
    assert read_model(str(d / st.INDEX_NAME)).tensor_bytes == model.tensor_bytes
    assert read_model(f"{d}/").tensor_bytes == model.tensor_bytes


def test_a_directory_without_an_index_is_its_safetensors_files(tmp_path):
    d = tmp_path / "two"
    write(d / "a.safetensors", [("x", "F32", [10])])
    write(d / "b.safetensors", [("y", "BF16", [3, 3])])
    (d / "config.json").write_text(json.dumps(LLAMA_8B))
    (d / "tokenizer.json").write_text("{}")
    model = read_model(str(d))
    assert (model.tensors, model.tensor_bytes) == (2, 40 + 18)
    assert model.config is not None and model.config.kv_heads == 8
    # One file named directly: just that file, and config.json beside it.
    assert read_model(str(d / "b.safetensors")).tensor_bytes == 18
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError, match=r"no model\.safetensors\.index\.json and no"):
        read_model(str(empty))


def test_a_hugging_face_snapshot_of_symlinks_is_read(tmp_path):
    repo = tmp_path / "models--org--Model"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    src = model_dir(tmp_path / "src", llama_like(2), shards=2)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        f.rename(blobs / f"sha{i}")
        (snap / f.name).symlink_to(f"../../blobs/sha{i}")
    model = read_model(str(snap))
    assert model.tensor_bytes == sum(nbytes(d, s) for _, d, s in llama_like(2))


@pytest.mark.parametrize(
    "name",
    ["../secret.safetensors", "/etc/passwd", "sub/x.safetensors", "..", ".", "", "a\0b", 7],
)
def test_a_shard_name_in_an_index_must_be_a_plain_name(tmp_path, name):
    d = model_dir(tmp_path / "m", llama_like(1), shards=2)
    index = json.loads((d / st.INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = name
    (d / st.INDEX_NAME).write_text(json.dumps(index))
    write(tmp_path / "secret.safetensors", [("s", "F32", [1 << 30])])
    with pytest.raises(ModelFileError) as err:
        read_model(str(d))
    message = str(err.value)
    assert message.startswith(f"{d}/{st.INDEX_NAME}: weight_map: ") and "\n" not in message
    assert "not a string" in message if name == 7 else "is not a file name" in message


@pytest.mark.parametrize(
    ("index", "problem"),
    [
        ({}, "no weight_map"),
        ({"weight_map": {}}, "weight_map names no file"),
        ({"weight_map": []}, "weight_map is not an object"),
        ({"weight_map": {"w": ["a"]}}, "a file name that is not a string"),
        ([], "expected '{'"),
    ],
)
def test_a_bad_index_is_named(tmp_path, index, problem):
    d = model_dir(tmp_path / "m", llama_like(1), shards=2)
    (d / st.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match=problem):
        read_model(str(d))


def test_a_missing_shard_is_named(tmp_path):
    d = model_dir(tmp_path / "m", llama_like(1), shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFileError, match=r"model-00002-of-00002.safetensors: cannot open"):
        read_model(str(d))


def _within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a thread; fails the test (instead of hanging it) if it takes longer."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} still blocked after {seconds}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_fifo_or_a_device_anywhere_in_a_model_is_not_opened_for_reading(tmp_path):
    # No writer: a plain open() of any of these FIFOs would wait forever.
    fifo = tmp_path / "fifo-model"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match=rf"^{fifo}: not a regular file or a directory$"):
        _within(5, read_model, str(fifo))
    for name in ("model-00001-of-00002.safetensors", st.INDEX_NAME, "config.json"):
        d = model_dir(tmp_path / name, llama_like(1), shards=2)
        (d / name).unlink(missing_ok=True)
        os.mkfifo(d / name)
        with pytest.raises(ModelFileError, match=rf"^{d}/{name}: not a regular file$"):
            _within(5, read_model, str(d))
    d = model_dir(tmp_path / "zero", llama_like(1), shards=2)
    (d / "model-00001-of-00002.safetensors").unlink()
    (d / "model-00001-of-00002.safetensors").symlink_to("/dev/zero")
    with pytest.raises(ModelFileError, match=r"model-00001-of-00002\.safetensors: not a regular"):
        _within(5, read_model, str(d))


def test_a_bad_shard_is_not_parsed_again_until_it_changes(tmp_path):
    cache = shard_cache()
    bad = header_bytes([("w", "F16", [4])]).replace(b'"F16"', b'"Q99"')
    path = write(tmp_path / "model.safetensors", [], header=bad, data=8)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    with pytest.raises(ModelFileError, match="unknown dtype 'Q99'"):
        read_model(str(tmp_path), cache=cache)
    st0 = path.stat()
    good = bad.replace(b'"Q99"', b'"F16"')
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(good)
    os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns))  # the same identity
    with pytest.raises(ModelFileError, match="unknown dtype 'Q99'"):
        read_model(str(tmp_path), cache=cache)
    os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns + 1))  # now it changed
    assert read_model(str(tmp_path), cache=cache).tensor_bytes == 8


# --- config.json ------------------------------------------------------------------------


def config(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def test_config_json_gives_the_kv_shape():
    llama = parse_config(json.dumps(LLAMA_8B).encode(), "config.json")
    assert (llama.layers, llama.kv_heads, llama.head_dim) == (32, 8, 128)
    assert llama.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert (llama.max_position_embeddings, llama.dtype, llama.notes) == (131072, "bfloat16", ())
    # No num_key_value_heads: multi-head attention, as many KV heads as heads.
    mha = parse_config(config(num_hidden_layers=2, num_attention_heads=12, hidden_size=768), "c")
    assert (mha.kv_heads, mha.head_dim) == (12, 64)
    # An explicit head_dim wins over hidden_size / heads (Qwen3: 128, not 2048 / 32 = 64).
    qwen3 = parse_config(
        config(
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            hidden_size=2048,
            head_dim=128,
            dtype="bfloat16",  # transformers >= 4.56 writes dtype, not torch_dtype
        ),
        "c",
    )
    assert (qwen3.head_dim, qwen3.dtype) == (128, "bfloat16")
    # null is absent (Mistral's "head_dim": null).
    mistral = parse_config(config(**{**LLAMA_8B, "head_dim": None}), "c")
    assert mistral.head_dim == 128


def test_a_multimodal_config_is_read_from_its_text_config():
    gemma3 = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 5376,
            "num_attention_heads": 32,
            "num_hidden_layers": 62,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "sliding_window": 1024,
            "max_position_embeddings": 131072,
        },
        "vision_config": {"num_hidden_layers": 27, "num_attention_heads": 16},
    }
    c = parse_config(json.dumps(gemma3).encode(), "c")
    assert (c.layers, c.kv_heads, c.head_dim, c.dtype) == (62, 16, 128, "bfloat16")
    assert c.notes == ("layers of 'sliding_attention' counted as full attention (an upper bound)",)


def test_sliding_hybrid_and_mla_layers_are_said_to_be_upper_bounds():
    base = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512}
    off = parse_config(config(**base, sliding_window=4096, use_sliding_window=False), "c")
    assert off.notes == ()
    hybrid = parse_config(
        config(**base, layer_types=["linear_attention"] * 3 + ["full_attention"]), "c"
    )
    assert hybrid.notes == (
        "layers of 'linear_attention' counted as full attention (an upper bound)",
    )
    mla = parse_config(config(**base, kv_lora_rank=512), "c")
    assert mla.notes == ("MLA (kv_lora_rank): KV by the config's plain head counts",)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"[]", "not a JSON object"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (config(num_attention_heads=8, hidden_size=512), "no num_hidden_layers"),
        (config(num_hidden_layers=-1, num_attention_heads=8, hidden_size=512), "num_hidden_layers"),
        (config(num_hidden_layers=2.5, num_attention_heads=8, hidden_size=512), "not a whole"),
        (config(num_hidden_layers=True, num_attention_heads=8, hidden_size=512), "not a whole"),
        (config(num_hidden_layers=2**40, num_attention_heads=8, hidden_size=512), "[1, 4096]"),
        (config(num_hidden_layers=2, num_attention_heads=8), "no head_dim or hidden_size"),
        (config(num_hidden_layers=2, num_attention_heads=8, hidden_size=4), "hidden_size 4 <"),
        (
            config(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads="8", head_dim=8),
            "num_key_value_heads '8'",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"num_hidden_layers": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_key(data, problem):
    with pytest.raises(ModelFileError) as err:
        parse_config(data, "/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and "\n" not in str(err.value)
    assert problem in str(err.value)


def test_a_config_json_over_its_cap_is_refused(tmp_path):
    d = model_dir(tmp_path / "m", llama_like(1))
    (d / "config.json").write_text(json.dumps({**LLAMA_8B, "pad": "x" * st.MAX_CONFIG}))
    with pytest.raises(ModelFileError, match=r"config.json: over the limit of 1048576 bytes"):
        read_model(str(d))


# --- SGLang and TGI: the prediction -----------------------------------------------------


def test_sglang_fills_its_mem_fraction_static_of_memtotal():
    spec = parse(["/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/m/x"])
    assert spec is not None and spec.kind == "sglang"
    got = sglang_prediction(spec, MEM_TOTAL)
    # No --mem-fraction-static: the largest default of SGLang's versions, MemTotal - 10 GiB.
    assert got.bytes == MEM_TOTAL - 10 * GiB
    assert (
        got.source == "sglang --mem-fraction-static (its default here, at most 0.922) of MemTotal"
    )
    assert sglang_prediction(spec, 32 * GiB).bytes == int(32 * GiB * 0.88)
    argv = ["sglang", "serve", "--model-path", "/m/x", "--mem-fraction-static=0.8"]
    given = Predictor().predict([argv], {}, MEM_TOTAL)
    assert given is not None and given.bytes == int(MEM_TOTAL * 0.8)
    assert given.source == "sglang --mem-fraction-static 0.8 of MemTotal"


def tgi(model: str | Path, *flags: str) -> list[str]:
    return ["/usr/local/bin/text-generation-launcher", "--model-id", str(model), *flags]


def test_tgi_fills_its_share_when_its_model_needs_less(tmp_path):
    d = model_dir(tmp_path / "Llama", llama_like(4), shards=2)
    weights = sum(nbytes(dt, s) for _, dt, s in llama_like(4))
    got = Predictor().predict([tgi(d)], {}, MEM_TOTAL)
    assert got is not None and got.bytes == int(MEM_TOTAL * 0.9)
    kv = 4096 * 131072  # the default warmup batch, 4096 tokens, of 2 x 32 x 8 x 128 x 2 bytes
    assert got.source == (
        "tgi 0.9 (TGI_WIGGLE_ROOM) x --cuda-memory-fraction 1 of MemTotal = 115.2GiB"
        f" (it fills it with KV cache); safetensors weights {format_size(weights)}"
        f" + KV {format_size(kv)} (4096 tokens) fit in it"
    )
    env = {"CUDA_MEMORY_FRACTION": "0.5", "TGI_WIGGLE_ROOM": "0.8"}
    halved = Predictor().predict([tgi(d)], env, MEM_TOTAL)
    assert halved is not None and halved.bytes == int(MEM_TOTAL * 0.4)


def test_tgi_needs_its_weights_and_kv_when_they_pass_its_share(tmp_path):
    d = model_dir(tmp_path / "Llama", llama_like(4), shards=3)
    weights = sum(nbytes(dt, s) for _, dt, s in llama_like(4))
    argv = tgi(d, "--cuda-memory-fraction", "0.01", "--max-total-tokens", "32000")
    got = Predictor().predict([argv], {}, MEM_TOTAL)
    assert got is not None and got.estimate is not None
    terms = {t.name: t for t in got.estimate.terms}
    assert terms["weights"].bytes == weights and terms["weights"].exact
    cells = 32000  # a whole number of 16-token blocks already
    assert terms["kv"].bytes == cells * 2 * 32 * 8 * 128 * 2 and terms["kv"].exact
    assert got.estimate.n_ctx == cells
    assert got.bytes == got.estimate.total > int(MEM_TOTAL * 0.9 * 0.01)
    assert got.source.startswith(f"tgi: safetensors weights {format_size(weights)} + KV 3.9GiB")
    assert got.source.endswith(
        "above its 0.9 (TGI_WIGGLE_ROOM) x --cuda-memory-fraction 0.01 share"
    )
    # An fp8 KV cache halves the KV term; a prefill batch larger than one request wins.
    fp8 = Predictor().predict(
        [[*argv, "--kv-cache-dtype", "fp8_e4m3fn", "--max-batch-prefill-tokens", "40001"]],
        {},
        MEM_TOTAL,
    )
    assert fp8 is not None and fp8.estimate is not None
    assert fp8.estimate.terms[1].bytes == 40016 * 2 * 32 * 8 * 128 * 1


def test_tgi_without_a_local_model_is_its_share_and_says_why(tmp_path):
    share = int(MEM_TOTAL * 0.9)
    hub = Predictor().predict([tgi("meta-llama/Llama-3.1-8B")], {}, MEM_TOTAL)
    assert hub is not None and hub.bytes == share
    assert hub.source.endswith(
        "weights not read: meta-llama/Llama-3.1-8B: not an absolute path (a Hub id?)"
    )
    bare = Predictor().predict([["text-generation-launcher"]], {}, MEM_TOTAL)
    assert bare is not None and bare.source.endswith("weights not read: no --model-id")
    gone = Predictor().predict([tgi(tmp_path / "gone")], {}, MEM_TOTAL)
    assert gone is not None and gone.bytes == share
    assert gone.source.endswith(f"weights not read: {tmp_path}/gone: No such file or directory")
    bad = model_dir(tmp_path / "bad", llama_like(1))
    (bad / "config.json").write_text("{}")
    nocfg = Predictor().predict([tgi(bad)], {}, MEM_TOTAL)
    assert nocfg is not None and nocfg.source.endswith(
        f"weights not read: {bad}/config.json: no num_hidden_layers and num_attention_heads"
    )


def llama_3_1_8b() -> list[Tensor]:
    """Llama-3.1-8B's tensors: 16,060,522,496 bytes in BF16, as its own index says."""
    tensors: list[Tensor] = [("model.embed_tokens.weight", "BF16", [128256, 4096])]
    for i in range(32):
        p = f"model.layers.{i}"
        tensors += [
            (f"{p}.self_attn.q_proj.weight", "BF16", [4096, 4096]),
            (f"{p}.self_attn.k_proj.weight", "BF16", [1024, 4096]),
            (f"{p}.self_attn.v_proj.weight", "BF16", [1024, 4096]),
            (f"{p}.self_attn.o_proj.weight", "BF16", [4096, 4096]),
            (f"{p}.mlp.gate_proj.weight", "BF16", [14336, 4096]),
            (f"{p}.mlp.up_proj.weight", "BF16", [14336, 4096]),
            (f"{p}.mlp.down_proj.weight", "BF16", [4096, 14336]),
            (f"{p}.input_layernorm.weight", "BF16", [4096]),
            (f"{p}.post_attention_layernorm.weight", "BF16", [4096]),
        ]
    return [
        *tensors,
        ("model.norm.weight", "BF16", [4096]),
        ("lm_head.weight", "BF16", [128256, 4096]),
    ]


def test_the_worked_example_of_docs_estimator(tmp_path):
    d = model_dir(tmp_path / "Llama-3.1-8B-Instruct", llama_3_1_8b(), shards=4)
    assert read_model(str(d)).tensor_bytes == 16_060_522_496
    predictor = Predictor()
    got = {
        what: predictor.predict([argv], {}, MEM_TOTAL)
        for what, argv in {
            "vllm": ["vllm", "serve", str(d)],
            "sglang 0.8": [
                "sglang",
                "serve",
                "--model-path",
                str(d),
                "--mem-fraction-static",
                "0.8",
            ],
            "sglang": ["python3", "-m", "sglang.launch_server", "--model-path", str(d)],
            "tgi": tgi(d),
            "tgi 0.1": tgi(d, "--cuda-memory-fraction", "0.1", "--max-total-tokens", "32768"),
        }.items()
    }
    assert {what: p.bytes for what, p in got.items() if p is not None} == {
        "vllm": 123_695_058_124,  # 0.9 x 128 GiB
        "sglang 0.8": 109_951_162_777,
        "sglang": 126_701_535_232,  # 128 GiB - 10 GiB
        "tgi": 123_695_058_124,  # 0.9 x 1.0 x 128 GiB: it fills that with KV cache
        "tgi 0.1": 21_165_252_771,  # weights + 4 GiB of KV + 320 MiB + margin: over its share
    }
    least = got["tgi 0.1"]
    assert least is not None and least.estimate is not None
    assert [(t.name, t.bytes) for t in least.estimate.terms] == [
        ("weights", 16_060_522_496),
        ("kv", 32768 * 2 * 32 * 8 * 128 * 2),
        ("host", 320 << 20),
    ]


def test_the_duplicate_rule_still_counts_only_gguf_loads():
    # A directory or a Hub id is not a file a process maps: SGLang and TGI load nothing for it.
    for argv in (tgi("/m/Llama"), ["sglang", "serve", "--model-path", "/m/Llama"]):
        assert CommandLine(argv).loads is None
    assert CommandLine(["llama-server", "-m", "/m/x.gguf"]).loads == "/m/x.gguf"


# --- as the guard reads them: a real unprivileged uid -----------------------------------


def answer(predictor: Predictor, argv: list[str], owner: int, within: float) -> Prediction:
    give_up = time.monotonic() + within
    while True:
        p = predictor.predict([argv], {}, MEM_TOTAL, owner=owner, wait=False)
        assert p is not None
        if not p.pending:
            return p
        assert time.monotonic() < give_up, f"{argv}: still pending after {within}s"
        time.sleep(0.02)


def hers(user: User, path: Path) -> None:
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(path)], check=True)


@pytest.mark.root
def test_her_model_directory_is_read_with_her_rights_and_a_fifo_never_waits(mallory: User):
    models = mallory.home / "models"
    d = model_dir(models / "Llama", llama_like(2), shards=2)
    hers(mallory, models)
    share = int(MEM_TOTAL * 0.01 * 0.9)
    got = answer(Predictor(), tgi(d, "--cuda-memory-fraction", "0.01"), mallory.uid, 5.0)
    assert got.bytes is not None and got.bytes > share and got.source.startswith("tgi: safetensors")
    # A FIFO as the model, as a shard and as config.json: answered at once, never blocking.
    mallory.sh(f"mkfifo {models}/fifo; cp -r {d} {models}/shard; cp -r {d} {models}/config")
    mallory.sh(f"rm {models}/shard/model-00001-of-00002.safetensors")
    mallory.sh(f"mkfifo {models}/shard/model-00001-of-00002.safetensors")
    mallory.sh(f"rm {models}/config/config.json; mkfifo {models}/config/config.json")
    predictor = Predictor()
    for path, problem in (
        (models / "fifo", f"{models}/fifo: not a regular file or a directory"),
        (
            models / "shard",
            f"{models}/shard/model-00001-of-00002.safetensors: not a regular file",
        ),
        (models / "config", f"{models}/config/config.json: not a regular file"),
    ):
        t = time.monotonic()
        first = predictor.predict([tgi(path)], {}, MEM_TOTAL, owner=mallory.uid, wait=False)
        assert first is not None and time.monotonic() - t < 0.1
        assert first.pending is (first.source == PENDING)
        got = answer(predictor, tgi(path), mallory.uid, 2.0)
        assert got.bytes == int(MEM_TOTAL * 0.9)  # the share, and why the model was not read
        assert got.source.endswith(f"weights not read: {problem}")


@pytest.mark.root
def test_whether_a_root_only_path_exists_is_not_told_to_her(mallory: User, public_dir: Path):
    # Her directory links to a root-only shard, a root-only config.json, a file in a root-only
    # directory, and to nothing; her model may also be a root-only or an absent directory.
    vault = public_dir / "vault"
    secret = model_dir(vault / "Secret", llama_like(1))
    vault.chmod(0o700)
    shadow = public_dir / "shadow.safetensors"
    write(shadow, llama_like(1)).chmod(0o600)
    cfg = public_dir / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    cfg.chmod(0o600)
    mine = mallory.home / "links"
    cases: dict[str, tuple[Path, str]] = {}
    for what, target in {
        "root-only shard": shadow,
        "shard in a root-only dir": secret / "model.safetensors",
        "absent shard": public_dir / "absent.safetensors",
    }.items():
        d = model_dir(mine / what.replace(" ", "-"), llama_like(1))
        (d / "model.safetensors").unlink()
        (d / "model.safetensors").symlink_to(target)
        cases[what] = (d, f"{d}/model.safetensors")
    d = model_dir(mine / "root-only-config", llama_like(1))
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(cfg)
    cases["root-only config.json"] = (d, f"{d}/config.json")
    cases["root-only model dir"] = (secret, str(secret))
    cases["absent model dir"] = (public_dir / "absent", str(public_dir / "absent"))
    hers(mallory, mine)
    predictor = Predictor()
    said = {
        what: answer(predictor, tgi(path), mallory.uid, 5.0).source.replace(shown, "PATH")
        for what, (path, shown) in cases.items()
    }
    expected = (
        "tgi 0.9 (TGI_WIGGLE_ROOM) x --cuda-memory-fraction 1 of MemTotal = 115.2GiB; "
        "weights not read: PATH: cannot open the model "
        f"(missing, or unreadable to uid {mallory.uid})"
    )
    assert said == dict.fromkeys(cases, expected)
    # Root itself would have read them: the test is not blind.
    root = Predictor().predict([tgi(secret, "--cuda-memory-fraction", "0.001")], {}, MEM_TOTAL)
    assert root is not None and root.source.startswith("tgi: safetensors weights")
