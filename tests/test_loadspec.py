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
