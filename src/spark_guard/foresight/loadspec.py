"""What a loader's command line says about its footprint: the model file and the settings.

llama.cpp's llama-server and llama-cli: -m/--model, -c/--ctx-size,
-np/--parallel, -kvu, -ctk/-ctv, -fa, -ub, --swa-full, --mmproj,
--no-mmap/--load-mode, -ngl, and the LLAMA_ARG_* environment variables
(a flag on the command line wins over the variable, as in llama.cpp).
vLLM: --gpu-memory-utilization, a share of the whole memory. Anything
else (Ollama, LM Studio, unknown servers): no spec; the footprint comes from
the config. Pure: argv and environment in, a LoadSpec out.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .estimate import Settings

LLAMA_BINARIES = ("llama-server", "llama-cli", "llama-mtmd-cli", "llama-run", "server")
WRAPPERS = ("env", "nice", "ionice", "taskset", "numactl", "stdbuf", "chrt", "systemd-inhibit")
SHELLS = ("sh", "bash", "dash", "zsh")
_NUMERIC = re.compile(r"^(0x)?[0-9a-fA-F,.:-]+$")
_TAKES_NAME = ("-u", "--unset", "-C", "--chdir")  # env's options whose value is a word

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
}
_LLAMA_ENV = {
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
}
_TRUE = ("on", "true", "1", "enabled", "yes")
_FALSE = ("off", "false", "0", "disabled", "no")
_FA_VALUES = (*_TRUE, *_FALSE, "auto")


class SpecError(ValueError):
    """A flag whose value makes no sense; str() names it."""


@dataclass(frozen=True)
class LoadSpec:
    kind: str  # "llama.cpp" or "vllm"
    binary: str
    model: str | None = None
    mmproj: str | None = None
    settings: Settings = field(default_factory=Settings)
    gpu_fraction: float | None = None  # vLLM: share of the whole memory it takes
    notes: tuple[str, ...] = ()


def _unwrap(argv: Sequence[str]) -> list[str]:
    """The real command behind env/nice/... and `sh -c "exec llama-server ..."`."""
    args = list(argv)
    for _ in range(8):  # wrappers of wrappers, but never forever
        if not args:
            return args
        base = os.path.basename(args[0])
        if base in WRAPPERS:
            # Their options, VAR=value, and numbers (nice -n 5, taskset 0x3, chrt 10).
            args = args[1:]
            while args and (args[0].startswith("-") or "=" in args[0] or _NUMERIC.match(args[0])):
                args = args[2:] if args[0] in _TAKES_NAME else args[1:]
            continue
        if base in SHELLS and "-c" in args[1:]:
            script = args[args.index("-c") + 1] if args.index("-c") + 1 < len(args) else ""
            lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            try:
                words = list(lexer)
            except ValueError:
                return args
            # The first command of the script; `a; b`, `a && b`, `a | b` end it.
            end = next((i for i, w in enumerate(words) if w and set(w) <= set(";&|")), len(words))
            words = words[:end]
            args = words[1:] if words[:1] == ["exec"] else words
            continue
        return args
    return args


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"{flag} {value!r}: not a number") from None


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LoadSpec | None:
    """The spec of a known loader's command line; None for anything else."""
    args = _unwrap(argv)
    if not args:
        return None
    base = os.path.basename(args[0])
    if base in LLAMA_BINARIES:
        return _llama(base, args[1:], env or {})
    if base == "vllm" or (base.startswith("python") and "vllm" in " ".join(args[1:3])):
        return _vllm(base, args)
    return None


def _llama(binary: str, args: list[str], env: Mapping[str, str]) -> LoadSpec:
    values: dict[str, str | bool] = {}
    for var, name in _LLAMA_ENV.items():
        if var in env:
            values[name] = env[var]
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        spec = _LLAMA_FLAGS.get(flag if eq else arg)
        i += 1
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
    return _llama_spec(binary, values)


def _flag_true(value: str | bool) -> bool:
    return value is True or str(value).lower() in _TRUE


def _llama_spec(binary: str, v: Mapping[str, str | bool]) -> LoadSpec:
    notes = []
    s = Settings()
    if "n_ctx" in v:
        s = replace(s, n_ctx=_int("--ctx-size", str(v["n_ctx"])))
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
    return LoadSpec(
        kind="llama.cpp",
        binary=binary,
        model=str(model) if model else None,
        mmproj=str(mmproj) if mmproj else None,
        settings=s,
        notes=tuple(notes),
    )


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


def first_spec(
    command_lines: Iterable[Sequence[str]], env: Mapping[str, str] | None = None
) -> LoadSpec | None:
    """The first command line (ExecStart, then running processes) that is a known loader."""
    for argv in command_lines:
        spec = parse(argv, env)
        if spec is not None:
            return spec
    return None
