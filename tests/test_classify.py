"""Which units are model loaders, from plain data."""

import os

from spark_guard.core.classify import canonical_model, classify, model_files
from spark_guard.core.config import Config, parse
from spark_guard.core.snapshot import Loader, SeenUnit, UnitRef

C = Config()


def seen(name: str, manager: str = "system", **kw) -> SeenUnit:
    return SeenUnit(UnitRef(manager, name), **kw)


def classified(unit: SeenUnit, config: Config = C) -> Loader:
    """classify() of a unit the test expects to be a loader."""
    loader = classify(unit, config)
    assert loader is not None, unit.ref
    return loader


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
        loader = classify(seen(name), C)
        assert loader is not None, name
        assert loader.evidence[0].startswith("name:")


def test_a_name_pattern_is_matched_at_the_start_of_a_word():
    """Issue 29 §4: "llama" is inside "ollama": ollama.service is named by "ollama", and a
    name only holding a pattern inside a word (helms, myllama) is no evidence."""
    ollama = classify(seen("ollama.service"), C)
    assert ollama is not None and ollama.evidence[0] == "name:ollama"
    for name, word in (("llama3-70b.service", "llama"), ("srv-qwen@1.service", "qwen")):
        loader = classify(seen(name), C)
        assert loader is not None and loader.evidence[0] == f"name:{word}", name
    for name in ("helms.service", "myllama.service", "bigguf.service"):
        assert classify(seen(name), C) is None, name


def test_plain_units_are_not_loaders():
    for name in ("nginx.service", "cron.service", "postgresql@15-main.service"):
        assert classify(seen(name, exec_start=(("/usr/sbin/nginx",),)), C) is None


