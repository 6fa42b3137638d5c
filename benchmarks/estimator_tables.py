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
from lab.llamacpp import FIT_PARAMS, MEASURED
from spark_guard.foresight.estimate import MiB, Settings, compute_bytes, estimate, kv_bytes
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
    model = read_model(str(testdata.smollm2()))
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


if __name__ == "__main__":
    print("### Published figures (Qwen3-30B-A3B, F16, CUDA)\n")
    published()
    print("\n### Measured here (SmolLM2-135M Q4_1, llama.cpp CPU build)\n")
    measured()
