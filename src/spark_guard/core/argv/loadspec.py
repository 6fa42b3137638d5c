"""What a loader's command line says about its footprint: the model file and the settings.

llama.cpp's llama-server and llama-cli: -m/--model, -c/--ctx-size,
-np/--parallel, -kvu, -ctk/-ctv, -fa, -ub, --swa-full, --mmproj,
--no-mmap/--load-mode, -ngl, and the LLAMA_ARG_* environment variables
(a flag on the command line wins over the variable, as in llama.cpp).
vLLM: --gpu-memory-utilization, a share of the whole memory. SGLang
(`python -m sglang.launch_server`, `sglang serve`): --model-path/--model,
--mem-fraction-static (a share of the whole memory, as vLLM's), --context-length.
TGI (text-generation-launcher): --model-id, --cuda-memory-fraction,
--max-total-tokens, --max-batch-prefill-tokens, --kv-cache-dtype, and the
environment variables clap reads for them (MODEL_ID, ...; the flag wins), and
TGI_WIGGLE_ROOM, which its model server reads. koboldcpp (`koboldcpp`,
`koboldcpp-linux-*`, `python koboldcpp.py`) and llama-box: llama.cpp inside, so a
LoadSpec of kind "llama.cpp" with each one's own flags and defaults (`rule` says
which of them were defaults). Ollama: ollama.py (the
server's environment, the clients that make it load, manifest -> blob; a
LoadSpec of kind "ollama" there). Anything else (LM Studio, unknown servers):
no spec; the footprint comes from the config. Pure: argv and environment in, a
LoadSpec out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..text import quoted
from .shell import first_command

LLAMA_BINARIES = ("llama-server", "llama-cli", "llama-mtmd-cli", "llama-run", "server")

# flag -> (setting, takes a value); several spellings of one flag share a setting.
_LLAMA_FLAGS: dict[str, tuple[str, bool]] = {
    "-m": ("model", True),
    "--model": ("model", True),
    "-c": ("n_ctx", True),
    "--ctx-size": ("n_ctx", True),
    "-np": ("n_parallel", True),
    "--parallel": ("n_parallel", True),
    "-kvu": ("kv_unified", False),
    "--kv-unified": ("kv_unified", False),
    "-no-kvu": ("no_kv_unified", False),
    "--no-kv-unified": ("no_kv_unified", False),
    "-ctk": ("cache_type_k", True),
    "--cache-type-k": ("cache_type_k", True),
    "-ctv": ("cache_type_v", True),
    "--cache-type-v": ("cache_type_v", True),
    "-fa": ("flash_attn", False),  # a value after it is optional (older builds: bare flag)
    "--flash-attn": ("flash_attn", False),
    "-ub": ("n_ubatch", True),
    "--ubatch-size": ("n_ubatch", True),
    "--swa-full": ("swa_full", False),
    "-mm": ("mmproj", True),
    "--mmproj": ("mmproj", True),
    "--no-mmap": ("no_mmap", False),
    "-lm": ("load_mode", True),
    "--load-mode": ("load_mode", True),
    "-ngl": ("n_gpu_layers", True),
    "--gpu-layers": ("n_gpu_layers", True),
    "--n-gpu-layers": ("n_gpu_layers", True),
    # Speculative decoding's draft model: a second model with a context of its own.
    "-md": ("draft", True),
    "--model-draft": ("draft", True),
    "--spec-draft-model": ("draft", True),
    "-cd": ("n_ctx_draft", True),  # older builds; newer ones give the draft the main -c
    "--ctx-size-draft": ("n_ctx_draft", True),
    "-ctkd": ("cache_type_k_draft", True),
    "--cache-type-k-draft": ("cache_type_k_draft", True),
    "--spec-draft-type-k": ("cache_type_k_draft", True),
    "-ctvd": ("cache_type_v_draft", True),
    "--cache-type-v-draft": ("cache_type_v_draft", True),
    "--spec-draft-type-v": ("cache_type_v_draft", True),
    "-ngld": ("n_gpu_layers_draft", True),
    "--gpu-layers-draft": ("n_gpu_layers_draft", True),
    "--n-gpu-layers-draft": ("n_gpu_layers_draft", True),
    "--spec-draft-ngl": ("n_gpu_layers_draft", True),
}
# LoRA adapters: each flag may be given again, and takes a comma-separated list
# (`--lora-scaled` FNAME:SCALE items).
_LORA_FLAGS = {"--lora": False, "--lora-scaled": True}
LORA_MAX = 64  # adapters read for one loader: more is an error, not a queue of reads
LLAMA_ENV = {
    "LLAMA_ARG_MODEL": "model",
    "LLAMA_ARG_CTX_SIZE": "n_ctx",
    "LLAMA_ARG_N_PARALLEL": "n_parallel",
    "LLAMA_ARG_KV_UNIFIED": "kv_unified",
    "LLAMA_ARG_CACHE_TYPE_K": "cache_type_k",
    "LLAMA_ARG_CACHE_TYPE_V": "cache_type_v",
    "LLAMA_ARG_FLASH_ATTN": "flash_attn",
    "LLAMA_ARG_UBATCH": "n_ubatch",
    "LLAMA_ARG_SWA_FULL": "swa_full",
    "LLAMA_ARG_MMPROJ": "mmproj",
    "LLAMA_ARG_NO_MMAP": "no_mmap",
    "LLAMA_ARG_LOAD_MODE": "load_mode",
    "LLAMA_ARG_N_GPU_LAYERS": "n_gpu_layers",
    "LLAMA_ARG_SPEC_DRAFT_MODEL": "draft",
    "LLAMA_ARG_MODEL_DRAFT": "draft",
    "LLAMA_ARG_CTX_SIZE_DRAFT": "n_ctx_draft",
    "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K": "cache_type_k_draft",
    "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V": "cache_type_v_draft",
    "LLAMA_ARG_N_GPU_LAYERS_DRAFT": "n_gpu_layers_draft",
}
_TRUE = ("on", "true", "1", "enabled", "yes")
_FALSE = ("off", "false", "0", "disabled", "no")
_FA_VALUES = (*_TRUE, *_FALSE, "auto")


@dataclass(frozen=True)
class Settings:
    """The load settings that decide the footprint (llama-server's flags)."""

    n_ctx: int = 0  # 0: the trained context
    n_parallel: int = 1
    kv_unified: bool = False
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"  # on, off, auto (on where the backend has it: CUDA does)
    n_ubatch: int = 512
    swa_full: bool = False
    mmproj_bytes: int = 0
    mmproj_compute: int = 0  # the projector's compute buffer (projector_compute_bytes)
    no_mmap: bool = False
    n_gpu_layers: int | None = None


class SpecError(ValueError):
    """A flag whose value makes no sense; str() names it."""


@dataclass(frozen=True)
class LoadSpec:
    kind: str  # "llama.cpp", "vllm", "sglang" or "tgi"
    binary: str
    model: str | None = None  # llama.cpp: the GGUF file; sglang, tgi: a directory or a Hub id
    mmproj: str | None = None
    settings: Settings = field(default_factory=Settings)
    # vLLM, SGLang, TGI: the share of the whole memory the server fills (None: SGLang's own
    # default, which depends on the memory, so predict.py works it out); `rule` says whence.
    gpu_fraction: float | None = None
    rule: str = ""
    # TGI: --max-total-tokens (one request) and --max-batch-prefill-tokens (its warmup
    # batch): it must hold the KV cache of the larger at least; the KV cache's bytes a value.
    max_total_tokens: int | None = None
    prefill_tokens: int | None = None
    kv_bytes: int = 2
    notes: tuple[str, ...] = ()
    # llama.cpp: speculative decoding's draft model (-md) and the settings of its own
    # context; LoRA adapters (--lora, --lora-scaled), their tensors loaded beside the model.
    draft: str | None = None
    draft_settings: Settings | None = None
    loras: tuple[str, ...] = ()


def _size(flag: str, value: str) -> int:
    """A context size: a whole number, 0 or more (a negative one made a negative
    footprint, which every budget admits)."""
    n = _int(flag, value)
    if n < 0:
        raise SpecError(f"{flag} {value!r}: a size cannot be negative")
    return n


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"{flag} {value!r}: not a number") from None


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LoadSpec | None:
    """The spec of a known loader's command line; None for anything else."""
    args = first_command(argv)
    if not args:
        return None
    base = os.path.basename(args[0])
    if base in LLAMA_BINARIES:
        return _llama(base, args[1:], env or {})
    if base == LLAMA_BOX:
        return _llama_box(base, args[1:])
    kobold = _koboldcpp_args(base, args)
    if kobold is not None:
        return _koboldcpp(kobold)
    if _is_sglang(base, args):
        return _sglang(base, args[1:])
    if base == TGI_BINARY:
        return _tgi(base, args[1:], env or {})
    if base == "vllm" or (base.startswith("python") and "vllm" in " ".join(args[1:3])):
        return _vllm(base, args)
    return None


