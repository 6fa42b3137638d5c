"""llama.cpp's own figures, the ones the footprint estimate is held to.

Checked by tests/test_estimate.py; printed beside the estimate by
benchmarks/estimator_tables.py for docs/estimator.md.
"""

from __future__ import annotations

# llama.cpp's tools/fit-params/README.md on Qwen3-30B-A3B (CUDA, -c 4096): 384 MiB of KV
# (the breakdown's "context") and 898 MiB of compute over the weights, and "context size
# reduced from 40960 to 4096 -> need 3456 MiB less memory". MiB.
FIT_PARAMS = {"kv_4096": 384, "compute": 898, "saved_40960_to_4096": 3456}

# llama-cli (llama.cpp as vendored in llama-cpp-python 0.3.36, CPU build) on SmolLM2-135M
# Q4_1, read from its log: (settings, "llama_kv_cache: size", "CPU compute buffer size").
# How to reproduce: docs/estimator.md.
MEASURED: list[tuple[dict[str, object], float, float]] = [
    ({"n_ctx": 4096}, 90.00, 17.51),
    ({"n_ctx": 2048}, 45.00, 15.51),
    ({"n_ctx": 8192}, 180.00, 21.51),
    ({"n_ctx": 0}, 180.00, 21.51),
    ({"n_ctx": 4096, "n_ubatch": 256}, 90.00, 8.76),
    ({"n_ctx": 4096, "n_ubatch": 1024}, 90.00, 35.02),
    ({"n_ctx": 4096, "flash_attn": "off"}, 90.00, 86.38),
    ({"n_ctx": 8192, "flash_attn": "off"}, 180.00, 166.38),
    ({"n_ctx": 4096, "flash_attn": "off", "n_ubatch": 1024}, 90.00, 172.77),
    ({"n_ctx": 4096, "n_parallel": 4}, 90.00, 14.51),
    (
        {"n_ctx": 4096, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
        47.81,
        16.42,
    ),
    (
        {"n_ctx": 4096, "cache_type_k": "q4_0", "cache_type_v": "q4_0", "flash_attn": "on"},
        25.31,
        16.42,
    ),
]
