"""Which units are model loaders, from plain data."""

from spark_guard.classify import canonical_model, classify, model_files
from spark_guard.config import Config, parse
from spark_guard.snapshot import UnitRef, UnitUsage

C = Config()


def usage(name: str, manager: str = "system", **kw) -> UnitUsage:
    return UnitUsage(UnitRef(manager, name), **kw)


def test_name_patterns_of_the_default_family():
    for name in (
        "llama-ds4-0731.service",
        "lms-load.service",
        "lmstudio-server.service",
        "ollama.service",
        "vllm-qwen.service",
        "koboldcpp.service",
        "text-generation-inference.service",
        "DeepSeek.service",
    ):
        loader = classify(usage(name), C)
        assert loader is not None, name
        assert loader.evidence[0].startswith("name:")


def test_plain_units_are_not_loaders():
    for name in ("nginx.service", "cron.service", "postgresql@15-main.service"):
        assert classify(usage(name, exec_start=(("/usr/sbin/nginx",),)), C) is None


def test_exec_start_binary_and_model_argument():
    u = usage(
        "inference.service",
        exec_start=(
            (
                "/opt/llama.cpp/build/bin/llama-server",
                "-m",
                "/srv/models/x-00001-of-00003.gguf",
                "-ngl",
                "999",
            ),
        ),
    )
    loader = classify(u, C)
    assert loader is not None
    assert "exec:llama-server" in loader.evidence
    assert "model-arg:/srv/models/x.gguf" in loader.evidence
    assert loader.models == ("/srv/models/x.gguf",)


def test_shell_wrapped_and_python_module_loaders():
    sh = usage("a.service", exec_start=(("/bin/sh", "-c", "exec ollama serve"),))
    assert "exec:ollama" in classify(sh, C).evidence
    py = usage("b.service", cmdlines=(("python3", "-m", "vllm.entrypoints.openai.api_server"),))
    assert "exec:python -m vllm" in classify(py, C).evidence
    st = usage("c.service", exec_start=(("/usr/bin/serve", "--model=/m/w.safetensors"),))
    assert classify(st, C).models == ("/m/w.safetensors",)


def test_runtime_evidence_gpu_and_mapped_gguf():
    gpu = classify(usage("node-worker.service", gpu_pids=(42,), gpu=27 * 2**30), C)
    assert gpu is not None and gpu.evidence == ("gpu-process:1",)
    mapped = classify(usage("x.service", mapped_models=("/srv/m.gguf",)), C)
    assert mapped is not None and mapped.models == ("/srv/m.gguf",)


def test_protected_units_are_never_loaders_whatever_matches():
    for name in (
        "ssh.service",
        "getty@tty1.service",
        "systemd-journald.service",
        "gdm.service",
        "spark-guard.service",
        "user@1000.service",
    ):
        assert classify(usage(name, gpu_pids=(1,), mapped_models=("/m.gguf",)), C) is None
    c = parse('[protected]\nextra = ["llama-keep.service"]\n')
    assert classify(usage("llama-keep.service"), c) is None
    assert classify(usage("llama-other.service"), c) is not None


def test_guard_own_unit_is_protected_under_any_name():
    me = UnitRef("system", "my-guard-llama.service")
    assert classify(usage("my-guard-llama.service"), C, guard_unit=me) is None


def test_only_services_are_loaders():
    assert classify(usage("llama.scope", gpu_pids=(1,)), C) is None
    assert classify(usage("llama.slice"), C) is None


def test_footprint_from_config_exact_and_glob():
    c = parse('[loaders.footprint]\n"llama@*.service" = "40GiB"\n"llama@big.service" = "100GiB"\n')
    assert classify(usage("llama@big.service"), c).expected == 100 * 2**30
    assert classify(usage("llama@small.service"), c).expected == 40 * 2**30
    assert classify(usage("ollama.service"), c).expected is None


def test_model_paths():
    assert model_files([("x", "--model", "/srv/llama/model")]) == ["/srv/llama/model"]
    assert model_files([("x", "-m", "rel/../m.GGUF")]) == ["m.GGUF"]
    assert canonical_model("/a/b-00002-of-00004.gguf") == "/a/b.gguf"
