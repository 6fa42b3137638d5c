"""Ollama: the model's files, and what a load will hold.

Ollama's server loads a model only when a client asks, into its own process.
Reading the server's settings and the clients' command lines is
core/argv/ollama.py's (server_settings, client_load, serves, parse_reference);
this module reads what they name:

- `read(manifest_path, deadline=, cache=)`: the manifest JSON (bounded), its
  layers' digests (`sha256:` + 64 hex, checked), the model layer's blob (a
  GGUF, read by gguf.read_model: header only, bounded), the projector's
  (a vision GGUF, as --mmproj) and the params blobs (JSON; num_ctx, num_batch).
  Files are opened O_NONBLOCK and must be regular (safefs.read_regular, the
  GGUF reader's open); symlinks are followed, so the caller decides whose
  rights the opens run with: `predict()` has the Predictor's reading thread
  run it (Predictor.run) with the owner's rights, within the read deadline,
  as a GGUF header is read.

The footprint (`footprint()`) is llama.cpp's estimate (estimate.py) with the
settings Ollama passes to its runner (since 0.30 llama-server itself:
`-c num_ctx*np -np np -ctk/-ctv T --flash-attn on|off|auto -b/-ub B --mmproj P`,
llm/llama_server.go):

- num_ctx: the request's options.num_ctx, else the params blob's, else
  OLLAMA_CONTEXT_LENGTH, else Ollama's default by the GPU memory
  (DEFAULT_CONTEXT); at least 4 (2048 for a vision model), at most the
  model's trained context;
- np: OLLAMA_NUM_PARALLEL (default 1), but 1 for embedding models and the
  architectures Ollama runs with one sequence (SINGLE_SEQUENCE);
- KV cache: OLLAMA_KV_CACHE_TYPE; a quantized type counts only with
  OLLAMA_FLASH_ATTENTION on (Ollama before 0.30 drops it otherwise; f16 is
  the larger figure, so never under what either does);
- ubatch: the request's or params' num_batch, else Ollama's automatic batch
  by the context (512, 1024 past 4096, 2048 past 32768 cells; Ollama lowers
  it only when memory is short, so this is the most it takes).

For the lead, from the spine:

    server = argv.ollama.server_settings(argv, env, home=home)   # OllamaServer | None
    load = argv.ollama.client_load(argv, env)                    # OllamaLoad | None
    argv.ollama.serves(server, load)                        # that client, that server?
    prediction = ollama.predict(predictor, server, load, mem_total, owner=uid, wait=False)

`owner`: the uid whose rights read the files (the server unit's owner: its
models). The footprint belongs to the server's unit. OllamaError (a
loadspec.SpecError) names the variable or field for values that make no
load (a bad model name, a body that is not JSON, a relative OLLAMA_MODELS).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.argv.loadspec import LoadSpec, Settings
from ..core.argv.ollama import (
    OllamaError,
    OllamaLoad,
    OllamaServer,
    blob_name,
    default_context,
    int_option,
    parse_reference,
    strict_json,
)
from ..core.quantities import format_size
from ..core.text import quoted
from ..system.safefs import UnsafePath, read_regular
from .estimate import CACHE_TYPES, Estimate, EstimateError, estimate, projector_compute_bytes
from .gguf import READ_SECONDS, HeaderCache, Model, read_model
from .modelfile import ModelFileError, ModelOpenError, ModelTimeout
from .predict import PENDING, Prediction, Predictor

GiB = 1 << 30

# --- what Ollama does by default (ollama/ollama main, 2026-08, v0.33.0-rc2: envconfig/, server/) -

MIN_CONTEXT = 4  # sched.go getRunner: num_ctx < 4 -> 4
VISION_MIN_CONTEXT = 2048  # ... and "multimodal models require at least 2048 context"
MODELS_PER_GPU = 3  # sched.go defaultModelsPerGPU: OLLAMA_MAX_LOADED_MODELS 0 is 3 per GPU
# sched.go load: "Some architectures are not safe with num_parallel > 1".
SINGLE_SEQUENCE = (
    "mllama",
    "qwen3vl",
    "qwen3vlmoe",
    "qwen35",
    "qwen35moe",
    "qwen3next",
    "lfm2",
    "lfm2moe",
    "nemotron_h",
    "nemotron_h_moe",
    "nemotron_h_omni",
)
# sched.go generationBatchForContext: llama-server's -b/-ub when no num_batch is given, by
# the whole context (num_ctx x np); lowered to 512 when the memory is short. Without flash
# attention on CUDA: 512 (256 on a GPU of at most 8 GiB).
BATCH_DEFAULT, BATCH_MEDIUM, BATCH_LARGE = 512, 1024, 2048
EMBED_BATCH = 2048  # llm.DefaultEmbeddingNumBatch, at most the context
KV_QUANTIZED_OLD = ("q8_0", "q4_0")  # fs/ggml SupportsKVCacheType before v0.30

MEDIA_MODEL = "application/vnd.ollama.image.model"
MEDIA_PROJECTOR = "application/vnd.ollama.image.projector"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_DRAFT = "application/vnd.ollama.image.draft"

# --- caps on what users write -------------------------------------------------------------

MAX_MANIFEST = 256 << 10  # real manifests: under 2 kB (a config and 2-8 layers)
MAX_LAYERS = 1024
MAX_PARAMS = 64 << 10  # a params blob: a few hundred bytes (stop words, temperature)
MAX_PARAMS_LAYERS = 16


class OllamaFileError(ModelFileError):
    """A manifest or params blob that is not a sound one: 'FILE: problem'. A ModelFileError, so
    the Predictor's reader answers it as it answers any bad model file."""


