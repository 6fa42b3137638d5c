"""Run llama.cpp's own memory accounting on the synthetic models and print lab/llamacpp.py's rows.

Not part of the tests or CI (they compare against the recorded rows, they never
build). By hand, with llama.cpp built out of the tree:

    SRC=.../llama.cpp BUILD=/var/tmp/llama.cpp-build   # built with --target llama-fit-params
    c++ -O2 -std=c++17 -I$SRC/include -I$SRC/ggml/include -I$SRC/common -I$SRC/src \\
        lab/llamacpp_mem.cpp -o $BUILD/sg-mem $BUILD/common/libllama-common.a \\
        -L$BUILD/bin -lllama -lggml -lggml-base -lggml-cpu -Wl,-rpath,$BUILD/bin
    .venv/bin/python -m lab.llamacpp_run $BUILD/sg-mem > /tmp/rows.py

The projectors (--mmproj) the same way, with tools/mtmd built (--target mtmd):

    c++ -O2 -std=c++17 -I$SRC/include -I$SRC/ggml/include -I$SRC/tools/mtmd \\
        lab/llamacpp_mmproj.cpp -o $BUILD/sg-mmproj -L$BUILD/bin -lmtmd -lllama -lggml \\
        -lggml-base -Wl,-rpath,$BUILD/bin
    .venv/bin/python -m lab.llamacpp_run --mmproj $BUILD/sg-mmproj > /tmp/mmproj_rows.py

lab/llamacpp_mem.cpp loads the model and sets up the context as llama-fit-params
does (no_alloc: nothing is allocated, tensor data is never read, so the sparse
files serve) and prints llama.cpp's memory breakdown in bytes: the model buffer,
the context (KV cache + recurrent state) and the compute buffer, once with the
outputs llama-fit-params reserves (a whole ubatch of logits) and once with
llama-server's (one per slot: tools/server/server-context.cpp, server_output_limits).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from lab import synth

FLAGS = {
    "n_ctx": "-c",
    "n_parallel": "-np",
    "cache_type_k": "-ctk",
    "cache_type_v": "-ctv",
    "flash_attn": "-fa",
    "n_ubatch": "-ub",
}

SETTINGS: tuple[dict[str, object], ...] = (
    {"n_ctx": 4096},
    {"n_ctx": 32768, "n_parallel": 4},
    {"n_ctx": 131072},
    {"n_ctx": 131072, "n_parallel": 4, "kv_unified": True},
    {"n_ctx": 32768, "flash_attn": "off"},
    {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"},
)
MODELS = (
    "gpt-oss-20b",
    "gpt-oss-120b",
    "qwen3-30b-a3b",
    "qwen3-next-80b-a3b",
    "nemotron-3-nano-30b-a3b",
    "glm-4.5-air",
)
# (model, settings): the architectures of issue 18 over the settings that move the figures.
GRID = [(key, settings) for key in MODELS for settings in SETTINGS]


def argv(settings: dict[str, object]) -> list[str]:
    out = ["-fa", "on"]  # CPU: auto is off there; CUDA (the Spark) has it: on, unless said
    for key, value in settings.items():
        if key == "kv_unified":
            out += ["-kvu"] if value else []
        elif key == "flash_attn":
            out[1] = str(value)
        else:
            out += [FLAGS[key], str(value)]
    return out


def main(tool: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        paths = {key: synth.write(synth.SPECS[key], Path(d)) for key in {k for k, _ in GRID}}
        print("LLAMA_CPP = [")
        for key, settings in GRID:
            cmd = [tool, "-m", str(paths[key]), "-t", "1", *argv(settings)]
            run = subprocess.run(cmd, capture_output=True, text=True, check=False)
            got = dict(re.findall(r"SGMEM (\w+) (.*)", run.stdout))
            if run.returncode or len(got) != 2:
                sys.exit(f"{' '.join(cmd)}: {run.returncode}\n{run.stderr[-3000:]}")
            fit = dict(kv.split("=") for kv in got["fit"].split())
            srv = dict(kv.split("=") for kv in got["server"].split())
            print(
                f"    ({key!r}, {settings!r}, {srv['weights']}, {srv['context']}, "
                f"{srv['compute']}, {fit['compute']}),"
            )
            sys.stdout.flush()
        print("]")


def projectors(tool: str) -> None:
    """lab/llamacpp.py MMPROJ: mtmd_get_memory_usage on each synthetic projector (a sparse
    file: no_alloc, its tensor data is never read), flash attention auto, on and off."""
    with tempfile.TemporaryDirectory() as d:
        print("MMPROJ = [")
        for key, spec in synth.PROJECTORS.items():
            path = synth.write_projector(spec, Path(d))
            run = subprocess.run([tool, str(path)], capture_output=True, text=True, check=False)
            rows = re.findall(r"SGMMPROJ fa=(\w+) weights=(\d+) compute=(\d+)", run.stdout)
            if run.returncode or len(rows) != 3:
                sys.exit(f"{tool} {path}: {run.returncode}\n{run.stderr[-3000:]}")
            for fa, weights, compute in rows:
                print(f"    ({key!r}, {fa!r}, {weights}, {compute}),")
            sys.stdout.flush()
        print("]")


if __name__ == "__main__":
    if sys.argv[1] == "--mmproj":
        projectors(sys.argv[2])
    else:
        main(sys.argv[1])
