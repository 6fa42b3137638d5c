"""What llama.cpp will hold for a model and its settings, in bytes: plain data in, plain data out.

Four terms, each marked exact or approximate:

- weights   exact: the tensor bytes of every shard (and of the --mmproj file),
            less the MTP (nextn) blocks llama.cpp does not load.
            Counted once: on a unified-memory machine the mmapped file sits
            in page cache, which MemAvailable already counts as available, and
            the copy the GPU holds is the one that costs.
- kv        exact, by llama.cpp's own rules: per layer with KV heads,
            cells x heads x (key_length x bytes_k + value_length x bytes_v);
            per-layer head counts (0: no KV in that layer); explicit key and
            value lengths; MLA caches K only (deepseek2: key_length_mla, one
            head); sliding-window layers hold pad256(min(n_ctx, window x
            slots + n_ubatch)) cells unless --swa-full; n_ctx padded to 256;
            -c 0 is the trained context; slots split the context unless the
            cache is unified. Hybrid and recurrent models (Mamba-2, gated delta
            net): only their attention layers hold KV, and each recurrent layer
            holds an f32 state of (r + s) floats per sequence, whatever the
            context or cache type (counted in the same term, as llama.cpp's
            "context" does). An MTP (nextn) block holds no KV.
- compute   approximate: the graph's peak for one ubatch, fitted to the
            compute buffer llama.cpp reserves (see compute_bytes); with
            --mmproj, plus the compute buffer the projector's image encoder
            reserves at load (see projector_compute_bytes).
- host      approximate: the CUDA context and runtime, the output buffer and
            the tokenizer's tables.

The margin: MARGIN_EXACT of the exact terms plus MARGIN_SHARE of the
approximate ones, at least MARGIN_MIN. docs/estimator.md compares all of it
with llama.cpp's own figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.argv.loadspec import Settings
from .gguf import GGML_TYPES, Model, SkippedArray

MiB = 1024**2
PAD = 256  # llama.cpp pads n_ctx and the sliding-window cache to 256 cells
RUNTIME = 320 * MiB  # CUDA context, cuBLAS workspace, driver allocations (per process)
VOCAB_BYTES = 256  # host bytes per vocabulary entry (token text, scores, maps)
MARGIN_EXACT = 0.02  # alignment, per-backend padding, buffers the exact terms do not list
MARGIN_SHARE = 0.20  # of the approximate terms (CUDA's compute buffer runs larger than CPU's)
MARGIN_MIN = 128 * MiB

# KV cache types llama.cpp accepts for -ctk/-ctv -> ggml type id.
CACHE_TYPES = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "iq4_nl": 20,
    "q5_0": 6,
    "q5_1": 7,
}

# Sliding-window layouts llama.cpp gives an architecture when the file has no
# per-layer pattern: (every n-th layer is full, dense layer first, default window).
SWA_PATTERNS: dict[str, tuple[int, bool, int]] = {
    "gemma2": (2, False, 4096),
    "gemma3": (6, False, 0),
    "gemma3n": (5, False, 0),
    "cohere2": (4, False, 0),
    "gpt-oss": (2, False, 0),
    "exaone4": (4, False, 4096),
    "olmo2": (4, False, 0),
    "llama4": (4, False, 8192),
}


# How llama.cpp tells a recurrent layer, for the architectures it keeps a recurrent
# state for (src/llama-arch.cpp llm_arch_is_recurrent / llm_arch_is_hybrid, and each
# src/models/<arch>.cpp load_arch_hparams):
#   interval     every full_attention_interval-th layer (default 4) is attention, the rest
#                recurrent, unless the file lists attention.recurrent_layers (qwen3next.cpp)
#   no_kv        a layer without KV heads (granite-hybrid.cpp, jamba.cpp, lfm2.cpp, ...)
#   no_kv_no_ff  without KV heads and without FFN; MoE blocks are neither (nemotron-h.cpp)
#   all          every layer (mamba, mamba2); falcon-h1: every layer, and attention in each
RECURRENT: dict[str, str] = {
    "mamba": "all",
    "mamba2": "all",
    "falcon-h1": "all",
    "jamba": "no_kv",
    "granitehybrid": "no_kv",
    "plamo2": "no_kv",
    "lfm2": "no_kv",
    "lfm2moe": "no_kv",
    "nemotron_h": "no_kv_no_ff",
    "nemotron_h_moe": "no_kv_no_ff",
    "qwen3next": "interval",
    "qwen35": "interval",
    "qwen35moe": "interval",
}
STATE_BYTES = 4  # llama.cpp keeps recurrent state in f32 (GGML_TYPE_F32 in create_memory)


class EstimateError(ValueError):
    """The model's metadata lacks what the estimate needs; str() names the key."""


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    exact: bool
    detail: str


