"""Synthetic GGUF files with the real metadata and tensor list of big models, written with gguf-py.

The header is real; the tensor data is a hole: the file is truncated to its
full length, so it is sparse and takes a few kB of disk for a 100+ GB model.
Hyper-parameters are those of the published models' config.json files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass
class Spec:
    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    k_len: int
    v_len: int
    n_ctx_train: int
    n_vocab: int
    n_ff: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    weight_type: Any = Q.Q4_K
    extra: dict[str, Any] = field(default_factory=dict)


SPECS = {
    # Qwen3-30B-A3B: the model of llama.cpp's tools/fit-params README figures.
    "qwen3-30b-a3b": Spec(
        "Qwen3-30B-A3B",
        "qwen3moe",
        48,
        2048,
        32,
        4,
        128,
        128,
        40960,
        151936,
        n_ff=6144,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        weight_type=Q.F16,
    ),
    "qwen3-32b": Spec("Qwen3-32B", "qwen3", 64, 5120, 64, 8, 128, 128, 40960, 151936, n_ff=25600),
    "gemma-3-27b": Spec(
        "Gemma-3-27B",
        "gemma3",
        62,
        5376,
        32,
        16,
        128,
        128,
        131072,
        262208,
        n_ff=21504,
        extra={"attention.sliding_window": 1024},
    ),
    "gpt-oss-120b": Spec(
        "gpt-oss-120b",
        "gpt-oss",
        36,
        2880,
        64,
        8,
        64,
        64,
        131072,
        201088,
        n_ff=2880,
        n_expert=128,
        n_expert_used=4,
        n_ff_exp=2880,
        weight_type=Q.MXFP4,
        extra={"attention.sliding_window": 128},
    ),
    # DeepSeek-V3 as llama.cpp converts it for MLA: one 576-wide K head, no V.
    "deepseek-v3": Spec(
        "DeepSeek-V3",
        "deepseek2",
        61,
        7168,
        128,
        1,
        576,
        512,
        163840,
        129280,
        n_ff=18432,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=2048,
        weight_type=Q.Q2_K,
        extra={
            "attention.key_length_mla": 192,
            "attention.value_length_mla": 128,
            "attention.kv_lora_rank": 512,
            "rope.dimension_count": 64,
            "leading_dense_block_count": 3,
        },
    ),
}


def _tensors(s: Spec) -> list[tuple[str, tuple[int, ...], Any]]:
    """(name, ggml dims, type): the weight matrices of a decoder, close to the real list."""
    wt = s.weight_type
    out: list[tuple[str, tuple[int, ...], Any]] = [
        ("token_embd.weight", (s.n_embd, s.n_vocab), wt),
        ("output_norm.weight", (s.n_embd,), Q.F32),
        ("output.weight", (s.n_embd, s.n_vocab), wt),
    ]
    for il in range(s.n_layer):
        b = f"blk.{il}"
        out += [
            (f"{b}.attn_norm.weight", (s.n_embd,), Q.F32),
            (f"{b}.attn_q.weight", (s.n_embd, s.n_head * s.k_len), wt),
            (f"{b}.attn_k.weight", (s.n_embd, s.n_head_kv * s.k_len), wt),
            (f"{b}.attn_v.weight", (s.n_embd, s.n_head_kv * s.v_len), wt),
            (f"{b}.attn_output.weight", (s.n_head * s.v_len, s.n_embd), wt),
            (f"{b}.ffn_norm.weight", (s.n_embd,), Q.F32),
        ]
        if s.n_expert and il >= s.extra.get("leading_dense_block_count", 0):
            out += [
                (f"{b}.ffn_gate_inp.weight", (s.n_embd, s.n_expert), Q.F32),
                (f"{b}.ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), wt),
                (f"{b}.ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), wt),
                (f"{b}.ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert), wt),
            ]
        else:
            out += [
                (f"{b}.ffn_gate.weight", (s.n_embd, s.n_ff), wt),
                (f"{b}.ffn_up.weight", (s.n_embd, s.n_ff), wt),
                (f"{b}.ffn_down.weight", (s.n_ff, s.n_embd), wt),
            ]
    return out


def _nbytes(dims: tuple[int, ...], qtype: Any) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def write(spec: Spec, directory: Path, *, shards: int = 1, vocabulary: bool = False) -> Path:
    """Write the model (sparse); returns the path of its first file.

    vocabulary=True adds a token list of the model's size, as every real file has
    (the benchmark wants it; the tests, which gguf-py reads too, go faster without).
    """
    stem = directory / spec.name
    tensors = _tensors(spec)
    per_shard = -(-len(tensors) // shards) if shards > 1 else 0
    path = Path(f"{stem}.gguf")
    w = gguf.GGUFWriter(path, spec.arch, split_max_tensors=per_shard)
    a = spec.arch
    w.add_name(spec.name)
    w.add_uint32(f"{a}.block_count", spec.n_layer)
    w.add_uint32(f"{a}.context_length", spec.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", spec.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", spec.k_len)
    w.add_uint32(f"{a}.attention.value_length", spec.v_len)
    if spec.n_expert:
        w.add_uint32(f"{a}.expert_count", spec.n_expert)
        w.add_uint32(f"{a}.expert_used_count", spec.n_expert_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", spec.n_ff_exp)
    for key, value in spec.extra.items():
        w.add_uint32(f"{a}.{key}", value)
    # The vocabulary's size, not its 150,000 strings: the real files in lab/testdata.py
    # carry real vocabularies; these are about shapes and sizes.
    w.add_tokenizer_model("gpt2")
    w.add_vocab_size(spec.n_vocab)
    if vocabulary:
        w.add_token_list([f"tok{i}" for i in range(spec.n_vocab)])
        w.add_token_types([1] * spec.n_vocab)
    for name, dims, qtype in tensors:
        w.add_tensor_info(
            name, tuple(reversed(dims)), np.dtype(np.float32), _nbytes(dims, qtype), raw_dtype=qtype
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    # Make each file as long as its data says, without writing the data: a hole.
    for f in sorted(directory.glob(f"{spec.name}*.gguf")):
        reader_end = _data_end(f)
        os.truncate(f, reader_end)
    if shards > 1:
        return Path(f"{stem}-00001-of-{shards:05d}.gguf")
    return path


def _data_end(path: Path) -> int:
    from spark_guard.foresight.gguf import read_header

    h = read_header(str(path))
    end = h.data_offset
    for t in h.tensors:
        end = max(end, h.data_offset + t.offset + (t.nbytes or 0))
    return end