def test_exec_start_binary_and_model_argument():
    u = seen(
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
    sh = seen("a.service", exec_start=(("/bin/sh", "-c", "exec ollama serve"),))
    assert "exec:ollama" in classified(sh, C).evidence
    py = seen("b.service", cmdlines=(("python3", "-m", "vllm.entrypoints.openai.api_server"),))
    assert "exec:python -m vllm" in classified(py, C).evidence
    st = seen("c.service", exec_start=(("/usr/bin/serve", "--model=/m/w.safetensors"),))
    assert classified(st, C).models == ("/m/w.safetensors",)


def test_runtime_evidence_gpu_and_mapped_gguf():
    gpu = classify(seen("node-worker.service", gpu_pids=(42,), gpu=27 * 2**30), C)
    assert gpu is not None and gpu.evidence == ("gpu-process:1",)
    mapped = classify(seen("x.service", mapped_models=("/srv/m.gguf",)), C)
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
        assert classify(seen(name, gpu_pids=(1,), mapped_models=("/m.gguf",)), C) is None
    c = parse('[protected]\nextra = ["llama-keep.service"]\n')
    assert classify(seen("llama-keep.service"), c) is None
    assert classify(seen("llama-other.service"), c) is not None


def test_a_protected_name_protects_on_its_own_level_only():
    """PID 1's sshd@*.service is the rescue window; a user's own sshd@llm.service is hers,
    and judged as any other unit. `user_units` and level-tagged `extra` entries protect
    on user managers, for every user or one."""

    def armed(name: str, manager: str = "system") -> SeenUnit:
        return seen(name, manager, gpu_pids=(1,), mapped_models=("/m.gguf",))

    for name in ("sshd@llm.service", "getty@tty9.service", "dbus.service", "user@1000.service"):
        assert classify(armed(name), C) is None
        assert classified(armed(name, "user:1000")).ref.manager == "user:1000"
    c = parse(
        '[protected]\nuser_units = ["pipewire.service"]\n'
        'extra = ["keep-system.service", "user:keep-any.service", "user:1000:keep-hers.service"]\n'
    )
    assert classify(armed("pipewire.service", "user:1001"), c) is None
    assert classify(armed("pipewire.service"), c) is not None  # PID 1's is not
    assert classify(armed("keep-system.service"), c) is None
    assert classify(armed("keep-system.service", "user:1000"), c) is not None
    assert classify(armed("keep-any.service", "user:1001"), c) is None
    assert classify(armed("keep-any.service"), c) is not None
    assert classify(armed("keep-hers.service", "user:1000"), c) is None
    assert classify(armed("keep-hers.service", "user:1001"), c) is not None
    assert classify(armed("sshd@x.service"), c) is None  # the defaults stay


def test_guard_own_unit_is_protected_under_any_name():
    me = UnitRef("system", "my-guard-llama.service")
    assert classify(seen("my-guard-llama.service"), C, guard_unit=me) is None


def test_only_services_are_loaders():
    assert classify(seen("llama.scope", gpu_pids=(1,)), C) is None
    assert classify(seen("llama.slice"), C) is None


def test_footprint_from_config_exact_and_glob():
    c = parse('[loaders.footprint]\n"llama@*.service" = "40GiB"\n"llama@big.service" = "100GiB"\n')
    assert classified(seen("llama@big.service"), c).expected == 100 * 2**30
    assert classified(seen("llama@small.service"), c).expected == 40 * 2**30
    assert classified(seen("ollama.service"), c).expected is None


def test_model_paths():
    assert model_files([("x", "--model", "/srv/llama/model")]) == ["/srv/llama/model"]
    assert model_files([("x", "-m", "rel/../m.GGUF")]) == ["m.GGUF"]
    assert canonical_model("/a/b-00002-of-00004.gguf") == "/a/b.gguf"


def test_named_is_not_loaded():
    from spark_guard.core.classify import CommandLine, loaded_models

    sleeper = CommandLine(("sleep", "infinity", "/srv/models/qwen.gguf"))
    assert sleeper.named == ("/srv/models/qwen.gguf",) and sleeper.loads is None
    llama = CommandLine(("sh", "-c", "exec llama-server -m '/srv/My Model-00001-of-00002.gguf'"))
    assert llama.loads == "/srv/My Model.gguf"
    assert llama == ("sh", "-c", "exec llama-server -m '/srv/My Model-00001-of-00002.gguf'")
    spaced = CommandLine(("llama-server", "-m", "/srv/DeepSeek V4.gguf", "--mmproj=/p q.gguf"))
    assert spaced.named == ("/srv/DeepSeek V4.gguf", "/p q.gguf")
    assert spaced.loads == "/srv/DeepSeek V4.gguf"
    broken = CommandLine(("llama-server", "-m", "/m.gguf", "-c", "lots"))  # would not start
    assert broken.loads is None and broken.named == ("/m.gguf",)
    u = seen(
        "x.service",
        exec_start=(("sleep", "infinity", "/a.gguf"),),
        cmdlines=(("llama-server", "--model", "/b.gguf"),),
        mapped_models=("/c-00002-of-00003.gguf",),
    )
    assert loaded_models(u) == ("/b.gguf", "/c.gguf")
    loader = classified(u, C)
    assert loader.models == ("/a.gguf", "/b.gguf", "/c.gguf")  # for display: all of them
    assert [e for e in loader.evidence if ":/" in e] == [
        "model-arg:/a.gguf",
        "loads:/b.gguf",
        "mapped:/c-00002-of-00003.gguf",
    ]


def test_command_lines_are_bounded_and_read_once():
    from spark_guard.core.classify import SHELL_SPLIT_MAX, CommandLine, command_line
    from spark_guard.core.snapshot import ARGV_MAX_ARGS, ARGV_MAX_BYTES

    many = CommandLine(("llama-server", *(["-v"] * 5000)))
    assert len(many) == ARGV_MAX_ARGS
    huge = CommandLine(("llama-server", "-m", "/m.gguf", "x" * ARGV_MAX_BYTES))
    assert huge == ("llama-server", "-m", "/m.gguf")  # the argument past the limit is left out
    assert command_line(huge) is huge
    # Plain argv (audit's, dump's) is read once in classify() and kept on the loader.
    loader = classified(seen("x.service", exec_start=(("llama-server", "-m", "/m.gguf"),)), C)
    assert isinstance(loader.seen.exec_start[0], CommandLine)
    assert loader.seen.exec_start == (("llama-server", "-m", "/m.gguf"),)
    # A 60 kB shell script: split on whitespace past the shell budget, and not read as a
    # loader's (shlex would take 35 ms); a loader's script is a line, and is read.
    script = "exec llama-server -m /m.gguf " + "'a b' " * 10_000
    line = CommandLine(("sh", "-c", script))
    assert line.loads is None and line.named == ("/m.gguf",)
    assert ("llama-server", False) in line.programs
    short = CommandLine(("sh", "-c", script[: 29 + 6 * 1000]))  # 6 kB, whole quotes
    assert len(short[2]) < SHELL_SPLIT_MAX
    assert short.loads == "/m.gguf"


def test_evidence_shows_hostile_paths_inert():
    evil = "/srv/x\x1b[2J\r\n\u202e" + "a" * 5000 + ".gguf"
    loader = classified(
        seen("x.service", exec_start=(("llama-server", "-m", evil),), mapped_models=(evil,)), C
    )
    shown = [e for e in loader.evidence if e.startswith(("model-arg:", "loads:", "mapped:"))]
    assert len(shown) == 3
    for e in shown:
        assert e.split(":", 1)[1].startswith("/srv/x\\x1b[2J\\x0d\\x0a\\u202eaaa")
        assert e.endswith("more chars]") and len(e) < 600
    assert loader.models[0] == os.path.normpath(evil)  # the data itself stays exact