def _llama(binary: str, args: list[str], env: Mapping[str, str]) -> LoadSpec:
    values: dict[str, str | bool] = {}
    for var, name in LLAMA_ENV.items():
        if var in env:
            values[name] = env[var]
    loras: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        spec = _LLAMA_FLAGS.get(flag if eq else arg)
        i += 1
        lora = _LORA_FLAGS.get(flag if eq else arg)
        if lora is not None:
            if not eq and i >= len(args):
                raise SpecError(f"{arg} needs a value")
            raw = inline if eq else args[i]
            i += 0 if eq else 1
            for item in raw.split(","):
                path = item.rpartition(":")[0] if lora else item
                if not path:
                    raise SpecError(f"{flag} {item!r}: not FNAME:SCALE")
                loras.append(path)
            if len(loras) > LORA_MAX:
                raise SpecError(f"more than {LORA_MAX} LoRA adapters")
            continue
        if spec is None:
            continue
        name, takes = spec
        if eq:
            values[name] = inline
        elif takes:
            if i >= len(args):
                raise SpecError(f"{arg} needs a value")
            values[name] = args[i]
            i += 1
        elif name == "flash_attn" and i < len(args) and args[i].lower() in _FA_VALUES:
            values[name] = args[i]
            i += 1
        else:
            values[name] = True
    return replace(_llama_spec(binary, values), loras=tuple(loras))


