"""The GGUF header reader: agrees with gguf-py on real and synthetic files, refuses hostile ones."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab import synth, testdata
from spark_guard.foresight import gguf as ours
from spark_guard.foresight.gguf import (
    GGML_TYPES,
    SkippedArray,
    header_cache,
    read_header,
    read_model,
)
from spark_guard.foresight.modelfile import ModelFileError, ModelTimeout
from tests import data


def _same_value(ours: object, ref: object) -> bool:
    if isinstance(ref, float):
        return isinstance(ours, float) and abs(ours - ref) <= 1e-6 * max(1.0, abs(ref))
    if isinstance(ref, list):
        return (
            isinstance(ours, list)
            and len(ours) == len(ref)
            and all(_same_value(a, b) for a, b in zip(ours, ref, strict=True))
        )
    return ours == ref


def assert_agrees_with_gguf_py(path: Path) -> None:
    ours = read_header(str(path))
    ref = gguf.GGUFReader(str(path))
    keys = [f.name for f in ref.fields.values() if not f.name.startswith("GGUF.")]
    assert sorted(ours.metadata) == sorted(keys)
    for field in ref.fields.values():
        if field.name.startswith("GGUF."):
            continue
        value = ours.metadata[field.name]
        if isinstance(value, SkippedArray):
            assert value.length == len(field.data), field.name
        else:
            assert _same_value(value, field.contents()), field.name
    assert [
        (t.name, t.dims, t.type, t.nbytes, ours.data_offset + t.offset) for t in ours.tensors
    ] == [
        (
            t.name,
            tuple(int(d) for d in t.shape),
            int(t.tensor_type),
            int(t.n_bytes),
            int(t.data_offset),
        )
        for t in ref.tensors
    ]


def test_the_ggml_type_table_is_gguf_pys():
    ref = {int(t): (b, s) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}
    # Types newer than the gguf-py here, from llama.cpp's ggml-common.h (0c1e57098).
    ref.setdefault(42, (64, 18))  # Q2_0
    assert {t: (b, s) for t, (_, b, s) in GGML_TYPES.items()} == ref


# gguf-py's reader builds a numpy view per array element: on the six vocab files over
# 5 MB (gemma-4, command-r, llama-bpe, nomic-bert-moe, qwen2, qwen35) it took 10-23 s
# each, 86 s of the suite, to say again what the smaller files say: the same element
# types (string, f32 and i32 arrays, merges), only longer. Length is covered by the
# synthetic big models below and by the caps tests; these thirteen cover every tokenizer
# kind the set has (spm, bpe with merges, wpm) and the real model.
REFERENCE_MAX_BYTES = 5 * 2**20


def _reference_files() -> list[object]:
    # At collection: from the cache only (tests/prebuild.py fetches), a skip where it is not.
    try:
        paths = testdata.real_ggufs()
    except testdata.NotFetched as e:
        return [pytest.param(None, marks=pytest.mark.skip(reason=str(e)), id="not-fetched")]
    return [
        pytest.param(p, id=p.name)
        for p in paths
        if p.stat().st_size <= REFERENCE_MAX_BYTES or "vocab" not in p.name
    ]


@pytest.mark.parametrize("path", _reference_files())
def test_real_files_read_as_gguf_py_reads_them(path):
    assert_agrees_with_gguf_py(path)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    return {
        key: synth.write(spec, d, shards=3 if key == "deepseek-v3" else 1)
        for key, spec in synth.SPECS.items()
    }


@pytest.mark.parametrize("key", sorted(synth.SPECS))
def test_synthetic_big_models_read_as_gguf_py_reads_them(synthetic, key):
    shards = sorted(synthetic[key].parent.glob(f"{synth.SPECS[key].name}*.gguf"))
    assert len(shards) == (3 if key == "deepseek-v3" else 1)
    for shard in shards:
        assert_agrees_with_gguf_py(shard)


def test_a_split_model_is_read_across_its_shards(synthetic):
    first = synthetic["deepseek-v3"]
    assert first.name == "DeepSeek-V3-00001-of-00003.gguf"
    model = read_model(str(first.parent / "DeepSeek-V3-00002-of-00003.gguf"))  # any shard
    shards = sorted(first.parent.glob("DeepSeek-V3-*.gguf"))
    refs = [gguf.GGUFReader(str(p)) for p in shards]
    assert model.shards == 3
    assert len(model.tensors) == sum(len(r.tensors) for r in refs)
    assert model.tensor_bytes == sum(int(t.n_bytes) for r in refs for t in r.tensors)
    assert model.get("deepseek2.attention.key_length") == 576
    assert model.get("split.count") == 3
    # 61 layers of a 671B model at Q2_K: about 220 GiB of weights, in a few MB of disk.
    assert 200 * 2**30 < model.tensor_bytes < 240 * 2**30
    assert sum(p.stat().st_blocks * 512 for p in shards) < 16 * 2**20


def test_a_missing_shard_is_named(synthetic):
    first = synthetic["deepseek-v3"]
    gone = first.parent / "DeepSeek-V3-00003-of-00003.gguf"
    aside = first.parent / "aside"
    gone.rename(aside)
    try:
        with pytest.raises(ModelFileError, match=r"DeepSeek-V3-00003-of-00003\.gguf: cannot open"):
            read_model(str(first))
    finally:
        aside.rename(gone)


# --- hostile headers -----------------------------------------------------------------


def header(n_tensors: int, n_kv: int, body: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def kv_string(key: str, value_len: int, value: bytes = b"") -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, value_len) + value


def read_bytes(tmp_path: Path, data: bytes) -> object:
    p = tmp_path / "hostile.gguf"
    p.write_bytes(data)
    return read_header(str(p))


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"GGML" + b"\0" * 40, "not a GGUF file"),
        (b"GG", "not a GGUF file"),
        (b"GGUF" + struct.pack("<I", 3), "truncated: 8 bytes, a GGUF header needs 24"),
        (header(0, 0, version=1) + b"\0" * 8, "GGUF version 1 is not supported"),
        (header(0, 0, version=7) + b"\0" * 8, "unknown GGUF version 7"),
        (header(0, 2**60), "metadata count 1152921504606846976 cannot fit"),
        (header(2**60, 1), "tensor count 1152921504606846976 cannot fit"),
        (header(0, 1, kv_string("general.name", 2**62)), "string of 4611686018427387904 bytes"),
        (
            header(0, 1, struct.pack("<Q", 4) + b"k.ey" + struct.pack("<IIQ", 9, 4, 2**61)),
            "array element count 2305843009213693952 cannot fit",
        ),
        (
            header(
                0,
                1,
                struct.pack("<Q", 4)
                + b"deep"
                + struct.pack("<I", 9)
                + struct.pack("<IQ", 9, 1) * 6,
            ),
            "arrays nested deeper than 4",
        ),
        (
            header(0, 1, struct.pack("<Q", 4) + b"kind" + struct.pack("<I", 99) + b"\0" * 16),
            "unknown value type 99",
        ),
        (
            header(1, 0, struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9) + b"\0" * 64),
            "tensor 't' has 9 dimensions",
        ),
    ],
    ids=[
        "magic",
        "short",
        "truncated",
        "v1",
        "v7",
        "kv-count",
        "tensor-count",
        "long-string",
        "huge-array",
        "nesting",
        "value-type",
        "dims",
    ],
)
def test_hostile_headers_get_one_clear_line_and_cost_nothing(tmp_path, data, problem):
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError) as err:
            read_bytes(tmp_path, data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert message.startswith(f"{tmp_path}/hostile.gguf: ") and "\n" not in message
    assert problem in message
    assert peak < 4 * 2**20  # never sized by what the header claims


def test_a_truncated_real_header_fails_cleanly_at_every_length(tmp_path):
    full = data.smollm2().read_bytes()[: read_header(str(data.smollm2())).data_offset]
    for cut in range(0, len(full), max(1, len(full) // 97)):
        with pytest.raises(ModelFileError):
            read_bytes(tmp_path, full[:cut])


def test_a_big_endian_file_is_read(tmp_path):
    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(p, "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 30)
    w.add_array("llama.attention.head_count_kv", [0, 3, 3])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    h = read_header(str(p))
    assert h.big_endian and h.get("llama.block_count") == 30
    assert h.get("llama.attention.head_count_kv") == [0, 3, 3]


# --- absolute caps: what a sparse file's size cannot lift -------------------------------

TIB = 2**40


def sparse(tmp_path: Path, data: bytes, name: str = "sparse.gguf", size: int = TIB) -> Path:
    """`data` at the start of a file of `size` bytes that costs a few kB of disk."""
    p = tmp_path / name
    with open(p, "wb") as f:
        f.write(data)
        f.truncate(size)
    return p


# Run in a fresh interpreter: its peak RSS (VmHWM) before and after the read, and the time.
MEASURE = """
import re, sys, time
from spark_guard.foresight.gguf import read_header
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
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    message, seconds, grown = out.stdout.splitlines()
    return message, float(seconds), int(grown)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        # The counts fit in 1 TiB of zeros, so the file size alone let them through.
        (header(2**34, 0), "tensor count 17179869184 is over the limit of 16384"),
        (
            header(0, 1, struct.pack("<Q", 3) + b"key" + struct.pack("<IIQ", 9, 8, 2**36)),
            "array element count 68719476736 cannot fit in a header of 67108864 bytes",
        ),
        (header(0, 2**30), "metadata count 1073741824 is over the limit of 4096"),
    ],
    ids=["2^34-tensors", "2^36-empty-strings", "2^30-keys"],
)
def test_a_sparse_tib_that_claims_too_much_fails_at_once_in_bounded_memory(tmp_path, data, problem):
    path = sparse(tmp_path, data)
    message, seconds, grown_kib = measured_read(path)
    assert message.startswith(f"{path}: at byte ") and problem in message
    assert seconds < 0.5
    assert grown_kib < 8 * 1024  # RSS growth, whatever the header claims


