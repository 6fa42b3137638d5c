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
    # Architectures whose tensor list llama.cpp checks name by name (_LAYOUTS): the
    # layout's name, and typed metadata (int: uint32, float: float32, bool, str, list).
    layout: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


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
        layout="qwen3moe",
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
        weight_type=Q.Q8_0,  # MXFP4 experts (the layout), Q8_0 for the rest
        extra={"attention.sliding_window": 128},
        layout="gpt-oss",
        meta={"rope.dimension_count": 64},
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
    # The models of issue 18, with the tensor lists llama.cpp's loader asks for (it
    # refuses a file with a tensor missing or one too many), so that its own
    # llama-fit-params accounting runs on them (lab/llamacpp.py).
    # gpt-oss-20b: config.json of openai/gpt-oss-20b; MXFP4 experts, attention sinks, SWA 128.
    "gpt-oss-20b": Spec(
        "gpt-oss-20b",
        "gpt-oss",
        24,
        2880,
        64,
        8,
        64,
        64,
        131072,
        201088,
        n_ff=2880,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=2880,
        weight_type=Q.Q8_0,
        extra={"attention.sliding_window": 128},
        layout="gpt-oss",
        meta={"rope.dimension_count": 64},
    ),
    # Qwen3-Next-80B-A3B: gated-delta-net (linear attention) in 3 of 4 layers.
    "qwen3-next-80b-a3b": Spec(
        "Qwen3-Next-80B-A3B",
        "qwen3next",
        48,
        2048,
        16,
        2,
        256,
        256,
        262144,
        151936,
        n_ff=5120,
        n_expert=512,
        n_expert_used=10,
        n_ff_exp=512,
        layout="qwen3next",
        meta={
            "expert_shared_feed_forward_length": 512,
            "ssm.conv_kernel": 4,
            "ssm.state_size": 128,
            "ssm.group_count": 16,
            "ssm.time_step_rank": 32,
            "ssm.inner_size": 4096,
            "full_attention_interval": 4,
            "rope.dimension_count": 64,
        },
    ),
    # NVIDIA-Nemotron-3-Nano-30B-A3B: 23 Mamba-2, 23 MoE and 6 attention blocks.
    "nemotron-3-nano-30b-a3b": Spec(
        "Nemotron-3-Nano-30B-A3B",
        "nemotron_h_moe",
        52,
        2688,
        32,
        2,
        128,
        128,
        262144,
        131072,
        n_expert=128,
        n_expert_used=6,
        n_ff_exp=1856,
        weight_type=Q.Q8_0,
        layout="nemotron_h_moe",
        meta={
            "pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            "expert_shared_feed_forward_length": 3712,
            "expert_shared_count": 1,
            "ssm.conv_kernel": 4,
            "ssm.state_size": 128,
            "ssm.group_count": 8,
            "ssm.time_step_rank": 64,
            "ssm.inner_size": 4096,
        },
    ),
    # GLM-4.5-Air: 46 blocks and the MTP (next-token prediction) block as the 47th.
    "glm-4.5-air": Spec(
        "GLM-4.5-Air",
        "glm4moe",
        47,
        4096,
        96,
        8,
        128,
        128,
        131072,
        151552,
        n_ff=10944,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=1408,
        weight_type=Q.Q4_0,
        layout="glm4moe",
        meta={
            "nextn_predict_layers": 1,
            "leading_dense_block_count": 1,
            "expert_shared_count": 1,
            "rope.dimension_count": 64,
        },
    ),
}


def _tensors(s: Spec) -> list[tuple[str, tuple[int, ...], Any]]:
    """(name, ggml dims, type): the weight matrices of a decoder, close to the real list."""
    if s.layout:
        return _LAYOUTS[s.layout](s)
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


Tensors = list[tuple[str, tuple[int, ...], Any]]
F32 = Q.F32


def _head(s: Spec) -> Tensors:
    return [
        ("token_embd.weight", (s.n_embd, s.n_vocab), s.weight_type),
        ("output_norm.weight", (s.n_embd,), F32),
        ("output.weight", (s.n_embd, s.n_vocab), s.weight_type),
    ]