def _flag_true(value: str | bool) -> bool:
    return value is True or str(value).lower() in _TRUE


def _llama_spec(binary: str, v: Mapping[str, str | bool]) -> LoadSpec:
    notes = []
    s = Settings()
    if "n_ctx" in v:
        s = replace(s, n_ctx=_size("--ctx-size", str(v["n_ctx"])))
    server = binary in ("llama-server", "server")
    if "n_parallel" in v and _int("--parallel", str(v["n_parallel"])) != -1:
        s = replace(s, n_parallel=max(1, _int("--parallel", str(v["n_parallel"]))))
    elif server:
        # llama-server's default: 4 slots sharing one unified cache.
        s = replace(s, n_parallel=4, kv_unified=True)
    if "kv_unified" in v:
        s = replace(s, kv_unified=_flag_true(v["kv_unified"]))
    if v.get("no_kv_unified"):
        s = replace(s, kv_unified=False)
    if "cache_type_k" in v:
        s = replace(s, cache_type_k=str(v["cache_type_k"]).lower())
    if "cache_type_v" in v:
        s = replace(s, cache_type_v=str(v["cache_type_v"]).lower())
    if "flash_attn" in v:
        fa = v["flash_attn"]
        s = replace(
            s, flash_attn="on" if _flag_true(fa) else "off" if str(fa).lower() in _FALSE else "auto"
        )
    if "n_ubatch" in v:
        s = replace(s, n_ubatch=max(1, _int("--ubatch-size", str(v["n_ubatch"]))))
    if "swa_full" in v:
        s = replace(s, swa_full=_flag_true(v["swa_full"]))
    no_mmap = _flag_true(v["no_mmap"]) if "no_mmap" in v else False
    if str(v.get("load_mode", "")) in ("none", "mlock", "dio"):
        no_mmap = True
    if no_mmap:
        s = replace(s, no_mmap=True)
        notes.append("weights read, not mapped: counted once, as on any unified-memory load")
    if "n_gpu_layers" in v:
        ngl = str(v["n_gpu_layers"])
        if ngl not in ("auto", "all"):
            s = replace(s, n_gpu_layers=_int("--n-gpu-layers", ngl))
        notes.append(f"-ngl {ngl}: one memory pool, so the total does not depend on it")
    model = v.get("model")
    mmproj = v.get("mmproj")
    draft = v.get("draft")
    return LoadSpec(
        kind="llama.cpp",
        binary=binary,
        model=str(model) if model else None,
        mmproj=str(mmproj) if mmproj else None,
        settings=s,
        notes=tuple(notes),
        draft=str(draft) if draft else None,
        draft_settings=_draft_settings(s, v) if draft else None,
    )