def test_bytes_skipped_count_against_the_header_cap(tmp_path):
    # A string too long to keep is skipped, not read: 65 MiB of it still ends the read.
    body = kv_string("general.license", 65 * 2**20)
    path = sparse(tmp_path, header(0, 1, body))
    message, seconds, grown_kib = measured_read(path)
    assert "header runs past 67108864 bytes" in message
    assert seconds < 0.5 and grown_kib < 8 * 1024


def test_a_long_tensor_name_is_refused(tmp_path):
    body = struct.pack("<Q", 300) + b"n" * 300 + struct.pack("<I", 1) + b"\0" * 64
    with pytest.raises(ModelFileError, match="tensor name longer than 256 bytes"):
        read_bytes(tmp_path, header(1, 0, body))


def test_metadata_kept_in_memory_is_capped(tmp_path):
    # 17 string values of 64 KiB (each kept: a chat template is that size at most) pass 1 MiB.
    value = b"t" * 2**16
    body = b"".join(kv_string(f"k{i:02d}", len(value), value) for i in range(17))
    with pytest.raises(ModelFileError, match="more than 1048576 bytes of metadata to keep"):
        read_bytes(tmp_path, header(0, 17, body))


def test_a_read_past_its_deadline_ends_itself(tmp_path):
    path = sparse(tmp_path, header(0, 1, kv_string("k", 4, b"four")), size=4096)
    with pytest.raises(ModelTimeout, match=r"header read past its deadline"):
        read_header(str(path), deadline=time.monotonic() - 1)
    with pytest.raises(ModelTimeout):
        read_model(str(path), deadline=time.monotonic() - 1)


