"""Reading a loader's command line and environment: plain argv in, LoadSpec out."""

from __future__ import annotations

import re

import pytest

from spark_guard.core.argv.loadspec import Settings, SpecError, first_spec, parse


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


# --- koboldcpp and llama-box: llama.cpp inside, their own flags and defaults -------------


def test_koboldcpp_in_each_spelling_with_its_defaults():
    for argv in (
        ["koboldcpp", "--model", "/m/x.gguf"],
        ["/opt/kcpp/koboldcpp-linux-x64-cuda1210", "--model=/m/x.gguf", "--port", "5001"],
        ["python3", "-u", "/opt/koboldcpp/koboldcpp.py", "/m/x.gguf", "5001"],
        ["koboldcpp", "--threads", "8", "/m/x.gguf", "--skiplauncher"],
        ["env", "CUDA_VISIBLE_DEVICES=0", "koboldcpp", "-m", "/m/x.gguf"],
    ):
        spec = parse(argv)
        assert spec is not None and spec.kind == "llama.cpp", argv
        assert (spec.binary, spec.model) == ("koboldcpp", "/m/x.gguf"), argv
        # --contextsize 8192 (its default) + the 128 cells it adds; one unified sequence;
        # flash attention on; the full sliding-window cache unless --useswa.
        assert spec.settings == Settings(
            n_ctx=8192 + 128, n_parallel=1, kv_unified=True, flash_attn="on", swa_full=True
        ), argv
        assert "--contextsize 8192 (koboldcpp's default)" in spec.rule
    assert parse(["python3", "serve.py", "/m/x.gguf"]) is None


def test_koboldcpp_flags_change_the_settings():
    spec = parse(
        [
            "koboldcpp",
            "/m/x.gguf",
            "--contextsize",
            "32768",
            "--quantkv",
            "1",
            "--blasbatchsize",
            "1024",
            "--useswa",
            "--mmproj",
            "/m/mmproj.gguf",
            "--gpulayers",
            "99",
            "--continuous-batching",
            "3",
        ]
    )
    assert spec is not None and spec.mmproj == "/m/mmproj.gguf"
    assert spec.settings == Settings(
        n_ctx=32768 + 128,
        n_parallel=4,
        kv_unified=True,
        cache_type_k="q8_0",
        cache_type_v="q8_0",
        flash_attn="on",
        n_ubatch=1024,
        swa_full=False,
    )
    assert spec.notes == ("--gpulayers 99: one memory pool, so the total does not depend on it",)
    # Without flash attention only K is quantized; the old 2 is q4_0; -1 batches by 16.
    off = parse(["koboldcpp", "-m", "/m/x.gguf", "--noflashattention", "--quantkv=2", "-b", "-1"])
    assert off is not None
    assert (off.settings.flash_attn, off.settings.cache_type_k, off.settings.cache_type_v) == (
        "off",
        "q4_0",
        "f16",
    )
    assert off.settings.n_ubatch == 16


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--contextsize", "100"], "--contextsize '100': must be in [256, 262144]"),
        (["-c", "9" * 5000], "-c '99999999"),
        (["--contextsize", "lots"], "--contextsize 'lots': not a number"),
        (["--quantkv", "q3_k"], "--quantkv 'q3_k': not one of"),
        (["--blasbatchsize", "100"], "--blasbatchsize 100: not one of -1, 16, 32"),
        (["--continuous-batching", "1000"], "--continuous-batching '1000': must be in [0, 64]"),
        (["--config", "/m/x.kcpps"], "--config '/m/x.kcpps': settings in a .kcpps file"),
        (["--contextsize"], "--contextsize needs a value"),
    ],
)
def test_koboldcpp_bad_values_name_the_flag(argv, problem):
    with pytest.raises(SpecError, match=re.escape(problem)):
        parse(["koboldcpp", "/m/x.gguf", *argv])


