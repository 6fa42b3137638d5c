"""The tables of docs/estimator.md, printed in Markdown from the estimator as it is now.

    .venv/bin/python -m benchmarks.estimator_tables

llama.cpp's figures (lab/llamacpp.py) are the ones tests/test_estimate.py checks against
(published in its tools/fit-params README, and read from its own log for
SmolLM2-135M; how: docs/estimator.md); the estimate columns are computed
here, so the doc shows what the code gives, not what it gave once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from lab import synth, testdata
from lab.llamacpp import FIT_PARAMS, LLAMA_CPP, MEASURED, MMPROJ
from spark_guard.core.argv.loadspec import Settings
from spark_guard.foresight.estimate import (
    MiB,
    compute_bytes,
    estimate,
    kv_bytes,
    projector_compute_bytes,
)
from spark_guard.foresight.gguf import read_model

GiB = 1024 * MiB


def flags(settings: dict[str, object]) -> str:
    names = {
        "n_ctx": "-c",
        "n_ubatch": "-ub",
        "flash_attn": "-fa",
        "n_parallel": "-np",
        "cache_type_k": "-ctk",
        "cache_type_v": "-ctv",
    }
    text = " ".join(f"{names[k]} {v}" for k, v in settings.items())
    return text + (" (trained 8192)" if settings.get("n_ctx") == 0 else "")


def published() -> None:
    with tempfile.TemporaryDirectory() as d:
        model = read_model(str(synth.write(synth.SPECS["qwen3-30b-a3b"], Path(d), shards=1)))
        kv_4k = kv_bytes(model, Settings(n_ctx=4096))[0] / MiB
        kv_full = kv_bytes(model, Settings(n_ctx=0))[0] / MiB
        est = estimate(model, Settings(n_ctx=4096))
    weights = {t.name: t.bytes for t in est.terms}["weights"]
    llama_total = weights + (FIT_PARAMS["kv_4096"] + FIT_PARAMS["compute"]) * MiB
    print("| figure | llama.cpp | estimate |")
    print("|---|---|---|")
    print(
        f'| KV at `-c 4096` ("context" in its memory breakdown) '
        f"| {FIT_PARAMS['kv_4096']} MiB | {kv_4k:.1f} MiB |"
    )
    print(
        f"| saved going from ctx 40960 to 4096 | {FIT_PARAMS['saved_40960_to_4096']} MiB "
        f"| {kv_full - kv_4k:.1f} MiB |"
    )
    print(
        f"| whole footprint: weights + {FIT_PARAMS['kv_4096']} MiB context + "
        f"{FIT_PARAMS['compute']} MiB compute | {llama_total / GiB:.1f} GiB "
        f"| {est.total / GiB:.1f} GiB ({(est.total - llama_total) / llama_total * 100:+.1f} %) |"
    )


def measured() -> None:
    model = read_model(str(testdata.smollm2(fetch=True)))
    print("| settings | KV llama.cpp | KV estimate | compute llama.cpp | compute estimate |")
    print("|---|---|---|---|---|")
    for i, (settings, kv, compute) in enumerate(MEASURED):
        s = Settings(**settings)  # type: ignore[arg-type]
        ours_kv = kv_bytes(model, s)[0] / MiB
        ours_compute = compute_bytes(model, s)[0] / MiB
        unit = " MiB" if i == 0 else ""
        print(
            f"| {flags(settings)} | {kv:.2f}{unit} | {ours_kv:.2f}{unit} "
            f"| {compute:.2f}{unit} | {ours_compute:.2f}{unit} |"
        )


ARCHITECTURES = {
    "gpt-oss-20b": "gpt-oss-20b (gpt-oss: MXFP4 experts, attention sinks, SWA 128)",
    "gpt-oss-120b": "gpt-oss-120b (gpt-oss)",
    "qwen3-30b-a3b": "Qwen3-30B-A3B (qwen3moe)",
    "qwen3-next-80b-a3b": "Qwen3-Next-80B-A3B (qwen3next: hybrid, gated delta net)",
    "nemotron-3-nano-30b-a3b": "Nemotron-3-Nano-30B-A3B (nemotron_h_moe: hybrid, Mamba-2)",
    "glm-4.5-air": "GLM-4.5-Air (glm4moe, with its MTP block)",
}


def settings_flags(settings: dict[str, object]) -> str:
    names = {"n_ctx": "-c", "n_parallel": "-np", "cache_type_k": "-ctk", "cache_type_v": "-ctv"}
    out = []
    for k, v in settings.items():
        if k == "kv_unified":
            out.append("-kvu")
        elif k == "flash_attn":
            out.append(f"-fa {v}")
        else:
            out.append(f"{names[k]} {v}")
    return " ".join(out)


def architectures() -> None:
    """One table per architecture: llama.cpp's own breakdown (lab/llamacpp.py LLAMA_CPP)."""
    with tempfile.TemporaryDirectory() as d:
        models = {k: read_model(str(synth.write(synth.SPECS[k], Path(d)))) for k in ARCHITECTURES}
        for key, title in ARCHITECTURES.items():
            rows = [r for r in LLAMA_CPP if r[0] == key]
            print(f"#### {title}\n")
            print(f"Weights: llama.cpp {rows[0][2] / GiB:.2f} GiB, estimate ", end="")
            est0 = estimate(models[key], Settings(flash_attn="on", **rows[0][1]))  # type: ignore[arg-type]
            print(f"{est0.terms[0].bytes / GiB:.2f} GiB ({est0.terms[0].detail}).\n")
            print(
                "| settings (-fa on unless said) | KV + state llama.cpp | estimate "
                "| compute llama.cpp | estimate | weights + KV + compute | whole estimate |"
            )
            print("|---|---|---|---|---|---|---|")
            for _, settings, weights, context, compute, _fit in rows:
                s = Settings(**{"flash_attn": "on", **settings})  # type: ignore[arg-type]
                est = estimate(models[key], s)
                t = {x.name: x.bytes for x in est.terms}
                need = weights + context + compute
                ours = t["weights"] + t["kv"] + t["compute"]
                print(
                    f"| {settings_flags(settings)} | {context / MiB:.1f} MiB "
                    f"| {t['kv'] / MiB:.1f} MiB "
                    f"| {compute / MiB:.1f} MiB | {t['compute'] / MiB:.1f} MiB "
                    f"| {(ours - need) / need * 100:+.2f} % "
                    f"| {est.total / GiB:.2f} GiB ({(est.total - need) / need * 100:+.1f} %) |"
                )
            print()