def _within(seconds: float, fn, *args):
    """fn(*args) in a thread; fails the test (instead of hanging it) if it takes longer."""
    box: dict[str, object] = {}

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
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def test_a_fifo_or_a_device_is_not_opened_for_reading(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # no writer: a plain open() would wait forever
    with pytest.raises(ModelFileError, match=rf"^{fifo}: not a regular file$"):
        _within(5, read_model, str(fifo))
    zero = tmp_path / "zero.gguf"
    zero.symlink_to("/dev/zero")  # would stream zeros without end
    with pytest.raises(ModelFileError, match=rf"^{zero}: not a regular file$"):
        _within(5, read_model, str(zero))
    assert isinstance(_within(5, read_header, str(data.smollm2())), ours.Header)


def test_a_symlinked_model_is_read_as_a_hugging_face_cache_links_it(tmp_path):
    link = tmp_path / "snapshots" / "model.gguf"
    link.parent.mkdir()
    link.symlink_to(data.smollm2())
    assert len(read_model(str(link)).tensors) == 272


def test_a_bad_file_is_not_parsed_again_until_it_changes(tmp_path):
    cache = header_cache()
    bad = header(2**60, 0) + bytes(64)
    path = sparse(tmp_path, bad, size=len(bad))
    with pytest.raises(ModelFileError, match="tensor count"):
        read_model(str(path), cache=cache)
    # Sound bytes behind the same identity (size, mtime, inode): the cached answer stands.
    st = path.stat()
    good = header(0, 0) + bytes(len(bad) - 24)
    with open(path, "r+b") as f:
        f.write(good)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ModelFileError, match="tensor count"):
        read_model(str(path), cache=cache)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # now it changed
    assert read_model(str(path), cache=cache).tensors == ()