def test_llama_box_reads_llama_servers_flags_with_its_own_defaults(monkeypatch):
    from spark_guard.core.argv import loadspec

    monkeypatch.setattr(loadspec, "_cpus", lambda: 20)
    spec = parse(["llama-box", "-m", "/m/x.gguf", "--host", "0.0.0.0"], {"LLAMA_ARG_CTX_SIZE": "9"})
    assert spec is not None and (spec.kind, spec.binary) == ("llama.cpp", "llama-box")
    # -c 4096, one sequence per CPU (its --threads-http default), each its own cache,
    # flash attention off; LLAMA_ARG_* are llama-server's, not read by llama-box.
    assert spec.settings == Settings(n_ctx=4096, n_parallel=20, kv_unified=False, flash_attn="off")
    assert spec.rule == (
        "ctx 4096 (llama-box's default); 20 sequences (llama-box's default: one per CPU, at "
        "most 64); flash attention off (its default)"
    )
    given = parse(
        [
            "llama-box",
            "-m",
            "/m/x.gguf",
            "-c",
            "8192",
            "-np",
            "4",
            "-fa",
            "-kvu",
            "-ctk",
            "q8_0",
            "-ctv",
            "q8_0",
            "-ub",
            "1024",
            "--swa-full",
            "--mmproj",
            "/m/p.gguf",
        ]
    )
    assert given is not None and given.mmproj == "/m/p.gguf" and given.rule == ""
    assert given.settings == Settings(
        n_ctx=8192,
        n_parallel=4,
        kv_unified=True,
        cache_type_k="q8_0",
        cache_type_v="q8_0",
        flash_attn="on",
        n_ubatch=1024,
        swa_full=True,
    )
    # --threads sets the sequences' default; a quantized V without flash attention is f16.
    threads = parse(["llama-box", "-m", "/m/x.gguf", "-t", "8", "-ctv", "q4_0", "--no-flash-attn"])
    assert threads is not None
    assert (threads.settings.n_parallel, threads.settings.cache_type_v) == (8, "f16")
    capped = parse(["llama-box", "-m", "/m/x.gguf", "--threads-http", "500"])
    assert capped is not None and capped.settings.n_parallel == 64


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["-c", "-5"], "-c '-5': must be in [0, 4294967296]"),
        (["-np", "0"], "-np 0: must be positive"),
        (["-ctk", "q3_k"], "-ctk 'q3_k': not one of f32, f16"),
        (["-ub", "x"], "-ub 'x': not a number"),
        (["-m"], "-m needs a value"),
    ],
)
def test_llama_box_bad_values_name_the_flag(argv, problem):
    with pytest.raises(SpecError, match=re.escape(problem)):
        parse(["llama-box", "-m", "/m/x.gguf", *argv])


@pytest.mark.parametrize(
    ("argv", "settings"),
    [
        (
            ["koboldcpp", "--model", "{model}", "--quantkv", "q8_0"],
            Settings(
                n_ctx=8320,
                kv_unified=True,
                cache_type_k="q8_0",
                cache_type_v="q8_0",
                flash_attn="on",
                swa_full=True,
            ),
        ),
        (
            ["llama-box", "-m", "{model}", "-c", "32768", "-np", "2"],
            Settings(n_ctx=32768, n_parallel=2, flash_attn="off"),
        ),
    ],
)
def test_a_prediction_on_a_synthetic_gguf_is_the_estimate_with_their_settings(
    tmp_path, argv, settings
):
    """End to end: the command line, the (sparse, real-shaped) GGUF's header, the estimate."""
    from lab import synth
    from spark_guard.foresight.estimate import estimate
    from spark_guard.foresight.gguf import read_model
    from spark_guard.foresight.predict import Predictor

    model = synth.write(synth.SPECS["gemma-3-27b"], tmp_path)
    argv = [a.format(model=model) for a in argv]
    got = Predictor().predict([argv], {}, 128 << 30)
    assert got is not None and got.estimate is not None, got
    want = estimate(read_model(str(model)), settings)
    assert got.bytes == want.total and got.estimate == want
    assert got.source.startswith(f"{argv[0]} Gemma-3-27B.gguf, ctx {want.n_ctx}: ")
    assert got.spec is not None and got.spec.rule
    assert got.source.endswith(f"({got.spec.rule})")


def test_a_negative_context_is_refused_not_a_negative_footprint():
    """-c -5 or a draft's -cd -100000000 made a negative footprint, which every budget
    admits: the strict rule never refused it."""
    for argv in (
        ["llama-server", "-m", "/m.gguf", "-c", "-5"],
        ["llama-server", "-m", "/m.gguf", "-md", "/d.gguf", "-cd", "-100000000"],
    ):
        with pytest.raises(SpecError, match="a size cannot be negative"):
            parse(argv)
    with pytest.raises(SpecError, match="cannot be negative"):
        parse(["llama-server"], {"LLAMA_ARG_MODEL": "/m.gguf", "LLAMA_ARG_CTX_SIZE": "-1"})