def _draft_settings(main: Settings, v: Mapping[str, str | bool]) -> Settings:
    """The draft's context, as llama.cpp makes it (common_base_params_to_speculative): the
    main context's settings (its -c, slots, ubatch, flash attention), with the draft's own
    KV cache types (f16 unless -ctkd/-ctvd say) and no projector; -cd, where a build has
    it, its own context size."""
    s = replace(
        main,
        cache_type_k=str(v.get("cache_type_k_draft", "f16")).lower(),
        cache_type_v=str(v.get("cache_type_v_draft", "f16")).lower(),
        mmproj_bytes=0,
        mmproj_compute=0,
    )
    if "n_ctx_draft" in v:
        n_ctx = _size("--ctx-size-draft", str(v["n_ctx_draft"]))
        if n_ctx:  # 0: as the main context
            s = replace(s, n_ctx=n_ctx)
    if "n_gpu_layers_draft" in v:
        ngl = str(v["n_gpu_layers_draft"])
        s = replace(s, n_gpu_layers=None if ngl in ("auto", "all") else _int("-ngld", ngl))
    return s


def _vllm(binary: str, args: list[str]) -> LoadSpec:
    fraction = 0.9  # vLLM's default --gpu-memory-utilization
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag == "--gpu-memory-utilization":
            raw = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                fraction = float(raw)
            except ValueError:
                raise SpecError(f"--gpu-memory-utilization {raw!r}: not a number") from None
            if not 0 < fraction <= 1:
                raise SpecError(f"--gpu-memory-utilization {raw}: must be in (0, 1]")
    return LoadSpec(kind="vllm", binary=binary, gpu_fraction=fraction)


# --- SGLang and TGI ------------------------------------------------------------------------

TGI_BINARY = "text-generation-launcher"
TGI_WIGGLE_ROOM = 0.90  # its model server's default (TGI_WIGGLE_ROOM, models/globals.py)
MAX_TOKENS = 1 << 32  # a token count past any context length

# flag -> setting: the last one given wins (argparse; clap refuses a repeat, so no unit runs).
_SGLANG_FLAGS = {
    "--model-path": "model",
    "--model": "model",  # an alias since 2025
    "--mem-fraction-static": "fraction",
    "--context-length": "context",
}
_TGI_FLAGS = {
    "--model-id": "model",
    "--cuda-memory-fraction": "fraction",
    "--max-total-tokens": "total_tokens",
    "--max-batch-prefill-tokens": "prefill_tokens",
    "--kv-cache-dtype": "kv_cache_dtype",
}
# clap's `env` attribute: each flag also reads the variable of its name in capitals.
TGI_ENV = {
    "MODEL_ID": "model",
    "CUDA_MEMORY_FRACTION": "fraction",
    "MAX_TOTAL_TOKENS": "total_tokens",
    "MAX_BATCH_PREFILL_TOKENS": "prefill_tokens",
    "KV_CACHE_DTYPE": "kv_cache_dtype",
}
_TGI_KV_DTYPES = ("fp8", "fp8_e4m3fn", "fp8_e5m2")
TGI_PREFILL_DEFAULT = 4096  # the launcher's --max-batch-prefill-tokens, before the model's cap


def _is_sglang(base: str, args: Sequence[str]) -> bool:
    """`sglang serve ...` (its entry point), or `python -m sglang.launch_server ...`."""
    if base == "sglang":
        return args[1:2] == ["serve"] or any(a.partition("=")[0] in _SGLANG_FLAGS for a in args)
    if not base.startswith("python"):
        return False
    for i, arg in enumerate(args[1:4], 1):  # python3 [-u] [-X ...] -m sglang.launch_server
        if arg == "-m":
            return i + 1 < len(args) and args[i + 1].split(".", 1)[0] == "sglang"
    return False