def test_the_header_cache_is_bounded_by_what_it_holds(tmp_path):
    cache = header_cache(max_cost=200_000)
    head = data.smollm2().read_bytes()[: 2**21]  # 272 tensors: ~150 kB of Python each
    size = data.smollm2().stat().st_size
    for i in range(50):
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(head)
        os.truncate(p, size)  # sparse: the tensors are within the file, as a whole one's
        read_model(str(p), cache=cache)
    assert len(cache._items) == 1


# --- fuzzing ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed_header() -> bytes:
    full = data.smollm2().read_bytes()
    return full[: read_header(str(data.smollm2())).data_offset]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_headers_parse_or_fail_with_gguf_error(tmp_path, seed_header, data):
    blob = bytearray(seed_header)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(blob) - 1))
        kind = data.draw(st.sampled_from(["byte", "u64", "cut"]))
        if kind == "byte":
            blob[at] = data.draw(st.integers(0, 255))
        elif kind == "u64":
            blob[at : at + 8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
        else:
            del blob[at:]
            if not blob:
                blob = bytearray(b"G")
    with contextlib.suppress(ModelFileError):  # anything else fails the test
        read_bytes(tmp_path, bytes(blob))


@pytest.mark.skipif(
    platform.machine() != "x86_64",
    reason="atheris publishes wheels for x86_64 only (none for aarch64, checked with pip "
    "download); on the Spark's arm64 the hypothesis mutation test above fuzzes the same reader",
)
def test_atheris_finds_nothing_in_a_bounded_run(tmp_path, seed_header):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "smollm2").write_bytes(seed_header)
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "fuzz_gguf.py"),
            "-runs=3000",
            "-max_len=65536",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # libFuzzer may count a few runs past -runs (its last batch): "Done 3004 runs".
    done = re.search(r"^Done (\d+) runs", out.stderr, re.MULTILINE)
    assert done and int(done.group(1)) >= 3000, out.stderr[-3000:]


def test_the_guard_never_imports_gguf_py_or_numpy():
    code = (
        "import sys, spark_guard.daemon, spark_guard.cli, spark_guard.tools.preflight_cli;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('gguf', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"
