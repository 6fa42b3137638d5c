"""The footprint estimate against llama.cpp's own figures: published ones and ones measured here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lab import synth
from lab.llamacpp import FIT_PARAMS, LLAMA_CPP, MEASURED, MMPROJ
from spark_guard.core.argv.loadspec import Settings
from spark_guard.foresight.estimate import (
    EstimateError,
    MiB,
    compute_bytes,
    estimate,
    kv_bytes,
    layers,
    projector_compute_bytes,
    skipped_bytes,
    state_bytes,
)
from spark_guard.foresight.gguf import Model, read_model
from tests import data


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
    model = read_model(str(data.smollm2()))
    s = Settings(**settings)
    assert round(kv_bytes(model, s)[0] / MiB, 2) == kv  # exact, to llama.cpp's rounding
    ours = compute_bytes(model, s)[0] / MiB
    assert abs(ours - compute) <= max(0.1 * compute, 0.5), (ours, compute)


def test_smollm2_weights_are_llama_cpps_mapped_model_buffer():
    # "CPU_Mapped model buffer size = 92.10 MiB" in the same log.
    assert round(read_model(str(data.smollm2())).tensor_bytes / MiB, 2) == 92.10


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


# LLAMA_CPP: llama.cpp's own memory breakdown on the models of issue 18 (lab/llamacpp.py).
@pytest.mark.parametrize(
    ("key", "settings", "weights", "context", "compute", "compute_fit"),
    LLAMA_CPP,
    ids=[f"{r[0]}-{r[1]}" for r in LLAMA_CPP],
)
def test_issue_18_models_match_llama_cpps_accounting(
    models, key, settings, weights, context, compute, compute_fit
):
    est = estimate(models[key], Settings(**{"flash_attn": "on", **settings}))
    ours = {t.name: t.bytes for t in est.terms}
    assert ours["weights"] == weights  # exact: MTP blocks left out, MXFP4 at 17 bytes / 32
    assert ours["kv"] == context  # exact: KV of the attention layers + recurrent state
    need = weights + context + compute  # llama-server's compute buffer (one logit row a slot)
    total = ours["weights"] + ours["kv"] + ours["compute"]
    assert abs(total - need) / need < 0.02, (total, need)  # the issue's target, like for like
    assert abs(ours["compute"] - compute) / compute < 0.4, (ours["compute"], compute)
    assert est.total > need  # the whole prediction is never under llama.cpp's need
    assert compute_fit >= compute  # fit-params reserves a whole ubatch of logits


def test_hybrids_keep_kv_in_their_attention_layers_and_a_state_per_sequence(models):
    qwen = models["qwen3-next-80b-a3b"]
    shape = layers(qwen)
    assert sum(shape.recurrent) == 36 and shape.recurrent[:4] == (True, True, True, False)
    assert sum(1 for h in shape.n_head_kv if h) == 12  # every 4th layer holds KV
    # 36 gated-delta-net layers x (3 x 8192 conv + 128 x 4096 state) f32 = 75.4 MiB a sequence
    per_seq = 36 * (3 * 8192 + 128 * 4096) * 4
    assert state_bytes(qwen, Settings(n_parallel=1))[0] == per_seq
    assert state_bytes(qwen, Settings(n_parallel=4))[0] == 4 * per_seq
    # ... whatever the context or the cache type
    assert state_bytes(qwen, Settings(n_ctx=4096, cache_type_k="q8_0"))[0] == per_seq
    assert kv_bytes(qwen, Settings(n_ctx=4096))[0] == 12 * 4096 * 2 * 256 * 2 * 2
    nemo = models["nemotron-3-nano-30b-a3b"]
    assert sum(layers(nemo).recurrent) == 23  # the Mamba-2 blocks; MoE blocks are neither
    assert state_bytes(nemo, Settings())[0] == 23 * (3 * 6144 + 128 * 4096) * 4  # 47.7 MiB
    assert "recurrent state 23 layers x 1 sequences" in estimate(nemo, Settings()).terms[1].detail
    assert state_bytes(models["qwen3-30b-a3b"], Settings())[0] == 0


def test_an_mtp_block_holds_no_kv_and_is_not_loaded(models):
    glm = models["glm-4.5-air"]
    shape = layers(glm)
    assert shape.n_trunk == 46 and shape.n_head_kv[46] == 0 and shape.n_head_kv[45] == 8
    mtp = sum(t.nbytes or 0 for t in glm.tensors if t.name.startswith("blk.46."))
    assert skipped_bytes(glm) == mtp and 1.2 * 2**30 < mtp < 1.4 * 2**30
    weights = estimate(glm, Settings(n_ctx=4096)).terms[0]
    assert weights.bytes == glm.tensor_bytes - mtp and "MTP blocks not loaded" in weights.detail


def test_gpt_oss_experts_are_mxfp4_and_its_sinks_change_no_kv(models):
    oss = models["gpt-oss-20b"]
    exps = next(t for t in oss.tensors if t.name == "blk.0.ffn_up_exps.weight")
    assert exps.nbytes == 2880 * 2880 * 32 // 32 * 17  # MXFP4: 32 values in 17 bytes
    assert any(t.name == "blk.0.attn_sinks.weight" for t in oss.tensors)
    # 12 full layers x 4096 cells + 12 sliding-window layers x pad256(128 + 512) cells
    assert kv_bytes(oss, Settings(n_ctx=4096))[0] == (12 * 4096 + 12 * 768) * 8 * 64 * 2 * 2


@pytest.fixture(scope="module")
def projectors(tmp_path_factory):
    d = tmp_path_factory.mktemp("projectors")
    return {k: read_model(str(synth.write_projector(p, d))) for k, p in synth.PROJECTORS.items()}


# MMPROJ: clip.cpp's own accounting of the projectors, mtmd_get_memory_usage (lab/llamacpp.py).
@pytest.mark.parametrize(
    ("key", "fa", "weights", "compute"), MMPROJ, ids=[f"{r[0]}-fa-{r[1]}" for r in MMPROJ]
)
def test_projectors_match_clips_accounting(projectors, key, fa, weights, compute):
    projector = projectors[key]
    assert projector.tensor_bytes == weights  # exact: every tensor of the file is one clip loads
    ours = projector_compute_bytes(projector, fa)[0]
    assert abs(ours - compute) / compute < 0.05, (ours, compute)


def test_a_projector_adds_its_weights_and_its_compute_buffer(models, projectors):
    gemma, proj = models["gemma-3-27b"], projectors["gemma-3-27b-mmproj"]
    s = Settings(n_ctx=4096, flash_attn="on")
    plain = {t.name: t.bytes for t in estimate(gemma, s).terms}
    buffer, detail = projector_compute_bytes(proj, "on")
    assert detail == "projector 896 px warmup, 4096 patches"
    est = estimate(gemma, replace(s, mmproj_bytes=proj.tensor_bytes, mmproj_compute=buffer))
    ours = {t.name: t.bytes for t in est.terms}
    assert ours["weights"] == plain["weights"] + proj.tensor_bytes
    assert ours["compute"] == plain["compute"] + buffer
    assert f"+ projector {buffer / MiB:.0f} MiB" in est.terms[2].detail
    # Qwen2.5-VL warms up on 46 x 46 merged tokens, whatever its image_size says.
    qwen = projectors["qwen2.5-vl-7b-mmproj"]
    assert "1288 px warmup, 8464 patches" in projector_compute_bytes(qwen)[1]
    # An audio projector, or a header without clip's vision keys: no vision buffer counted.
    audio = Model("a.gguf", {"clip.has_audio_encoder": True}, (), 0, 1)
    odd = Model("b", {"clip.has_vision_encoder": True, "clip.vision.patch_size": "14"}, (), 0, 1)
    assert projector_compute_bytes(audio) == projector_compute_bytes(odd) == (0, "")


QWEN3_06B = synth.Spec("Qwen3-0.6B", "qwen3", 28, 1024, 16, 8, 128, 128, 40960, 151936, n_ff=3072)


def test_a_draft_model_and_lora_adapters_are_counted(tmp_path):
    """llama-server -md loads a second model with a context of its own (llama.cpp's
    common_base_params_to_speculative: the main -c, slots and ubatch, the draft's own KV
    types), and --lora/--lora-scaled adapters beside the model: before, all three were
    "not counted". Now the draft's weights and KV cache are exact, as estimate() has them
    at the draft's settings, its compute buffer approximate, and the adapters' tensors
    exact; no second CUDA context is counted."""
    from spark_guard.core.argv.loadspec import parse
    from spark_guard.foresight.estimate import RUNTIME
    from spark_guard.foresight.predict import Predictor

    main = synth.write(synth.SPECS["qwen3-32b"], tmp_path)
    draft = synth.write(QWEN3_06B, tmp_path)
    a = synth.write_lora(synth.SPECS["qwen3-32b"], 16, tmp_path, "style")
    b = synth.write_lora(synth.SPECS["qwen3-32b"], 64, tmp_path, "domain")
    argv = [
        "llama-server", "-m", str(main), "-c", "16384", "-np", "2", "-fa", "on",
        "-md", str(draft), "-ctkd", "q8_0", "-ctvd", "q8_0", "-ngld", "99",
        "--lora", str(a), "--lora-scaled", f"{b}:0.5",
    ]  # fmt: skip
    spec = parse(argv)
    assert spec is not None and spec.draft == str(draft) and spec.loras == (str(a), str(b))
    assert spec.draft_settings is not None
    assert (spec.draft_settings.n_ctx, spec.draft_settings.n_parallel) == (16384, 2)
    assert (spec.draft_settings.cache_type_k, spec.draft_settings.cache_type_v) == ("q8_0",) * 2
    got = Predictor().for_spec(spec, 128 * 1024**3)
    assert got.bytes is not None and got.estimate is not None, got.source
    assert "with draft Qwen3-0.6B.gguf, ctx 16384" in got.source
    assert "with 2 LoRA adapter(s)" in got.source
    m, d = read_model(str(main)), read_model(str(draft))
    alone = estimate(m, spec.settings)
    draft_alone = estimate(d, spec.draft_settings)
    terms = {t.name: t for t in got.estimate.terms}
    by_draft = {t.name: t.bytes for t in draft_alone.terms}
    assert terms["draft"].bytes == by_draft["weights"] + by_draft["kv"]
    # The draft's KV cache: 28 layers x 8 heads x 128 x (K + V) in q8_0 (34 bytes a 32).
    assert by_draft["kv"] == 28 * 16384 * 8 * 2 * 128 * 34 // 32
    assert terms["draft compute"].bytes == by_draft["compute"] + by_draft["host"] - RUNTIME
    lora = read_model(str(a)).tensor_bytes + read_model(str(b)).tensor_bytes
    # 64 layers x 4 projections x (5120 x r + r x 5120) halves
    assert lora == 64 * 4 * 2 * 5120 * (16 + 64) * 2
    assert terms["lora"].bytes == lora
    assert got.bytes > alone.total + terms["draft"].bytes + lora
    assert got.page_cache == m.tensor_bytes + d.tensor_bytes + lora
    # A draft or adapter that cannot be read is no footprint at all, said.
    bad = parse([*argv[:-2], "--lora", str(tmp_path / "missing.gguf")])
    assert bad is not None
    missing = Predictor().for_spec(bad, 128 * 1024**3)
    assert missing.bytes is None and "missing.gguf" in missing.source