def _attn(s: Spec, b: str, q_rows: int, bias: bool = False) -> Tensors:
    e, wt = s.n_embd, s.weight_type
    kv = s.n_head_kv * s.k_len
    out: Tensors = [
        (f"{b}.attn_q.weight", (e, q_rows), wt),
        (f"{b}.attn_k.weight", (e, kv), wt),
        (f"{b}.attn_v.weight", (e, s.n_head_kv * s.v_len), wt),
        (f"{b}.attn_output.weight", (s.n_head * s.v_len, e), wt),
    ]
    if bias:
        out += [
            (f"{b}.attn_q.bias", (q_rows,), F32),
            (f"{b}.attn_k.bias", (kv,), F32),
            (f"{b}.attn_v.bias", (s.n_head_kv * s.v_len,), F32),
        ]
    return out


def _experts(s: Spec, b: str, wt: Any = None) -> Tensors:
    e, f, x = s.n_embd, s.n_ff_exp, s.n_expert
    wt = wt or s.weight_type
    return [
        (f"{b}.ffn_gate_inp.weight", (e, x), F32),
        (f"{b}.ffn_gate_exps.weight", (e, f, x), wt),
        (f"{b}.ffn_up_exps.weight", (e, f, x), wt),
        (f"{b}.ffn_down_exps.weight", (f, e, x), wt),
    ]


def _shared(s: Spec, b: str, f: int, gate: bool = True) -> Tensors:
    e, wt = s.n_embd, s.weight_type
    out: Tensors = [(f"{b}.ffn_gate_shexp.weight", (e, f), wt)] if gate else []
    return [
        *out,
        (f"{b}.ffn_up_shexp.weight", (e, f), wt),
        (f"{b}.ffn_down_shexp.weight", (f, e), wt),
    ]


def _gpt_oss(s: Spec) -> Tensors:
    """llama.cpp src/models/openai-moe.cpp: biases everywhere, sinks, MXFP4 experts."""
    e, f, x = s.n_embd, s.n_ff_exp, s.n_expert
    out = _head(s)
    for il in range(s.n_layer):
        b = f"blk.{il}"
        out += [
            (f"{b}.attn_norm.weight", (e,), F32),
            (f"{b}.post_attention_norm.weight", (e,), F32),
        ]
        out += _attn(s, b, s.n_head * s.k_len, bias=True)
        out += [(f"{b}.attn_output.bias", (e,), F32), (f"{b}.attn_sinks.weight", (s.n_head,), F32)]
        out += _experts(s, b, Q.MXFP4)
        out += [
            (f"{b}.ffn_gate_inp.bias", (x,), F32),
            (f"{b}.ffn_gate_exps.bias", (f, x), F32),
            (f"{b}.ffn_up_exps.bias", (f, x), F32),
            (f"{b}.ffn_down_exps.bias", (e, x), F32),
        ]
    return out


def _qwen3next(s: Spec) -> Tensors:
    """llama.cpp src/models/qwen3next.cpp: every 4th layer attention, the rest gated delta net."""
    e, wt, m = s.n_embd, s.weight_type, s.meta
    key_dim = m["ssm.state_size"] * m["ssm.group_count"]
    value_dim = m["ssm.inner_size"]
    n_v_heads = m["ssm.time_step_rank"]
    out = _head(s)
    for il in range(s.n_layer):
        b = f"blk.{il}"
        out += [
            (f"{b}.attn_norm.weight", (e,), F32),
            (f"{b}.post_attention_norm.weight", (e,), F32),
        ]
        if (il + 1) % m["full_attention_interval"] == 0:
            out += _attn(s, b, s.n_head * s.k_len * 2)  # Q and its output gate
            out += [(f"{b}.attn_q_norm.weight", (s.k_len,), F32)]
            out += [(f"{b}.attn_k_norm.weight", (s.k_len,), F32)]
        else:
            out += [
                (f"{b}.attn_qkv.weight", (e, key_dim * 2 + value_dim), wt),
                (f"{b}.attn_gate.weight", (e, value_dim), wt),
                (f"{b}.ssm_conv1d.weight", (m["ssm.conv_kernel"], key_dim * 2 + value_dim), F32),
                (f"{b}.ssm_dt.bias", (n_v_heads,), F32),
                (f"{b}.ssm_a", (n_v_heads,), F32),
                (f"{b}.ssm_ba.weight", (e, n_v_heads * 2), wt),
                (f"{b}.ssm_norm.weight", (m["ssm.state_size"],), F32),
                (f"{b}.ssm_out.weight", (value_dim, e), wt),
            ]
        out += _experts(s, b)
        out += [(f"{b}.ffn_gate_inp_shexp.weight", (e,), F32)]
        out += _shared(s, b, m["expert_shared_feed_forward_length"])
    return out


