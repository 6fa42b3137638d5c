"""Reading a loader's command line and environment: plain argv in, LoadSpec out."""

from __future__ import annotations

import pytest

from spark_guard.foresight.estimate import Settings
from spark_guard.foresight.loadspec import SpecError, first_spec, parse


def test_llama_server_flags_in_every_spelling():
    spec = parse(
        [
            "/usr/local/bin/llama-server",
            "-m",
            "/m/ds4.gguf",
            "--ctx-size=32768",
            "-np",
            "2",
            "-ctk",
            "q8_0",
            "--cache-type-v=Q8_0",
            "-fa",
            "on",
            "-ub",
            "1024",
            "--swa-full",
            "--mmproj",
            "/m/mmproj.gguf",
            "--no-mmap",
            "-ngl",
            "999",
            "--port",
            "8080",
        ]
    )
    assert spec is not None and spec.kind == "llama.cpp" and spec.binary == "llama-server"
    assert spec.model == "/m/ds4.gguf" and spec.mmproj == "/m/mmproj.gguf"
    assert spec.settings == Settings(
        n_ctx=32768,
        n_parallel=2,
        kv_unified=False,
        cache_type_k="q8_0",
        cache_type_v="q8_0",
        flash_attn="on",
        n_ubatch=1024,
        swa_full=True,
        no_mmap=True,
        n_gpu_layers=999,
    )


def test_llama_server_defaults_are_four_slots_on_one_unified_cache():
    spec = parse(["llama-server", "-m", "/m/x.gguf"])
    assert spec is not None
    assert (spec.settings.n_ctx, spec.settings.n_parallel, spec.settings.kv_unified) == (0, 4, True)
    cli = parse(["llama-cli", "-m", "/m/x.gguf"])
    assert cli is not None and cli.settings.n_parallel == 1


def test_environment_is_read_and_the_command_line_wins():
    env = {
        "LLAMA_ARG_MODEL": "/m/env.gguf",
        "LLAMA_ARG_CTX_SIZE": "8192",
        "LLAMA_ARG_FLASH_ATTN": "off",
        "LLAMA_ARG_N_PARALLEL": "1",
    }
    spec = parse(["llama-server", "-c", "4096"], env)
    assert spec is not None and spec.model == "/m/env.gguf"
    assert (spec.settings.n_ctx, spec.settings.flash_attn, spec.settings.n_parallel) == (
        4096,
        "off",
        1,
    )


def test_a_bare_flash_attn_flag_from_older_builds():
    spec = parse(["llama-server", "-fa", "-m", "/m/x.gguf"])
    assert spec is not None and spec.settings.flash_attn == "on" and spec.model == "/m/x.gguf"


def test_wrappers_and_shells_are_seen_through():
    for argv in (
        ["/usr/bin/env", "LLAMA_CACHE=/tmp", "nice", "-n", "5", "llama-server", "-m", "/m/a.gguf"],
        ["/bin/sh", "-c", "exec /opt/llama/llama-server -m '/m/a.gguf' -c 2048; echo done"],
    ):
        spec = parse(argv)
        assert spec is not None and spec.model == "/m/a.gguf", argv


def test_vllm_takes_its_share_of_memory():
    spec = parse(["/opt/venv/bin/vllm", "serve", "Qwen/Qwen3-32B", "--gpu-memory-utilization=0.5"])
    assert spec is not None and spec.kind == "vllm" and spec.gpu_fraction == 0.5
    default = parse(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "x"])
    assert default is not None and default.gpu_fraction == 0.9
    with pytest.raises(SpecError, match=r"--gpu-memory-utilization 1\.5: must be in \(0, 1\]"):
        parse(["vllm", "serve", "x", "--gpu-memory-utilization", "1.5"])


def test_unknown_loaders_have_no_spec_and_bad_numbers_are_named():
    assert parse(["/usr/bin/ollama", "serve"]) is None
    assert parse(["lms", "server", "start"]) is None
    assert first_spec([["/bin/true"], ["llama-cli", "-m", "/m/x.gguf"]]) is not None
    with pytest.raises(SpecError, match=r"^--ctx-size 'big': not a number$"):
        parse(["llama-server", "-c", "big"])
    with pytest.raises(SpecError, match=r"^-m needs a value$"):
        parse(["llama-server", "-m"])