# --- the server ---------------------------------------------------------------------------


# --- the clients --------------------------------------------------------------------------


# --- model references and files -----------------------------------------------------------


@dataclass(frozen=True)
class OllamaModel:
    """What a manifest names, read: the model's GGUF, its projector, its params."""

    manifest: str
    model_path: str
    model: Model
    projector_path: str | None = None
    projector: Model | None = None
    options: Mapping[str, int] = field(default_factory=dict)  # num_ctx, num_batch from params
    notes: tuple[str, ...] = ()
    cost: int = field(default=0, compare=False)


def _models_of(manifest_path: str) -> str:
    """The models directory of manifests/<host>/<namespace>/<model>/<tag>."""
    up = manifest_path
    for _ in range(4):
        up = os.path.dirname(up)
    if os.path.basename(up) != "manifests":
        raise OllamaFileError(f"{manifest_path}: not under a models directory's manifests/")
    return os.path.dirname(up)


def _read_json(path: str, limit: int, what: str) -> Any:
    try:
        data = read_regular(path, limit + 1)
    except UnsafePath:
        raise OllamaFileError(f"{path}: not a regular file") from None
    except OSError as e:
        raise ModelOpenError(path, e) from None
    if len(data) > limit:
        raise OllamaFileError(f"{path}: {what} over {limit} bytes")
    try:
        return strict_json(data)
    except (ValueError, RecursionError):
        raise OllamaFileError(f"{path}: {what} is not JSON") from None


def _tick(path: str, deadline: float) -> None:
    if time.monotonic() > deadline:
        raise ModelTimeout(f"{path}: model read past its deadline")