def _flags(args: Sequence[str], table: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """setting -> (flag as given, value), for the flags in `table`, in both spellings."""
    values: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        i += 1
        name = table.get(flag)
        if name is None:
            continue
        if eq:
            values[name] = (flag, inline)
        elif i < len(args):
            values[name] = (flag, args[i])
            i += 1
        else:
            raise SpecError(f"{flag} needs a value")
    return values


def _fraction(flag: str, raw: str, *, below_one: bool = False) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SpecError(f"{flag} {quoted(raw)}: not a number") from None
    # Also refuses nan and inf: every comparison with nan is false.
    if not (0 < value < 1 if below_one else 0 < value <= 1):
        raise SpecError(f"{flag} {quoted(raw)}: must be in (0, 1{')' if below_one else ']'}")
    return value


def _tokens(flag: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:  # also an integer of more digits than Python converts
        raise SpecError(f"{flag} {quoted(raw)}: not a number") from None
    if not 0 < value <= MAX_TOKENS:
        raise SpecError(f"{flag} {quoted(raw)}: must be in [1, {MAX_TOKENS}]")
    return value


def _sglang(binary: str, args: list[str]) -> LoadSpec:
    v = _flags(args, _SGLANG_FLAGS)
    notes = []
    fraction = _fraction(*v["fraction"]) if "fraction" in v else None
    if "context" in v:
        flag, raw = v["context"]
        notes.append(
            f"{flag} {_tokens(flag, raw)}: a limit per request; the KV pool fills the share"
        )
    model = v["model"][1] if "model" in v else None
    rule = f"{v['fraction'][0]} {fraction:g}" if fraction is not None else ""
    return LoadSpec(
        kind="sglang",
        binary=binary,
        model=model or None,
        gpu_fraction=fraction,
        rule=rule,
        notes=tuple(notes),
    )


def _tgi(binary: str, args: list[str], env: Mapping[str, str]) -> LoadSpec:
    """TGI's launcher. Its model server sizes the KV cache from what is free, up to
    TGI_WIGGLE_ROOM x --cuda-memory-fraction of the device (flash_causal_lm.py, warmup):
    on unified memory that share of the whole pool, whatever --max-total-tokens says."""
    v = {name: (var, env[var]) for var, name in TGI_ENV.items() if var in env}
    v.update(_flags(args, _TGI_FLAGS))
    fraction = _fraction(*v["fraction"]) if "fraction" in v else 1.0  # the launcher's default
    wiggle = TGI_WIGGLE_ROOM
    if "TGI_WIGGLE_ROOM" in env:
        wiggle = _fraction("TGI_WIGGLE_ROOM", env["TGI_WIGGLE_ROOM"], below_one=True)
    total = _tokens(*v["total_tokens"]) if "total_tokens" in v else None
    prefill = _tokens(*v["prefill_tokens"]) if "prefill_tokens" in v else None
    kv_bytes = 2  # TGI computes and caches in 16 bits (--dtype float16 or bfloat16)
    if "kv_cache_dtype" in v:
        flag, raw = v["kv_cache_dtype"]
        if raw.lower() not in _TGI_KV_DTYPES:
            raise SpecError(f"{flag} {quoted(raw)}: not one of {', '.join(_TGI_KV_DTYPES)}")
        kv_bytes = 1
    flag = v["fraction"][0] if "fraction" in v else "--cuda-memory-fraction"
    model = v["model"][1] if "model" in v else None
    return LoadSpec(
        kind="tgi",
        binary=binary,
        model=model or None,
        gpu_fraction=wiggle * fraction,
        rule=f"{wiggle:g} (TGI_WIGGLE_ROOM) x {flag} {fraction:g}",
        max_total_tokens=total,
        prefill_tokens=prefill,
        kv_bytes=kv_bytes,
    )


# --- koboldcpp and llama-box: llama.cpp inside, flags and defaults of their own -------------

# llama.cpp's cache types (common/arg.cpp kv_cache_types), which both accept.
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def _scan(args: Sequence[str], table: Mapping[str, tuple[str, bool]]) -> dict[str, tuple[str, str]]:
    """setting -> (flag as given, value; "" for a flag without one), for the flags in
    `table` (flag -> (setting, takes a value)); `--flag=value` too; the last one wins."""
    values: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        i += 1
        spec = table.get(flag if eq else arg)
        if spec is None:
            continue
        name, takes = spec
        if eq:
            values[name] = (flag, inline)
        elif not takes:
            values[name] = (arg, "")
        elif i < len(args):
            values[name] = (arg, args[i])
            i += 1
        else:
            raise SpecError(f"{arg} needs a value")
    return values


def _bounded(flag: str, raw: str, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:  # also an integer of more digits than Python converts
        raise SpecError(f"{flag} {quoted(raw)}: not a number") from None
    if not low <= value <= high:
        raise SpecError(f"{flag} {quoted(raw)}: must be in [{low}, {high}]")
    return value


def _value(v: Mapping[str, tuple[str, str]], name: str) -> str | None:
    return v[name][1] or None if name in v else None


def _cache_type(flag: str, raw: str) -> str:
    if raw.lower() not in CACHE_TYPES:
        raise SpecError(f"{flag} {quoted(raw)}: not one of {', '.join(CACHE_TYPES)}")
    return raw.lower()


# llama-box (gpustack/llama-box, llama-box/engine_param.hpp and httpserver.hpp, v0.0.1xx,
# Nov 2025): llama-server's flags, its own parser (no LLAMA_ARG_* variables), and its own
# defaults: -c 4096 (README: "default: 4096, 0 = loaded from model"); flash attention off
# unless -fa (a bare flag; --no-flash-attn turns it off); one KV cache per sequence unless
# -kvu; a quantized V cache without flash attention is reset to f16 (its context patch).
# Its sequences are --threads-http (-np/--parallel are its deprecated spellings), which
# defaults to --threads, and that to the CPU's cores, at most 64; the context is split
# among them, as llama-server's -np does.
LLAMA_BOX = "llama-box"
LLAMA_BOX_CTX = 4096
LLAMA_BOX_MAX_HTTP = 64
_LLAMA_BOX_FLAGS: dict[str, tuple[str, bool]] = {
    "-m": ("model", True),
    "--model": ("model", True),
    "-c": ("n_ctx", True),
    "--ctx-size": ("n_ctx", True),
    "-np": ("slots", True),
    "--parallel": ("slots", True),
    "--threads-http": ("slots", True),
    "-t": ("threads", True),
    "--threads": ("threads", True),
    "-kvu": ("kv_unified", False),
    "--kv-unified": ("kv_unified", False),
    "-ctk": ("cache_type_k", True),
    "--cache-type-k": ("cache_type_k", True),
    "-ctv": ("cache_type_v", True),
    "--cache-type-v": ("cache_type_v", True),
    "-fa": ("flash_attn", False),
    "--flash-attn": ("flash_attn", False),
    "--no-flash-attn": ("flash_attn", False),
    "-ub": ("n_ubatch", True),
    "--ubatch-size": ("n_ubatch", True),
    "--swa-full": ("swa_full", False),
    "--mmproj": ("mmproj", True),
    "-ngl": ("n_gpu_layers", True),
    "--gpu-layers": ("n_gpu_layers", True),
    "--n-gpu-layers": ("n_gpu_layers", True),
}


def _cpus() -> int:
    """The CPUs of this machine: llama-box's default --threads is its physical cores, never
    more; counted as every CPU, so the sequences are never fewer than it makes."""
    return os.cpu_count() or 1


def _llama_box(binary: str, args: list[str]) -> LoadSpec:
    v = _scan(args, _LLAMA_BOX_FLAGS)
    said: list[str] = []
    if "n_ctx" in v:
        n_ctx = _bounded(*v["n_ctx"], 0, MAX_TOKENS)
    else:
        n_ctx = LLAMA_BOX_CTX
        said.append(f"ctx {LLAMA_BOX_CTX} (llama-box's default)")
    slots = _bounded(*v["slots"], -1, MAX_TOKENS) if "slots" in v else -1
    if slots == 0:
        raise SpecError(f"{v['slots'][0]} 0: must be positive, or -1 for its default")
    if slots < 0:  # its default: --threads, else the cores
        threads = _bounded(*v["threads"], -1, MAX_TOKENS) if "threads" in v else -1
        slots = min(threads if threads > 0 else _cpus(), LLAMA_BOX_MAX_HTTP)
        whence = f"{v['threads'][0]} {threads}" if threads > 0 else "one per CPU, at most 64"
        said.append(f"{slots} sequences (llama-box's default: {whence})")
    slots = min(slots, LLAMA_BOX_MAX_HTTP)
    flash = "on" if "flash_attn" in v and v["flash_attn"][0] != "--no-flash-attn" else "off"
    if "flash_attn" not in v:
        said.append("flash attention off (its default)")
    k = _cache_type(*v["cache_type_k"]) if "cache_type_k" in v else "f16"
    cv = _cache_type(*v["cache_type_v"]) if "cache_type_v" in v else "f16"
    if flash == "off" and cv not in ("f32", "f16", "bf16"):
        said.append(f"V cache {cv} without flash attention: f16, as llama-box resets it")
        cv = "f16"
    s = Settings(
        n_ctx=n_ctx,
        n_parallel=slots,
        kv_unified="kv_unified" in v,
        cache_type_k=k,
        cache_type_v=cv,
        flash_attn=flash,
        n_ubatch=_bounded(*v["n_ubatch"], 1, MAX_TOKENS) if "n_ubatch" in v else 512,
        swa_full="swa_full" in v,
    )
    notes = []
    if "n_gpu_layers" in v:
        notes.append(
            f"-ngl {v['n_gpu_layers'][1]}: one memory pool, so the total does not depend on it"
        )
    return LoadSpec(
        kind="llama.cpp",
        binary=binary,
        model=_value(v, "model"),
        mmproj=_value(v, "mmproj"),
        settings=s,
        rule="; ".join(said),
        notes=tuple(notes),
    )


# koboldcpp (LostRuins/koboldcpp, koboldcpp.py's argparse and gpttype_adapter.cpp, 2026):
# --contextsize (-c, --ctx-size) defaults to 8192 ("(default 8192)", check_range 256..262144;
# it was 4096 up to 1.8x and 2048 before 1.6x: the current default is also the largest), and
# the context it makes is that plus 128 (extra_context_handle_fragmentation); one unified
# cache, one sequence unless --continuous-batching N (N + 1); flash attention on unless
# --noflashattention (--flashattention is kept as a no-op; before 1.9x it was off unless
# given); --quantkv f16|bf16|q8_0|q5_1|q4_0 or the old 0 (f16), 1 (q8_0), 2 (q4_0), 3
# (bf16), V only with flash attention; --batchsize (--blasbatchsize, -b) is both batch and
# ubatch, 16 when <= 0; the full sliding-window cache unless --useswa.
KOBOLDCPP_CTX = 8192
KOBOLDCPP_CTX_EXTRA = 128
KOBOLDCPP_CTX_RANGE = (256, 262144)
KOBOLDCPP_BATCHES = (-1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_KOBOLDCPP_QUANTKV = {
    "0": "f16",
    "f16": "f16",
    "1": "q8_0",
    "q8_0": "q8_0",
    "2": "q4_0",
    "q4_0": "q4_0",
    "3": "bf16",
    "bf16": "bf16",
    "q5_1": "q5_1",
}
_KOBOLDCPP_FLAGS: dict[str, tuple[str, bool]] = {
    "--model": ("model", True),
    "-m": ("model", True),
    "--contextsize": ("n_ctx", True),
    "--ctx-size": ("n_ctx", True),
    "-c": ("n_ctx", True),
    "--flashattention": ("flash_on", False),
    "--flash-attn": ("flash_on", False),
    "-fa": ("flash_on", False),
    "--noflashattention": ("flash_off", False),
    "--no-flash-attn": ("flash_off", False),
    "-nofa": ("flash_off", False),
    "--quantkv": ("quantkv", True),
    "--batchsize": ("batch", True),
    "--blasbatchsize": ("batch", True),
    "--batch-size": ("batch", True),
    "-b": ("batch", True),
    "--continuous-batching": ("slots", True),
    "--contbatch": ("slots", True),
    "--useswa": ("useswa", False),
    "--mmproj": ("mmproj", True),
    "--gpulayers": ("n_gpu_layers", True),
    "--gpu-layers": ("n_gpu_layers", True),
    "--n-gpu-layers": ("n_gpu_layers", True),
    "-ngl": ("n_gpu_layers", True),
    "--config": ("config", True),
}
# Its options whose value is a file that could end in .gguf (never the positional model).
_KOBOLDCPP_FILES = (
    "--draftmodel",
    "--model-draft",
    "-md",
    "--lora",
    "--sdmodel",
    "--embeddingsmodel",
    "--ttsmodel",
    "--ttswavtokenizer",
    "--whispermodel",
    "--musicllm",
    "--musicembeddings",
    "--analyze",
)


def _koboldcpp_args(base: str, args: Sequence[str]) -> list[str] | None:
    """koboldcpp's arguments, after `koboldcpp`, `koboldcpp-linux-x64-cuda1210` (its release
    binaries) or `python3 [-u] /opt/koboldcpp/koboldcpp.py`; None for anything else."""
    if base == "koboldcpp" or base.startswith("koboldcpp-linux-") or base == "koboldcpp.py":
        return list(args[1:])
    if base.startswith("python"):
        for i, arg in enumerate(args[1:4], 1):
            if os.path.basename(arg) == "koboldcpp.py":
                return list(args[i + 1 :])
            if not arg.startswith("-"):
                return None
    return None


def _koboldcpp_model(args: Sequence[str]) -> str | None:
    """The positional model (argparse's model_param): the first word that no option takes,
    when it comes first or names a .gguf (after an option of its own it is that option's)."""
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("-"):
            spec = _KOBOLDCPP_FLAGS.get(arg)
            if (spec is not None and spec[1]) or arg in _KOBOLDCPP_FILES:
                i += 1  # its value
            elif (
                spec is None
                and i < len(args)
                and not args[i].startswith("-")
                and not args[i].lower().endswith(".gguf")
            ):
                i += 1  # an option of its own, with a value
            continue
        return arg
    return None


def _koboldcpp(args: list[str]) -> LoadSpec:
    binary = "koboldcpp"
    v = _scan(args, _KOBOLDCPP_FLAGS)
    if "config" in v:
        raise SpecError(
            f"{v['config'][0]} {quoted(v['config'][1])}: settings in a .kcpps file are not "
            "read; give the size in [loaders.footprint]"
        )
    said: list[str] = []
    if "n_ctx" in v:
        ctx = _bounded(*v["n_ctx"], *KOBOLDCPP_CTX_RANGE)
    else:
        ctx = KOBOLDCPP_CTX
        said.append(f"--contextsize {KOBOLDCPP_CTX} (koboldcpp's default)")
    slots = _bounded(*v["slots"], 0, 64) if "slots" in v else 0
    flash = "off" if "flash_off" in v else "on"
    if "flash_on" not in v and "flash_off" not in v:
        said.append("flash attention on (its default)")
    cache = "f16"
    if "quantkv" in v:
        flag, raw = v["quantkv"]
        if raw.lower() not in _KOBOLDCPP_QUANTKV:
            raise SpecError(f"{flag} {quoted(raw)}: not one of {', '.join(_KOBOLDCPP_QUANTKV)}")
        cache = _KOBOLDCPP_QUANTKV[raw.lower()]
    batch = 512
    if "batch" in v:
        flag, raw = v["batch"]
        batch = _bounded(flag, raw, -1, 4096)
        if batch not in KOBOLDCPP_BATCHES:
            raise SpecError(f"{flag} {batch}: not one of {', '.join(map(str, KOBOLDCPP_BATCHES))}")
    ubatch = batch if batch > 0 else 16
    s = Settings(
        n_ctx=ctx + KOBOLDCPP_CTX_EXTRA,
        n_parallel=slots + 1 if slots > 0 else 1,
        kv_unified=True,
        cache_type_k=cache,
        cache_type_v=cache if flash == "on" or cache == "bf16" else "f16",
        flash_attn=flash,
        n_ubatch=ubatch,
        swa_full="useswa" not in v,
    )
    said.append(f"+ {KOBOLDCPP_CTX_EXTRA} cells koboldcpp adds")
    notes = []
    if "n_gpu_layers" in v:
        ngl = v["n_gpu_layers"][1]
        notes.append(f"--gpulayers {ngl}: one memory pool, so the total does not depend on it")
    model = v["model"][1] if "model" in v else _koboldcpp_model(args)
    return LoadSpec(
        kind="llama.cpp",
        binary=binary,
        model=model or None,
        mmproj=_value(v, "mmproj"),
        settings=s,
        rule="; ".join(said),
        notes=tuple(notes),
    )


def first_spec(
    command_lines: Iterable[Sequence[str]], env: Mapping[str, str] | None = None
) -> LoadSpec | None:
    """The first command line (ExecStart, then running processes) that is a known loader."""
    for argv in command_lines:
        spec = parse(argv, env)
        if spec is not None:
            return spec
    return None