def test_sglang_in_each_spelling():
    for argv in (
        ["/opt/venv/bin/python3", "-m", "sglang.launch_server", "--model-path", "/m/Qwen3"],
        ["python3", "-u", "-m", "sglang.launch_server", "--model=/m/Qwen3"],
        ["/usr/local/bin/sglang", "serve", "--model-path", "/m/Qwen3"],
        ["/bin/sh", "-c", "exec sglang serve --model-path /m/Qwen3 --port 30000"],
    ):
        spec = parse(argv)
        assert spec is not None and spec.kind == "sglang" and spec.model == "/m/Qwen3", argv
        assert spec.gpu_fraction is None  # its default depends on the memory: predict.py's
    spec = parse(
        [
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/m/Qwen3",
            "--mem-fraction-static",
            "0.75",
            "--context-length=32768",
        ]
    )
    assert spec is not None and (spec.gpu_fraction, spec.rule) == (
        0.75,
        "--mem-fraction-static 0.75",
    )
    assert spec.notes == (
        "--context-length 32768: a limit per request; the KV pool fills the share",
    )
    assert parse(["python3", "-m", "sglang_router.launch_router"]) is None
    assert parse(["sglang", "version"]) is None


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--mem-fraction-static", "1.5"], r"^--mem-fraction-static '1\.5': must be in \(0, 1\]$"),
        (["--mem-fraction-static", "0"], r"^--mem-fraction-static '0': must be in \(0, 1\]$"),
        (["--mem-fraction-static", "nan"], r"^--mem-fraction-static 'nan': must be in"),
        (["--mem-fraction-static=inf"], r"^--mem-fraction-static 'inf': must be in"),
        (["--mem-fraction-static", "most"], r"^--mem-fraction-static 'most': not a number$"),
        (["--context-length", "-1"], r"^--context-length '-1': must be in \[1, 4294967296\]$"),
        (["--context-length", "9" * 5000], r"^--context-length '9{64}\.\.\.': not a number$"),
        (["--mem-fraction-static"], r"^--mem-fraction-static needs a value$"),
    ],
)
def test_sglang_bad_values_name_the_flag(argv, problem):
    with pytest.raises(SpecError, match=problem):
        parse(["sglang", "serve", "--model-path", "/m/x", *argv])


def test_tgi_flags_and_the_environment_clap_reads_for_them():
    spec = parse(
        [
            "/usr/local/bin/text-generation-launcher",
            "--model-id",
            "/m/Llama",
            "--cuda-memory-fraction=0.5",
            "--max-total-tokens",
            "8192",
            "--max-batch-prefill-tokens",
            "4096",
            "--kv-cache-dtype",
            "fp8_e5m2",
            "--port",
            "8080",
        ]
    )
    assert spec is not None and spec.kind == "tgi" and spec.model == "/m/Llama"
    assert spec.gpu_fraction == pytest.approx(0.45)
    assert spec.rule == "0.9 (TGI_WIGGLE_ROOM) x --cuda-memory-fraction 0.5"
    assert (spec.max_total_tokens, spec.prefill_tokens, spec.kv_bytes) == (8192, 4096, 1)
    env = {
        "MODEL_ID": "/m/env",
        "CUDA_MEMORY_FRACTION": "0.8",
        "MAX_TOTAL_TOKENS": "2048",
        "TGI_WIGGLE_ROOM": "0.5",
    }
    from_env = parse(["text-generation-launcher", "--max-total-tokens", "4096"], env)
    assert from_env is not None and from_env.model == "/m/env"
    assert from_env.gpu_fraction == pytest.approx(0.4) and from_env.max_total_tokens == 4096
    assert from_env.rule == "0.5 (TGI_WIGGLE_ROOM) x CUDA_MEMORY_FRACTION 0.8"
    bare = parse(["text-generation-launcher"])
    assert bare is not None and bare.model is None and bare.gpu_fraction == pytest.approx(0.9)
    assert (bare.max_total_tokens, bare.prefill_tokens, bare.kv_bytes) == (None, None, 2)


@pytest.mark.parametrize(
    ("argv", "env", "problem"),
    [
        (["--cuda-memory-fraction", "2"], {}, r"^--cuda-memory-fraction '2': must be in \(0, 1\]$"),
        ([], {"CUDA_MEMORY_FRACTION": "x"}, r"^CUDA_MEMORY_FRACTION 'x': not a number$"),
        ([], {"TGI_WIGGLE_ROOM": "1"}, r"^TGI_WIGGLE_ROOM '1': must be in \(0, 1\)$"),
        (["--max-total-tokens", "0"], {}, r"^--max-total-tokens '0': must be in \[1, "),
        ([], {"MAX_BATCH_PREFILL_TOKENS": "4k"}, r"^MAX_BATCH_PREFILL_TOKENS '4k': not a number$"),
        (["--kv-cache-dtype", "q4_0"], {}, r"^--kv-cache-dtype 'q4_0': not one of fp8, "),
        (["--model-id"], {}, r"^--model-id needs a value$"),
    ],
)
def test_tgi_bad_values_name_the_flag_or_variable(argv, env, problem):
    with pytest.raises(SpecError, match=problem):
        parse(["text-generation-launcher", *argv], env)