def read(
    manifest_path: str, *, deadline: float | None = None, cache: HeaderCache | None = None
) -> OllamaModel:
    """The manifest and what it names, with the caller's file rights; a ModelFileError (an
    OllamaFileError, ModelOpenError, ModelTimeout) for the first problem, naming its file."""
    if deadline is None:
        deadline = time.monotonic() + READ_SECONDS
    blobs = os.path.join(_models_of(manifest_path), "blobs")
    manifest = _read_json(manifest_path, MAX_MANIFEST, "manifest")
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, list):
        raise OllamaFileError(f"{manifest_path}: manifest has no list of layers")
    if len(layers) > MAX_LAYERS:
        raise OllamaFileError(f"{manifest_path}: manifest has over {MAX_LAYERS} layers")
    model = projector = None
    params: list[str] = []
    notes = []
    for n, layer in enumerate(layers):
        media = layer.get("mediaType") if isinstance(layer, dict) else None
        name = blob_name(layer.get("digest")) if isinstance(layer, dict) else None
        if not isinstance(media, str) or name is None:
            raise OllamaFileError(f"{manifest_path}: layer {n}: no media type or no sha256 digest")
        path = os.path.join(blobs, name)
        if media == MEDIA_MODEL:
            model = path  # images.go GetModel: the last model layer is the one loaded
        elif media == MEDIA_PROJECTOR:
            if projector is None:
                projector = path  # only the first goes to llama-server (--mmproj)
        elif media == MEDIA_PARAMS:
            params.append(path)
        elif media == MEDIA_DRAFT:
            notes.append("a draft model layer: not counted")
    if model is None:
        raise OllamaFileError(
            f"{manifest_path}: no GGUF model layer ({MEDIA_MODEL}): a safetensors/MLX model?"
        )
    if len(params) > MAX_PARAMS_LAYERS:
        raise OllamaFileError(f"{manifest_path}: over {MAX_PARAMS_LAYERS} params layers")
    options: dict[str, int] = {}
    for path in params:
        _tick(path, deadline)
        values = _read_json(path, MAX_PARAMS, "params")
        if not isinstance(values, dict):
            raise OllamaFileError(f"{path}: params is not a JSON object")
        for key in ("num_ctx", "num_batch"):
            try:
                value = int_option(values, key, path)
            except OllamaError as e:
                raise OllamaFileError(str(e)) from None
            if value is not None:
                options[key] = value
    _tick(model, deadline)
    gguf = read_model(model, deadline=deadline, cache=cache)
    proj = read_model(projector, deadline=deadline, cache=cache) if projector else None
    cost = gguf.cost + (proj.cost if proj else 0) + 1024
    return OllamaModel(manifest_path, gguf.path, gguf, projector, proj, options, tuple(notes), cost)


# --- the footprint ------------------------------------------------------------------------


def manifest_path(server: OllamaServer, load: OllamaLoad) -> str:
    """Where the manifest of `load`'s model is; OllamaError saying why it is not known."""
    if load.model is None:
        raise OllamaError(f"{load.via}: {'; '.join(load.notes) or 'no model named'}")
    if server.models is None:
        raise OllamaError(f"models directory unknown: {server.models_rule}")
    return parse_reference(load.model).manifest(server.models)


def load_spec(
    server: OllamaServer, load: OllamaLoad, got: OllamaModel, gpu_memory: int
) -> LoadSpec:
    """The llama.cpp settings Ollama's runner gets for this load, as a LoadSpec (kind
    "ollama"): `rule` says where the context came from, `notes` what else was decided."""
    model = got.model
    arch = model.arch
    notes = [*server.notes, *load.notes, *got.notes]
    if load.num_ctx is not None:
        ctx, whence = load.num_ctx, "the request's num_ctx"
    elif "num_ctx" in got.options:
        ctx, whence = got.options["num_ctx"], "the model's params num_ctx"
    elif server.context_length:
        ctx, whence = server.context_length, "OLLAMA_CONTEXT_LENGTH"
    else:
        ctx = default_context(gpu_memory, server.gpu_overhead)
        whence = f"Ollama's default for {format_size(gpu_memory)} of GPU memory"
    rule = f"ctx {ctx} ({whence})"
    ctx = max(ctx, MIN_CONTEXT)
    vision = got.projector is not None or f"{arch}.vision.block_count" in model.metadata
    if vision and ctx < VISION_MIN_CONTEXT:
        ctx = VISION_MIN_CONTEXT
        rule += f", at least {VISION_MIN_CONTEXT} for a vision model"
    trained = model.get(f"{arch}.context_length")
    if isinstance(trained, int) and 0 < trained < ctx:
        ctx = trained
        rule += f", the model's trained {trained}"
    embedding = f"{arch}.pooling_type" in model.metadata
    np = server.num_parallel
    if np > 1 and (embedding or arch in SINGLE_SEQUENCE):
        notes.append(f"OLLAMA_NUM_PARALLEL {np}: Ollama runs {arch or 'this model'} with 1")
        np = 1
    fa = server.flash_attention
    kv = server.kv_cache_type or "f16"
    if kv not in CACHE_TYPES:
        notes.append(f"OLLAMA_KV_CACHE_TYPE {quoted(kv)}: unknown to llama.cpp; counted as f16")
        kv = "f16"
    elif kv not in ("f16", "f32", "bf16") and (fa != "on" or kv not in KV_QUANTIZED_OLD):
        why = "OLLAMA_FLASH_ATTENTION is not on" if fa != "on" else "Ollama before 0.30 drops it"
        notes.append(f"OLLAMA_KV_CACHE_TYPE {kv}: {why}; counted as f16, the larger")
        kv = "f16"
    cells = ctx * np
    batch = load.num_batch if load.num_batch is not None else got.options.get("num_batch")
    if embedding:
        ubatch = min(batch if batch and batch > 0 else EMBED_BATCH, cells)
    elif batch is not None and batch > 0:
        ubatch = batch
    elif fa == "off":
        ubatch = BATCH_DEFAULT
    else:
        ubatch = BATCH_LARGE if cells > 32768 else BATCH_MEDIUM if cells > 4096 else BATCH_DEFAULT
        if ubatch > BATCH_DEFAULT:
            notes.append(
                f"batch {ubatch}: Ollama's most for this context (less if memory is short)"
            )
    settings = Settings(
        n_ctx=cells,
        n_parallel=np,
        kv_unified=False,  # llama-server -np N given: one cache per sequence
        cache_type_k=kv,
        cache_type_v=kv,
        flash_attn=fa,
        n_ubatch=max(1, ubatch),
        mmproj_bytes=got.projector.tensor_bytes if got.projector is not None else 0,
        mmproj_compute=projector_compute_bytes(got.projector, fa)[0] if got.projector else 0,
    )
    return LoadSpec(
        kind="ollama",
        binary=server.binary,
        model=got.model_path,
        mmproj=got.projector_path,
        settings=settings,
        rule=rule,
        notes=tuple(notes),
    )