PROJECTORS = {
    "gemma-3-27b-mmproj": "Gemma 3 27B (gemma3: SigLIP 896 px, 4x4 pool)",
    "qwen2.5-vl-7b-mmproj": "Qwen2.5-VL 7B (qwen2.5vl_merger: window attention, 2x2 merge)",
}


def warmup(detail: str) -> str:
    """'projector 896 px warmup, 4096 patches, ...' -> '896 px, 4096 patches'."""
    size, patches = detail.split(", ")[:2]
    return f"{size.removeprefix('projector ').removesuffix(' warmup')}, {patches}"


def projectors() -> None:
    """The projectors (--mmproj): clip.cpp's own accounting (lab/llamacpp.py MMPROJ)."""
    print(
        "| projector | -fa | weights llama.cpp | estimate "
        "| compute llama.cpp | estimate | off by | warmup image |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for key, title in PROJECTORS.items():
            model = read_model(str(synth.write_projector(synth.PROJECTORS[key], Path(d))))
            for _, fa, weights, compute in (r for r in MMPROJ if r[0] == key):
                ours, detail = projector_compute_bytes(model, fa)
                print(
                    f"| {title} | {fa} | {weights / MiB:.1f} MiB "
                    f"| {model.tensor_bytes / MiB:.1f} MiB "
                    f"| {compute / MiB:.1f} MiB | {ours / MiB:.1f} MiB "
                    f"| {(ours - compute) / compute * 100:+.1f} % | {warmup(detail)} |"
                )


if __name__ == "__main__":
    print("### Published figures (Qwen3-30B-A3B, F16, CUDA)\n")
    published()
    print("\n### Measured here (SmolLM2-135M Q4_1, llama.cpp CPU build)\n")
    measured()
    print("\n### The models of issue 18 (llama.cpp 0c1e57098, CPU build, its own breakdown)\n")
    architectures()
    print("### Vision projectors (--mmproj; llama.cpp 0c1e57098 tools/mtmd, CPU build)\n")
    projectors()