@dataclass(frozen=True)
class Estimate:
    terms: tuple[Term, ...]
    margin: int
    n_ctx: int

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms) + self.margin


@dataclass(frozen=True)
class Layers:
    """Per-layer attention shape, as llama.cpp's hparams hold it."""

    n_layer: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    swa: tuple[bool, ...]
    k_len: int
    v_len: int
    k_len_swa: int
    v_len_swa: int
    n_swa: int
    mla: bool
    recurrent: tuple[bool, ...] = ()  # layers that hold a recurrent state instead of (or with) KV
    n_trunk: int = 0  # layers before the MTP (nextn) blocks; 0: all


def _per_layer(value: Any, n_layer: int, key: str) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) < n_layer:
            raise EstimateError(f"{key} has {len(value)} entries for {n_layer} layers")
        return tuple(int(v) for v in value[:n_layer])
    return (int(value),) * n_layer


def _need(model: Model, key: str) -> Any:
    value = model.get(key)
    if value is None or isinstance(value, SkippedArray):
        raise EstimateError(f"{model.path}: {key} missing")
    return value


def layers(model: Model) -> Layers:
    a = model.arch
    if not a:
        raise EstimateError(f"{model.path}: general.architecture missing")
    n_layer = int(_need(model, f"{a}.block_count"))
    n_embd = int(_need(model, f"{a}.embedding_length"))
    head = _need(model, f"{a}.attention.head_count")
    n_head = _per_layer(head, n_layer, f"{a}.attention.head_count")
    n_head_kv = _per_layer(
        model.get(f"{a}.attention.head_count_kv", head), n_layer, f"{a}.attention.head_count_kv"
    )
    first_head = next((h for h in n_head if h), 1)
    k_len = int(model.get(f"{a}.attention.key_length", n_embd // first_head))
    v_len = int(model.get(f"{a}.attention.value_length", n_embd // first_head))
    # MLA (deepseek2 files converted for it): key_length is the compressed row
    # (kv_lora_rank + rope dims, one head) and V is a view of K: no V cache.
    mla = bool(
        model.get(f"{a}.attention.key_length_mla") and model.get(f"{a}.attention.value_length_mla")
    )
    # MTP (nextn) blocks at the end: no KV, weights not loaded (llama_hparams::n_layer()).
    n_next = int(model.get(f"{a}.nextn_predict_layers", 0) or 0)
    n_trunk = n_layer - (n_next if 0 < n_next <= n_layer else 0)  # llama.cpp refuses the rest
    recurrent = _recurrent_layers(model, a, n_layer, n_trunk, n_head_kv)
    attends_too = a == "falcon-h1"  # attention and a recurrent state in every layer
    n_head_kv = tuple(
        0 if il >= n_trunk or (recurrent[il] and not attends_too) else h
        for il, h in enumerate(n_head_kv)
    )
    swa = _swa_layers(model, a, n_layer)
    pattern = SWA_PATTERNS.get(a)
    n_swa = int(model.get(f"{a}.attention.sliding_window", pattern[2] if pattern else 0) or 0)
    if n_swa == 0:
        swa = (False,) * n_layer
    return Layers(
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        swa=swa,
        k_len=k_len,
        v_len=v_len,
        k_len_swa=int(model.get(f"{a}.attention.key_length_swa", k_len)),
        v_len_swa=int(model.get(f"{a}.attention.value_length_swa", v_len)),
        n_swa=n_swa,
        mla=mla,
        recurrent=recurrent,
        n_trunk=n_trunk,
    )


def _recurrent_layers(
    model: Model, arch: str, n_layer: int, n_trunk: int, n_head_kv: tuple[int, ...]
) -> tuple[bool, ...]:
    rule = RECURRENT.get(arch)
    if rule is None:
        return (False,) * n_layer
    if rule == "all":
        return (True,) * n_layer
    if rule == "interval":
        listed = model.get(f"{arch}.attention.recurrent_layers")
        if isinstance(listed, list):
            flags = tuple(bool(v) for v in listed[:n_layer])
            return flags + (False,) * (n_layer - len(flags))
        n = int(model.get(f"{arch}.full_attention_interval", 4) or 4)
        return tuple(il < n_trunk and (il + 1) % n != 0 for il in range(n_layer))
    if rule == "no_kv_no_ff":
        key = f"{arch}.feed_forward_length"
        ff = _per_layer(model.get(key, 0) or 0, n_layer, key)
        return tuple(il < n_trunk and n_head_kv[il] == 0 and ff[il] == 0 for il in range(n_layer))
    return tuple(h == 0 for h in n_head_kv)  # no_kv


def _swa_layers(model: Model, arch: str, n_layer: int) -> tuple[bool, ...]:
    raw = model.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(raw, list):
        return tuple(bool(v) for v in raw[:n_layer]) + (False,) * max(0, n_layer - len(raw))
    pattern = SWA_PATTERNS.get(arch)
    if pattern is None and raw is None:
        # An architecture this table does not know: count every layer in full (the larger figure).
        return (False,) * n_layer
    n, dense_first, _ = pattern or (0, False, 0)
    if isinstance(raw, int):
        n = raw
    if dense_first:
        return tuple(n == 0 or il % n != 0 for il in range(n_layer))
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layer))


def _pad(n: int, to: int = PAD) -> int:
    return -(-n // to) * to


def _row_bytes(type_name: str, elements: int) -> int:
    t = CACHE_TYPES.get(type_name)
    if t is None:
        raise EstimateError(
            f"cache type {type_name!r} unknown (one of {', '.join(sorted(CACHE_TYPES))})"
        )
    _, block, size = GGML_TYPES[t]
    return -(-elements // block) * size


def context_cells(model: Model, s: Settings) -> tuple[int, int]:
    """(n_ctx after llama.cpp's padding, sequences sharing it)."""
    n_ctx = s.n_ctx or int(_need(model, f"{model.arch}.context_length"))
    n_seq = max(1, s.n_parallel)
    n_ctx = _pad(n_ctx)
    if not s.kv_unified and n_seq > 1:
        n_ctx = _pad(n_ctx // n_seq) * n_seq
    return n_ctx, n_seq


def kv_bytes(model: Model, s: Settings) -> tuple[int, str]:
    shape = layers(model)
    n_ctx, n_seq = context_cells(model, s)
    if s.swa_full:
        swa_cells = n_ctx
    elif s.kv_unified or n_seq == 1:
        swa_cells = min(n_ctx, _pad(min(n_ctx, shape.n_swa * n_seq + s.n_ubatch)))
    else:
        swa_cells = n_seq * _pad(min(n_ctx // n_seq, shape.n_swa + s.n_ubatch))
    fa_off = s.flash_attn == "off"
    v_max = max(
        (h * (shape.v_len_swa if w else shape.v_len))
        for h, w in zip(shape.n_head_kv, shape.swa, strict=True)
    )
    total = 0
    full_layers = swa_layers = 0
    for il in range(shape.n_layer):
        heads = shape.n_head_kv[il]
        if heads == 0:
            continue
        is_swa = shape.swa[il]
        cells = swa_cells if is_swa else n_ctx
        k = heads * (shape.k_len_swa if is_swa else shape.k_len)
        total += cells * _row_bytes(s.cache_type_k, k)
        if not shape.mla:
            # Without flash attention V is stored transposed, every layer at the widest row.
            v = v_max if fa_off else heads * (shape.v_len_swa if is_swa else shape.v_len)
            total += cells * _row_bytes(s.cache_type_v, v)
        swa_layers += is_swa
        full_layers += not is_swa
    detail = f"{full_layers} layers x {n_ctx} cells"
    if swa_layers:
        detail += f", {swa_layers} sliding-window layers x {swa_cells} cells"
    detail += f", K {s.cache_type_k}" + ("" if shape.mla else f", V {s.cache_type_v}")
    if shape.mla:
        detail += " (MLA: K only)"
    return total, detail


def state_bytes(model: Model, s: Settings) -> tuple[int, str]:
    """The recurrent state llama.cpp keeps (llama-memory-recurrent.cpp): per recurrent
    layer, one row of r + s f32 values per sequence (max(1, n_seq_max) rows), whatever
    n_ctx or -ctk/-ctv say. r is the convolution's tail, (d_conv - 1) x (d_inner +
    2 n_group d_state) (LFM2: n_embd x (l_cache - 1)); s the SSM state, d_state x d_inner
    (llama_hparams::n_embd_r, n_embd_s)."""
    a = model.arch
    shape = layers(model)
    n_recurrent = sum(shape.recurrent)
    if not n_recurrent:
        return 0, ""
    d_conv = int(model.get(f"{a}.ssm.conv_kernel", 0) or 0)
    d_inner = int(model.get(f"{a}.ssm.inner_size", 0) or 0)
    d_state = int(model.get(f"{a}.ssm.state_size", 0) or 0)
    n_group = int(model.get(f"{a}.ssm.group_count", 0) or 0)
    l_cache = int(model.get(f"{a}.shortconv.l_cache", 0) or 0)
    if l_cache:
        r = int(_need(model, f"{a}.embedding_length")) * (l_cache - 1)
    else:
        r = max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state)
    per_seq = n_recurrent * (r + d_state * d_inner) * STATE_BYTES
    n_seq = max(1, s.n_parallel)
    return per_seq * n_seq, (
        f"recurrent state {n_recurrent} layers x {n_seq} sequences x "
        f"{per_seq / n_recurrent / MiB:.2f} MiB (f32)"
    )


def skipped_bytes(model: Model) -> int:
    """The tensor bytes of the MTP (nextn) blocks, which llama.cpp does not load unless
    MTP speculative decoding is on (TENSOR_SKIP in src/models/<arch>.cpp)."""
    n_layer = int(model.get(f"{model.arch}.block_count", 0) or 0)
    n_next = int(model.get(f"{model.arch}.nextn_predict_layers", 0) or 0)
    if not 0 < n_next <= n_layer:
        return 0
    prefixes = tuple(f"blk.{il}." for il in range(n_layer - n_next, n_layer))
    return sum(t.nbytes or 0 for t in model.tensors if t.name.startswith(prefixes))


def vocab_size(model: Model) -> int:
    tokens = model.get("tokenizer.ggml.tokens")
    if isinstance(tokens, SkippedArray):
        return tokens.length
    if isinstance(tokens, list):
        return len(tokens)
    return int(model.get(f"{model.arch}.vocab_size", 32000))


def compute_bytes(model: Model, s: Settings) -> tuple[int, str]:
    """The graph's peak for one ubatch, as fitted to llama.cpp's own reserve (docs/estimator.md).

    Flash attention on: FFN and residual activations (3 n_ff + 4 n_embd floats per
    token; MoE: at least 2 x experts used x (n_embd + expert n_ff)) plus the f16
    attention mask (cells x tokens). Off: the f32 attention
    scores and mask (cells x tokens x (4 heads + 4) bytes) dominate. Both plus the
    logits of one output per sequence.
    """
    a = model.arch
    shape = layers(model)
    n_ctx, n_seq = context_cells(model, s)
    cells = n_ctx if (s.kv_unified or n_seq == 1) else n_ctx // n_seq
    u = s.n_ubatch
    n_embd = int(_need(model, f"{a}.embedding_length"))
    n_ff_raw = model.get(f"{a}.feed_forward_length", 4 * n_embd) or 4 * n_embd
    n_ff = max(_per_layer(n_ff_raw, shape.n_layer, f"{a}.feed_forward_length"))
    per_token = 3 * n_ff + 4 * n_embd
    experts_used = int(model.get(f"{a}.expert_used_count", 0) or 0)
    if experts_used:
        n_ff_exp = int(model.get(f"{a}.expert_feed_forward_length", n_ff))
        n_ff = max(n_ff, experts_used * n_ff_exp)
        # MoE: a token's up/gate rows and its n_embd output for each expert it uses, live at
        # once (fitted to llama.cpp's CPU reserve on gpt-oss, Qwen3 MoE, Qwen3-Next, GLM-4.5).
        moe = 2 * experts_used * (n_embd + n_ff_exp)
        per_token = max(3 * n_ff + 4 * n_embd, moe)
    logits = vocab_size(model) * n_seq * 4
    if s.flash_attn == "off":
        heads = max(shape.n_head)
        total = cells * u * (4 * heads + 4) + u * 6 * n_embd * 4 + logits
        detail = f"attention scores {heads} heads x {cells} cells x {u} tokens"
    else:
        total = u * per_token * 4 + cells * u * 2 + logits
        detail = f"flash attention; activations {per_token} floats x {u} tokens"
    return total, detail


# Vision projectors (--mmproj, tools/mtmd/clip.cpp). llama-server sizes the encoder's compute
# buffer at load on clip's graph for one warmup image (clip_model_loader::warmup,
# hparams.warmup_image_size): the projector's image_size, except for the encoders of dynamic
# resolution, which warm up on a fixed count of output tokens ("avoid OOM on warmup"):
# clip.projector_type -> (tokens a side, default patch merge, the merge's key).
PROJECTOR_WARMUP: dict[str, tuple[int, int, str]] = {
    "qwen2vl_merger": (46, 2, "clip.vision.spatial_merge_size"),
    "qwen2.5vl_merger": (46, 2, "clip.vision.spatial_merge_size"),
    "qwen3vl_merger": (46, 2, "clip.vision.spatial_merge_size"),
    "glm4v": (46, 2, "clip.vision.spatial_merge_size"),
    "pixtral": (16, 1, "clip.vision.spatial_merge_size"),
}


def _uint(value: Any) -> int:
    """A metadata value as a count (0 when it is not one: a hostile or foreign header)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def projector_compute_bytes(projector: Model, flash_attn: str = "auto") -> tuple[int, str]:
    """The compute buffer clip.cpp reserves for a vision projector at load, fitted to its own
    accounting, mtmd_get_memory_usage (lab/llamacpp.py MMPROJ; docs/estimator.md).

    n patches of the warmup image (PROJECTOR_WARMUP), n_embd E, n_ff F, H heads, f32. With
    flash attention (on, auto): a ViT block's live activations, (3 E + F) a patch, or
    (6 E + 3 F) when the FFN is gated (SwiGLU: up, gate and their product live at once);
    window attention (Qwen2.5-VL's n_wa_pattern) adds its n x n mask as f16. Without: the
    scores of all heads, H n^2, plus 6 E a patch, plus the f32 window mask. 0 when the file
    says no vision encoder (an audio projector) or lacks clip's vision keys.
    """
    get = projector.get
    if get("clip.has_vision_encoder") is not True:
        return 0, ""
    ptype = str(get("clip.projector_type") or get("clip.vision.projector_type") or "")
    image = _uint(get("clip.vision.image_size"))
    patch = _uint(get("clip.vision.patch_size"))
    e = _uint(get("clip.vision.embedding_length"))
    f = _uint(get("clip.vision.feed_forward_length")) or 4 * e
    heads = _uint(get("clip.vision.attention.head_count")) or 1
    if not (patch and e):
        return 0, ""
    warmup = PROJECTOR_WARMUP.get(ptype)
    if warmup:
        side_tokens, merge, key = warmup
        side = side_tokens * (_uint(get(key)) or merge)
    else:
        side = image // patch
    n = side * side
    windows = bool(_uint(get("clip.vision.n_wa_pattern")))
    detail = f"projector {side * patch} px warmup, {n} patches"
    if flash_attn == "off":
        total = heads * n * n * 4 + 6 * e * n * 4 + (n * n * 4 if windows else 0)
        detail += f", attention scores {heads} heads"
    else:
        gated = any(t.name == "v.blk.0.ffn_gate.weight" for t in projector.tensors)
        total = ((6 * e + 3 * f) if gated else (3 * e + f)) * n * 4 + (n * n * 2 if windows else 0)
    if windows:
        detail += ", window mask"
    return total, detail


def estimate(model: Model, s: Settings) -> Estimate:
    if s.n_ctx < 0 or s.n_parallel < 1 or s.n_ubatch < 1:
        # Whatever reached here (a koboldcpp flag, an environment variable): a negative
        # term would make a negative footprint, which every budget admits.
        raise EstimateError(
            f"context {s.n_ctx}, {s.n_parallel} slot(s), ubatch {s.n_ubatch}: not a load"
        )
    skipped = skipped_bytes(model)
    weights = model.tensor_bytes - skipped + s.mmproj_bytes
    kv, kv_detail = kv_bytes(model, s)
    state, state_detail = state_bytes(model, s)
    if state:
        kv += state
        kv_detail += f"; + {state_detail}"
    compute, compute_detail = compute_bytes(model, s)
    if s.mmproj_compute:
        compute += s.mmproj_compute
        compute_detail += f"; + projector {s.mmproj_compute / MiB:.0f} MiB"
    n_vocab = vocab_size(model)
    _, n_seq = context_cells(model, s)
    host = RUNTIME + n_vocab * VOCAB_BYTES + n_vocab * n_seq * 4
    wdetail = f"{len(model.tensors)} tensors in {model.shards} file(s)"
    if skipped:
        wdetail += f", less {skipped / MiB:.0f} MiB of MTP blocks not loaded"
    if s.mmproj_bytes:
        wdetail += " + mmproj"
    terms = (
        Term("weights", weights, True, wdetail),
        Term("kv", kv, True, kv_detail),
        Term("compute", compute, False, compute_detail),
        Term("host", host, False, "CUDA context and runtime, output buffer, vocabulary"),
    )
    margin = max(MARGIN_MIN, int((weights + kv) * MARGIN_EXACT + (compute + host) * MARGIN_SHARE))
    return Estimate(terms, margin, context_cells(model, s)[0])


def with_draft_and_adapters(
    main: Estimate, draft: Estimate | None, draft_name: str, loras: Sequence[tuple[str, int]]
) -> Estimate:
    """The main model's estimate with what else its process loads. A draft model
    (speculative decoding) has a context of its own: its weights, KV cache and compute
    buffer count, as estimate() has them at the draft's settings; its share of the host
    term is its vocabulary and output rows, not a second CUDA context. A LoRA adapter's
    tensors are loaded beside the model (its file's tensor bytes); the matmuls it adds to
    the graph are within the compute term's margin. The margin is taken again over all."""
    terms = list(main.terms)
    if draft is not None:
        by = {t.name: t for t in draft.terms}
        resident = by["weights"].bytes + by["kv"].bytes
        terms.append(
            Term(
                "draft",
                resident,
                True,
                f"{draft_name}: weights {resident - by['kv'].bytes} + KV {by['kv'].bytes} "
                f"at ctx {draft.n_ctx} ({by['kv'].detail})",
            )
        )
        terms.append(
            Term(
                "draft compute",
                by["compute"].bytes + by["host"].bytes - RUNTIME,
                False,
                f"{draft_name}: {by['compute'].detail}; its vocabulary and output rows",
            )
        )
    if loras:
        terms.append(
            Term(
                "lora",
                sum(b for _, b in loras),
                True,
                ", ".join(f"{name} {b / MiB:.0f} MiB" for name, b in loras),
            )
        )
    exact = sum(t.bytes for t in terms if t.exact)
    approximate = sum(t.bytes for t in terms if not t.exact)
    margin = max(MARGIN_MIN, int(exact * MARGIN_EXACT + approximate * MARGIN_SHARE))
    return Estimate(tuple(terms), margin, main.n_ctx)
