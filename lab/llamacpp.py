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

# llama.cpp's own accounting on the synthetic models of issue 18 (lab/synth.py: the real
# models' shapes and tensor lists, sparse files), in bytes: (model, settings, weights,
# context, compute as llama-server reserves it, compute as llama-fit-params reserves it).
# weights: the model buffer; context: the KV cache plus the recurrent state (llama.cpp's
# "context" in its memory breakdown); compute: the compute buffer, whose logits are one
# row per slot in llama-server (n_outputs_max = -np: tools/server/server-context.cpp,
# server_output_limits) and a whole ubatch in llama-fit-params (n_outputs_max = 0 ->
# n_batch). Measured, CPU backend, llama.cpp ggml-org/llama.cpp@0c1e57098 (as vendored in
# llama-cpp-python 0.3.36), built out of the tree:
#     cmake -S vendor/llama.cpp -B /var/tmp/llama.cpp-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
#         -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
#     cmake --build /var/tmp/llama.cpp-build --target llama-fit-params -j2
# and printed by `python -m lab.llamacpp_run /var/tmp/llama.cpp-build/sg-mem` (the command
# for each row: sg-mem -m MODEL.gguf -t 1 -fa on|off -c N [-np N] [-kvu] [-ctk T -ctv T];
# lab/llamacpp_mem.cpp, the memory breakdown of llama-fit-params in bytes).
LLAMA_CPP: list[tuple[str, dict[str, object], int, int, int, int]] = [
    ("gpt-oss-20b", {"n_ctx": 4096}, 12096558336, 119537664, 101863456, 434526208),
    (
        "gpt-oss-20b",
        {"n_ctx": 32768, "n_parallel": 4},
        12096558336,
        880803840,
        106057760,
        456415232,
    ),
    ("gpt-oss-20b", {"n_ctx": 131072}, 12096558336, 3240099840, 231886880, 429524992),
    (
        "gpt-oss-20b",
        {"n_ctx": 131072, "n_parallel": 4, "kv_unified": True},
        12096558336,
        3246391296,
        232149024,
        429524992,
    ),
    (
        "gpt-oss-20b",
        {"n_ctx": 32768, "flash_attn": "off"},
        12096558336,
        824180736,
        4402327584,
        4402329600,
    ),
    (
        "gpt-oss-20b",
        {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
        12096558336,
        437846016,
        131289120,
        429524992,
    ),
    ("gpt-oss-120b", {"n_ctx": 4096}, 63374323968, 179306496, 101863456, 434526208),
    (
        "gpt-oss-120b",
        {"n_ctx": 32768, "n_parallel": 4},
        63374323968,
        1321205760,
        106057760,
        456415232,
    ),
    ("gpt-oss-120b", {"n_ctx": 131072}, 63374323968, 4860149760, 231886880, 429524992),
    (
        "gpt-oss-120b",
        {"n_ctx": 131072, "n_parallel": 4, "kv_unified": True},
        63374323968,
        4869586944,
        232149024,
        429524992,
    ),
    (
        "gpt-oss-120b",
        {"n_ctx": 32768, "flash_attn": "off"},
        63374323968,
        1236271104,
        4402327584,
        4402329600,
    ),
    (
        "gpt-oss-120b",
        {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
        63374323968,
        656769024,
        131289120,
        429524992,
    ),
    ("qwen3-30b-a3b", {"n_ctx": 4096}, 61089832960, 402653184, 96481312, 319555584),
    (
        "qwen3-30b-a3b",
        {"n_ctx": 32768, "n_parallel": 4},
        61089832960,
        3221225472,
        100675616,
        319555584,
    ),
    ("qwen3-30b-a3b", {"n_ctx": 131072}, 61089832960, 12884901888, 226504736, 319555584),
    (
        "qwen3-30b-a3b",
        {"n_ctx": 131072, "n_parallel": 4, "kv_unified": True},
        61089832960,
        12884901888,
        226504736,
        319555584,
    ),
    (
        "qwen3-30b-a3b",
        {"n_ctx": 32768, "flash_attn": "off"},
        61089832960,
        3221225472,
        2246058016,
        2246060032,
    ),
    (
        "qwen3-30b-a3b",
        {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
        61089832960,
        1711276032,
        125923360,
        319555584,
    ),
    ("qwen3-next-80b-a3b", {"n_ctx": 4096}, 44994980864, 179699712, 94384192, 327956512),
    (
        "qwen3-next-80b-a3b",
        {"n_ctx": 32768, "n_parallel": 4},
        44994980864,
        1121452032,
        98578496,
        323749888,
    ),
    ("qwen3-next-80b-a3b", {"n_ctx": 131072}, 44994980864, 3300261888, 224407616, 323749888),
    (
        "qwen3-next-80b-a3b",
        {"n_ctx": 131072, "n_parallel": 4, "kv_unified": True},
        44994980864,
        3537371136,
        224407616,
        323749888,
    ),
    (
        "qwen3-next-80b-a3b",
        {"n_ctx": 32768, "flash_attn": "off"},
        44994980864,
        884342784,
        1184899136,
        1184901152,
    ),
    (
        "qwen3-next-80b-a3b",
        {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
        44994980864,
        506855424,
        124022848,
        357595168,
    ),
    ("nemotron-3-nano-30b-a3b", {"n_ctx": 4096}, 33577599744, 75096064, 84944960, 294662176),
    (
        "nemotron-3-nano-30b-a3b",
        {"n_ctx": 32768, "n_parallel": 4},
        33577599744,
        401047552,
        94054464,
        293351456,
    ),
    ("nemotron-3-nano-30b-a3b", {"n_ctx": 131072}, 33577599744, 855236608, 214968384, 290457600),
    (
        "nemotron-3-nano-30b-a3b",
        {"n_ctx": 131072, "n_parallel": 4, "kv_unified": True},
        33577599744,
        1005027328,
        219883584,
        290457600,
    ),
    (
        "nemotron-3-nano-30b-a3b",
        {"n_ctx": 32768, "flash_attn": "off"},
        33577599744,
        251256832,
        2240550976,
        2240552992,
    ),
    (
        "nemotron-3-nano-30b-a3b",
        {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
        33577599744,
        156884992,
        114387008,
        284952576,
    ),
    ("glm-4.5-air", {"n_ctx": 4096}, 60189088256, 771751936, 182464544, 348141568),
    (
        "glm-4.5-air",
        {"n_ctx": 32768, "n_parallel": 4},
        60189088256,
        6174015488,
        186658848,
        343947264,
    ),
    ("glm-4.5-air", {"n_ctx": 131072}, 60189088256, 24696061952, 312487968, 335546368),
    (
        "glm-4.5-air",
        {"n_ctx": 131072, "n_parallel": 4, "kv_unified": True},
        60189088256,
        24696061952,
        312487968,
        335546368,
    ),
    (
        "glm-4.5-air",
        {"n_ctx": 32768, "flash_attn": "off"},
        60189088256,
        6174015488,
        6597648416,
        6597650432,
    ),
    (
        "glm-4.5-air",
        {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
        60189088256,
        3279945728,
        211906592,
        335546368,
    ),
]

# clip.cpp's own accounting of the vision projectors (--mmproj) of lab/synth.py PROJECTORS
# (the real files' keys, tensor names, shapes and types; sparse), in bytes: (projector,
# flash attention as llama-server passes it, weights, compute). mtmd_get_memory_usage, the
# call llama-server makes to size the projector (no_alloc), without and with clip's warmup:
# the weights, then the compute buffer reserved for the warmup image (Gemma 3: its 896 px;
# Qwen2.5-VL: 46 x 46 merged tokens, 1288 px). Measured, CPU backend, the same llama.cpp
# (0c1e57098) and build dir, `cmake --build /var/tmp/llama.cpp-build --target mtmd -j2`, by
# lab/llamacpp_mmproj.cpp: `python -m lab.llamacpp_run --mmproj /var/tmp/llama.cpp-build/sg-mmproj`.
MMPROJ: list[tuple[str, str, int, int]] = [
    ("gemma-3-27b-mmproj", "auto", 857714112, 127139840),
    ("gemma-3-27b-mmproj", "on", 857714112, 127139840),
    ("gemma-3-27b-mmproj", "off", 857714112, 1186988032),
    ("qwen2.5-vl-7b-mmproj", "auto", 1354131456, 739025728),
    ("qwen2.5-vl-7b-mmproj", "on", 1354131456, 739025728),
    ("qwen2.5-vl-7b-mmproj", "off", 1354131456, 5108210240),
]
