"""The footprint estimate against llama.cpp's own figures: published ones and ones measured here."""

from __future__ import annotations

import pytest

from lab import synth, testdata
from lab.llamacpp import FIT_PARAMS, MEASURED
from spark_guard.foresight.estimate import (
    EstimateError,
    MiB,
    Settings,
    compute_bytes,
    estimate,
    kv_bytes,
    layers,
)
from spark_guard.foresight.gguf import Model, read_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {k: read_model(str(synth.write(s, d, shards=1))) for k, s in synth.SPECS.items()}


def kv_mib(model: Model, **settings: object) -> float:
    return kv_bytes(model, Settings(**settings))[0] / MiB  # type: ignore[arg-type]


# FIT_PARAMS: llama.cpp's published figures on Qwen3-30B-A3B (lab/llamacpp.py).
def test_qwen3_30b_a3b_matches_llama_cpps_published_figures(models):
    qwen = models["qwen3-30b-a3b"]
    assert kv_mib(qwen, n_ctx=4096) == FIT_PARAMS["kv_4096"]
    saved = kv_mib(qwen, n_ctx=0) - kv_mib(qwen, n_ctx=4096)  # -c 0: trained 40960
    assert saved == FIT_PARAMS["saved_40960_to_4096"]


# MEASURED: what llama.cpp allocated for SmolLM2-135M Q4_1 (lab/llamacpp.py).
@pytest.mark.parametrize(("settings", "kv", "compute"), MEASURED, ids=[str(m[0]) for m in MEASURED])
def test_smollm2_matches_what_llama_cpp_allocated(settings, kv, compute):
    model = read_model(str(testdata.smollm2()))
    s = Settings(**settings)
    assert round(kv_bytes(model, s)[0] / MiB, 2) == kv  # exact, to llama.cpp's rounding
    ours = compute_bytes(model, s)[0] / MiB
    assert abs(ours - compute) <= max(0.1 * compute, 0.5), (ours, compute)


def test_smollm2_weights_are_llama_cpps_mapped_model_buffer():
    # "CPU_Mapped model buffer size = 92.10 MiB" in the same log.
    assert round(read_model(str(testdata.smollm2())).tensor_bytes / MiB, 2) == 92.10


def test_mla_caches_k_only(models):
    ds = models["deepseek-v3"]
    assert layers(ds).mla
    total, detail = kv_bytes(ds, Settings(n_ctx=32768))
    assert total == 61 * 32768 * 576 * 2  # one 576-wide f16 K row per layer and cell
    assert "MLA: K only" in detail and "V f16" not in detail


def test_sliding_window_layers_hold_only_their_window(models):
    gemma = models["gemma-3-27b"]
    shape = layers(gemma)
    assert shape.swa.count(False) == 10 and shape.n_swa == 1024  # every 6th layer is global
    row = 16 * 128 * 2 * 2  # heads x (K + V) x f16
    assert kv_mib(gemma, n_ctx=32768) * MiB == 10 * 32768 * row + 52 * 1536 * row
    assert kv_mib(gemma, n_ctx=32768, swa_full=True) * MiB == 62 * 32768 * row
    # Four slots on one unified cache: the window is kept per slot, plus a ubatch.
    assert kv_mib(gemma, n_ctx=32768, n_parallel=4, kv_unified=True) * MiB == (
        10 * 32768 * row + 52 * 4608 * row
    )
    oss = models["gpt-oss-120b"]
    assert layers(oss).swa[:4] == (True, False, True, False)
    assert kv_bytes(oss, Settings(n_ctx=131072))[1] == (
        "18 layers x 131072 cells, 18 sliding-window layers x 768 cells, K f16, V f16"
    )


def test_cache_types_and_padding(models):
    qwen = models["qwen3-32b"]
    f16 = kv_mib(qwen, n_ctx=32768)
    assert f16 == 8192
    assert kv_mib(qwen, n_ctx=32768, cache_type_k="q8_0", cache_type_v="q8_0") == f16 * 34 / 64
    assert kv_mib(qwen, n_ctx=32768, cache_type_k="q4_0", cache_type_v="iq4_nl") == f16 * 18 / 64
    assert kv_mib(qwen, n_ctx=32768, cache_type_k="f32", cache_type_v="bf16") == f16 * 6 / 4
    assert kv_mib(qwen, n_ctx=1000) == kv_mib(qwen, n_ctx=1024)  # padded to 256 cells
    with pytest.raises(EstimateError, match="cache type 'q3_k' unknown"):
        kv_mib(qwen, n_ctx=4096, cache_type_k="q3_k")


def test_layers_without_kv_heads_hold_nothing():
    base = {
        "general.architecture": "hybrid",
        "hybrid.block_count": 4,
        "hybrid.embedding_length": 1024,
        "hybrid.attention.head_count": 8,
        "hybrid.context_length": 4096,
    }
    dense = Model("x.gguf", {**base, "hybrid.attention.head_count_kv": 2}, (), 0, 1)
    mixed = Model("x.gguf", {**base, "hybrid.attention.head_count_kv": [0, 2, 0, 2]}, (), 0, 1)
    assert kv_bytes(mixed, Settings())[0] * 2 == kv_bytes(dense, Settings())[0]


def test_missing_metadata_is_named():
    model = Model("/m/x.gguf", {"general.architecture": "llama"}, (), 0, 1)
    with pytest.raises(EstimateError, match=r"^/m/x\.gguf: llama\.block_count missing$"):
        estimate(model, Settings())


def test_the_whole_estimate_says_what_is_exact_and_adds_a_margin(models):
    est = estimate(models["qwen3-30b-a3b"], Settings(n_ctx=4096))
    assert [(t.name, t.exact) for t in est.terms] == [
        ("weights", True),
        ("kv", True),
        ("compute", False),
        ("host", False),
    ]
    weights = {t.name: t.bytes for t in est.terms}["weights"]
    assert weights == models["qwen3-30b-a3b"].tensor_bytes
    assert est.margin >= 0.02 * weights
    assert est.total == sum(t.bytes for t in est.terms) + est.margin
    # The whole footprint within 5 % of llama.cpp's for this model (its README's run).
    llama_cpp = weights + (FIT_PARAMS["kv_4096"] + FIT_PARAMS["compute"]) * MiB
    assert abs(est.total - llama_cpp) / llama_cpp < 0.05