def footprint(
    server: OllamaServer, load: OllamaLoad, got: OllamaModel, gpu_memory: int
) -> tuple[LoadSpec, Estimate, str]:
    """(the settings, llama.cpp's estimate for them, the source line); EstimateError if the
    model lacks what the estimate needs."""
    spec = load_spec(server, load, got, gpu_memory)
    est = estimate(got.model, spec.settings)
    s = spec.settings
    blob = os.path.basename(got.model_path)
    name = parse_reference(load.model).display if load.model else "?"
    source = (
        f"ollama {name} -> blobs/{blob[:19]}... (GGUF)"
        + (" + projector" if got.projector is not None else "")
        + f", ctx {s.n_ctx // s.n_parallel} x {s.n_parallel}, KV {s.cache_type_k}"
        + f": {format_size(est.total)}"
    )
    return spec, est, source


def predict(
    predictor: Predictor,
    server: OllamaServer,
    load: OllamaLoad,
    mem_total: int,
    *,
    owner: int | None = None,
    wait: bool = True,
    gpu_memory: int | None = None,
) -> Prediction:
    """The footprint `load` will add to `server`'s unit, as Predictor.for_spec predicts one.

    The manifest, params and GGUF headers are read by `predictor`'s worker thread
    (Predictor.run) with `owner`'s file rights (owner_of(the server unit's manager)),
    within its deadline; a path `owner` cannot open gets one answer whatever the reason.
    `wait=False`: never block; a pending Prediction while the files are read.
    `gpu_memory`: what Ollama sees as GPU memory, for its default context (unified
    memory: MemTotal, the default)."""
    try:
        path = manifest_path(server, load)
    except OllamaError as e:
        return Prediction(None, f"ollama: {e}")

    def job(deadline: float) -> OllamaModel:
        return read(path, deadline=deadline, cache=predictor.headers)

    got = predictor.run(path, owner, job, wait=wait)
    if got is None:
        return Prediction(None, PENDING, pending=True)
    if isinstance(got, str):
        return Prediction(None, got)
    assert isinstance(got, OllamaModel)
    try:
        spec, est, source = footprint(
            server, load, got, mem_total if gpu_memory is None else gpu_memory
        )
    except (OllamaError, EstimateError) as e:
        return Prediction(None, f"ollama: {e}")
    return Prediction(est.total, source, spec, est)