def _nemotron_h_moe(s: Spec) -> Tensors:
    """llama.cpp src/models/nemotron-h.cpp: one of Mamba-2 (M), MoE (E), attention (*) a block."""
    e, wt, m = s.n_embd, s.weight_type, s.meta
    d_inner, n_group, d_state = m["ssm.inner_size"], m["ssm.group_count"], m["ssm.state_size"]
    heads = m["ssm.time_step_rank"]
    conv = d_inner + 2 * n_group * d_state
    out = _head(s)
    for il, kind in enumerate(m["pattern"]):
        b = f"blk.{il}"
        out += [(f"{b}.attn_norm.weight", (e,), F32)]
        if kind == "M":
            out += [
                (f"{b}.ssm_in.weight", (e, 2 * d_inner + 2 * n_group * d_state + heads), wt),
                (f"{b}.ssm_conv1d.weight", (m["ssm.conv_kernel"], conv), F32),
                (f"{b}.ssm_conv1d.bias", (conv,), F32),
                (f"{b}.ssm_dt.bias", (heads,), F32),
                (f"{b}.ssm_a", (1, heads), F32),
                (f"{b}.ssm_d", (1, heads), F32),
                (f"{b}.ssm_norm.weight", (d_inner // n_group, n_group), F32),
                (f"{b}.ssm_out.weight", (d_inner, e), wt),
            ]
        elif kind == "*":
            out += _attn(s, b, s.n_head * s.k_len)
        else:
            x, f = s.n_expert, s.n_ff_exp
            out += [
                (f"{b}.ffn_gate_inp.weight", (e, x), F32),
                (f"{b}.exp_probs_b.bias", (x,), F32),
                (f"{b}.ffn_up_exps.weight", (e, f, x), wt),
                (f"{b}.ffn_down_exps.weight", (f, e, x), wt),
            ]
            out += _shared(s, b, m["expert_shared_feed_forward_length"], gate=False)
    return out


def _glm4moe(s: Spec) -> Tensors:
    """llama.cpp src/models/glm4-moe.cpp: the last block is the MTP head (nextn)."""
    e, wt, m = s.n_embd, s.weight_type, s.meta
    trunk = s.n_layer - m["nextn_predict_layers"]
    out = _head(s)
    for il in range(s.n_layer):
        b = f"blk.{il}"
        out += [
            (f"{b}.attn_norm.weight", (e,), F32),
            (f"{b}.post_attention_norm.weight", (e,), F32),
        ]
        out += _attn(s, b, s.n_head * s.k_len, bias=True)
        if il < m["leading_dense_block_count"]:
            out += [
                (f"{b}.ffn_gate.weight", (e, s.n_ff), wt),
                (f"{b}.ffn_up.weight", (e, s.n_ff), wt),
                (f"{b}.ffn_down.weight", (s.n_ff, e), wt),
            ]
        else:
            out += [*_experts(s, b), (f"{b}.exp_probs_b.bias", (s.n_expert,), F32)]
            out += _shared(s, b, s.n_ff_exp * m["expert_shared_count"])
        if il >= trunk:
            out += [
                (f"{b}.nextn.eh_proj.weight", (2 * e, e), wt),
                (f"{b}.nextn.enorm.weight", (e,), F32),
                (f"{b}.nextn.hnorm.weight", (e,), F32),
                (f"{b}.nextn.shared_head_norm.weight", (e,), F32),
            ]
    return out


def _qwen3moe(s: Spec) -> Tensors:
    """llama.cpp src/models/qwen3moe.cpp: Q/K norms, experts in every layer."""
    e = s.n_embd
    out = _head(s)
    for il in range(s.n_layer):
        b = f"blk.{il}"
        out += [(f"{b}.attn_norm.weight", (e,), F32)]
        out += _attn(s, b, s.n_head * s.k_len)
        out += [(f"{b}.attn_q_norm.weight", (s.k_len,), F32)]
        out += [(f"{b}.attn_k_norm.weight", (s.k_len,), F32)]
        out += [(f"{b}.ffn_norm.weight", (e,), F32), *_experts(s, b)]
    return out


_LAYOUTS = {
    "qwen3moe": _qwen3moe,
    "gpt-oss": _gpt_oss,
    "qwen3next": _qwen3next,
    "nemotron_h_moe": _nemotron_h_moe,
    "glm4moe": _glm4moe,
}


def _metadata(spec: Spec) -> dict[str, Any]:
    """The metadata keys (without the architecture prefix) of a layout spec."""
    kv: dict[str, Any] = {
        "attention.layer_norm_rms_epsilon": 1e-5,
        "attention.layer_norm_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
    }
    kv.update({k: v for k, v in spec.meta.items() if k != "pattern"})
    pattern = spec.meta.get("pattern")
    if pattern:  # per-layer head and FFN counts say which block is which (nemotron_h)
        kv["attention.head_count_kv"] = [spec.n_head_kv if c == "*" else 0 for c in pattern]
        kv["feed_forward_length"] = [spec.n_ff_exp if c == "E" else 0 for c in pattern]
    return kv


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
    kv: dict[str, Any] = {
        "block_count": spec.n_layer,
        "context_length": spec.n_ctx_train,
        "embedding_length": spec.n_embd,
        "feed_forward_length": spec.n_ff,
        "attention.head_count": spec.n_head,
        "attention.head_count_kv": spec.n_head_kv,
        "attention.key_length": spec.k_len,
        "attention.value_length": spec.v_len,
    }
    if spec.n_expert:
        kv["expert_count"] = spec.n_expert
        kv["expert_used_count"] = spec.n_expert_used
        kv["expert_feed_forward_length"] = spec.n_ff_exp
    kv.update(spec.extra)
    if spec.layout:
        kv.update(_metadata(spec))
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(f"{a}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{a}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{a}.{key}", value)
        else:
            w.add_uint32(f"{a}.{key}", value)
    # The vocabulary's size, not its 150,000 strings: the real files in lab/testdata.py
    # carry real vocabularies; these are about shapes and sizes.
    # llama.cpp reads a "none" tokenizer as that many placeholder tokens, no merges needed.
    w.add_tokenizer_model("none" if spec.layout else "gpt2")
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

    # The reader refuses a file whose tensors run past its end (a download cut short):
    # the header alone is read at a size that holds any model, then cut to its data's end.
    os.truncate(path, 1 << 42)
    h = read_header(str(path))
    end = h.data_offset
    for t in h.tensors:
        end = max(end, h.data_offset + t.offset + (t.nbytes or 0))
    return end


# Vision projectors (--mmproj), as llama.cpp's converter writes them (conversion/gemma.py
# Gemma3VisionModel, conversion/qwenvl.py Qwen2VLVisionModel, MmprojModel in base.py:
# F16 matrices, F32 vectors) with the clip.* keys and v.* / mm.* tensors that
# tools/mtmd/clip.cpp reads (clip-impl.h KEY_* and TN_*).
@dataclass
class ProjectorSpec:
    name: str
    projector_type: str  # clip.projector_type
    image_size: int
    patch_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    projection_dim: int  # the text model's n_embd
    eps: float = 1e-6
    ffn: str = "gelu"  # clip.use_gelu / clip.use_silu
    n_wa_pattern: int = 0  # Qwen2.5-VL: every n-th block attends in full, the rest in windows


PROJECTORS = {
    # mmproj of google/gemma-3-27b-it: SigLIP-so400m at 896 px, 4x4 average pool, RMS norm and
    # a projection to the text model's 5376. Patch and position embeddings kept F32.
    "gemma-3-27b-mmproj": ProjectorSpec(
        "mmproj-gemma-3-27b-it", "gemma3", 896, 14, 1152, 27, 16, 4304, 5376
    ),
    # mmproj of Qwen/Qwen2.5-VL-7B-Instruct: 32 blocks, SwiGLU, RMS norms, window attention
    # (fullatt_block_indexes 7, 15, 23, 31), 2x2 patch merger to 3584.
    "qwen2.5-vl-7b-mmproj": ProjectorSpec(
        "mmproj-Qwen2.5-VL-7B-Instruct",
        "qwen2.5vl_merger",
        560,
        14,
        1280,
        32,
        16,
        3420,
        3584,
        ffn="silu",
        n_wa_pattern=8,
    ),
}


def _projector_tensors(p: ProjectorSpec) -> Tensors:
    e, f, F16 = p.n_embd, p.n_ff, Q.F16
    qwen = p.projector_type == "qwen2.5vl_merger"
    patch = (p.patch_size, p.patch_size, 3, e)
    out: Tensors = []
    if qwen:  # the Conv3D split into two Conv2D (two frames), no bias, no position table
        out += [("v.patch_embd.weight", patch, F16), ("v.patch_embd.weight.1", patch, F16)]
    else:
        n_pos = (p.image_size // p.patch_size) ** 2
        out += [
            ("v.patch_embd.weight", patch, F32),
            ("v.patch_embd.bias", (e,), F32),
            ("v.position_embd.weight", (e, n_pos), F32),
        ]
    for il in range(p.n_layer):
        b = f"v.blk.{il}"
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out += [(f"{b}.{t}.weight", (e, e), F16), (f"{b}.{t}.bias", (e,), F32)]
        out += [(f"{b}.ln1.weight", (e,), F32), (f"{b}.ln2.weight", (e,), F32)]
        if not qwen:  # LayerNorm (SigLIP) has biases; Qwen's RMSNorm has none
            out += [(f"{b}.ln1.bias", (e,), F32), (f"{b}.ln2.bias", (e,), F32)]
        out += [(f"{b}.ffn_up.weight", (e, f), F16), (f"{b}.ffn_up.bias", (f,), F32)]
        if qwen:
            out += [(f"{b}.ffn_gate.weight", (e, f), F16), (f"{b}.ffn_gate.bias", (f,), F32)]
        out += [(f"{b}.ffn_down.weight", (f, e), F16), (f"{b}.ffn_down.bias", (e,), F32)]
    out += [("v.post_ln.weight", (e,), F32)]
    if qwen:
        m = 4 * e  # 2x2 patches merged
        out += [
            ("mm.0.weight", (m, m), F16),
            ("mm.0.bias", (m,), F32),
            ("mm.2.weight", (m, p.projection_dim), F16),
            ("mm.2.bias", (p.projection_dim,), F32),
        ]
    else:
        out += [
            ("v.post_ln.bias", (e,), F32),
            ("mm.input_projection.weight", (p.projection_dim, e), F16),
            ("mm.soft_emb_norm.weight", (e,), F32),
        ]
    return out


def write_projector(p: ProjectorSpec, directory: Path) -> Path:
    """Write the projector (sparse) as <name>.gguf; returns its path."""
    path = directory / f"{p.name}.gguf"
    w = gguf.GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_name(p.name)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(p.projector_type)
    w.add_vision_image_size(p.image_size)
    w.add_vision_patch_size(p.patch_size)
    w.add_vision_embedding_length(p.n_embd)
    w.add_vision_feed_forward_length(p.n_ff)
    w.add_vision_block_count(p.n_layer)
    w.add_vision_head_count(p.n_head)
    w.add_vision_projection_dim(p.projection_dim)
    w.add_vision_attention_layernorm_eps(p.eps)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    if p.ffn == "silu":
        w.add_vision_use_silu(True)
    else:
        w.add_vision_use_gelu(True)
    if p.n_wa_pattern:
        w.add_vision_n_wa_pattern(p.n_wa_pattern)
    for name, dims, qtype in _projector_tensors(p):
        w.add_tensor_info(
            name, tuple(reversed(dims)), np.dtype(np.float32), _nbytes(dims, qtype), raw_dtype=qtype
        )
    return _finish(w, path)


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    """Write the header, cut the file to its data's end (sparse), return its path."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, _data_end(path))
    return path


def write_lora(base: Spec, rank: int, directory: Path, name: str = "") -> Path:
    """A LoRA adapter for `base` (sparse) as convert_lora_to_gguf.py writes one: A and B
    matrices of `rank` for each attention projection of every layer, F16. Returns its
    path; its tensors are rank x (n_embd + n_embd) halves per projection."""
    path = directory / f"{name or base.name + f'-lora-r{rank}'}.gguf"
    w = gguf.GGUFWriter(path, base.arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(2 * rank))
    e = base.n_embd
    for il in range(base.n_layer):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            for half, dims in (("lora_a", (e, rank)), ("lora_b", (rank, e))):
                w.add_tensor_info(
                    f"blk.{il}.{t}.weight.{half}",
                    tuple(reversed(dims)),
                    np.dtype(np.float32),
                    _nbytes(dims, Q.F16),
                    raw_dtype=Q.F16,
                )
    return _finish(w, path)
