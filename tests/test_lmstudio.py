"""LM Studio: `lms load` command lines, its servers, a model key's file, and the footprint.

The layouts are real: an LM Studio home written as LM Studio writes it (models
under <publisher>/<repo>/, sparse synthetic GGUFs with real headers, settings.json,
the home pointer, a hub model.yaml, per-model configs), read by the same code the
guard runs, and hostile ones read as a real unprivileged uid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from lab import synth
from lab.accounts import User
from spark_guard.core.argv import lmstudio as lms_argv
from spark_guard.core.argv.lmstudio import LmsLoad, client_load, server
from spark_guard.core.argv.loadspec import Settings, SpecError
from spark_guard.core.quantities import format_size
from spark_guard.foresight import lmstudio
from spark_guard.foresight.estimate import estimate
from spark_guard.foresight.gguf import read_model
from spark_guard.foresight.lmstudio import resolve
from spark_guard.foresight.modelfile import ModelFileError, ModelTimeout
from spark_guard.foresight.predict import PENDING, Prediction, Predictor

MEM_TOTAL = 128 * 2**30
QWEN = "lmstudio-community/Qwen3-30B-A3B-GGUF"
QWEN_FILE = "Qwen3-30B-A3B-Q4_K_M.gguf"
TINY = synth.Spec(
    "Tiny", "qwen3", 2, 256, 4, 2, 64, 64, 8192, 1000, n_ff=512, weight_type=synth.Q.F16
)


def tiny(directory: Path, name: str, *, shards: int = 1, arch: str = "qwen3") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return synth.write(dataclasses.replace(TINY, name=name, arch=arch), directory, shards=shards)


def lay_out(home: Path) -> Path:
    """An LM Studio home as LM Studio writes it; returns its models folder."""
    models = home / ".lmstudio" / "models"
    qwen = dataclasses.replace(synth.SPECS["qwen3-30b-a3b"], name=QWEN_FILE[: -len(".gguf")])
    (models / QWEN).mkdir(parents=True)
    synth.write(qwen, models / QWEN)
    gemma = models / "unsloth" / "gemma-3-27b-it-GGUF"
    tiny(gemma, "gemma-3-27b-it-Q4_K_M")
    tiny(gemma, "mmproj-F16", arch="clip")
    tiny(models / "bartowski" / "Big-GGUF", "Big-Q4_K_M", shards=3)
    multi = models / "lmstudio-community" / "Multi-GGUF"
    tiny(multi, "Multi-Q4_K_M")
    tiny(multi, "Multi-Q8_0")
    (models / "mlx-community" / "Qwen3-30B-A3B-4bit").mkdir(parents=True)  # MLX: no GGUF
    hub = home / ".lmstudio" / "hub" / "models" / "qwen" / "qwen3-30b-a3b"
    hub.mkdir(parents=True)
    (hub / "model.yaml").write_text(
        "model: qwen/qwen3-30b-a3b\n"
        "base:\n"
        "  - key: lmstudio-community/qwen3-30b-a3b-gguf\n"
        "    sources:\n"
        "      - type: huggingface\n"
        "        user: lmstudio-community\n"
        "        repo: Qwen3-30B-A3B-GGUF\n"
        "  - key: lmstudio-community/qwen3-30b-a3b-mlx-4bit\n"
        "    sources:\n"
        "      - type: huggingface\n"
        "        user: mlx-community\n"
        "        repo: Qwen3-30B-A3B-4bit\n"
    )
    return models


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    h = tmp_path_factory.mktemp("home")
    lay_out(h)
    return h


def found(key: str, home: Path, *argv: str, env: dict[str, str] | None = None) -> lmstudio.Found:
    load = client_load(["lms", "load", key, *argv])
    assert load is not None
    return resolve(load, str(home), env)


def predict(home: Path, *argv: str, owner: int | None = None, **kw: object) -> Prediction:
    load = client_load(["lms", "load", *argv])
    assert load is not None
    return lmstudio.predict(Predictor(), load, MEM_TOTAL, owner=owner, home=str(home), **kw)  # type: ignore[arg-type]


# --- command lines ----------------------------------------------------------------------------


def test_lms_load_flags_in_every_spelling():
    load = client_load(
        [
            "/home/x/.lmstudio/bin/lms",
            "load",
            "qwen/qwen3-30b-a3b",
            "--context-length=32768",
            "--gpu",
            "MAX",
            "--identifier",
            "q",
            "--ttl",
            "3600",
            "--parallel",
            "2",
            "-y",
            "--exact",
            "--port",
            "1234",
            "--log-level",
            "debug",
        ]
    )
    assert load is not None
    assert load == LmsLoad(
        binary="/home/x/.lmstudio/bin/lms",
        key="qwen/qwen3-30b-a3b",
        context_length=32768,
        gpu="max",
        parallel=2,
        identifier="q",
        ttl=3600,
        exact=True,
        yes=True,
        port=1234,
        notes=load.notes,
    )
    assert "one pool" in load.notes[0]
    assert client_load(["lms", "load", "-c4096", "x"]) == LmsLoad("lms", "x", context_length=4096)
    short = client_load(["lms", "load", "-yc", "8192", "--gpu=0.5", "x", "extra"])
    assert short is not None and (short.key, short.yes, short.context_length, short.gpu) == (
        "x",
        True,
        8192,
        "0.5",
    )
    assert "1 more argument(s)" in short.notes[-1]
    assert client_load(["lms", "load", "--", "-odd-name"]) == LmsLoad("lms", "-odd-name")
    assert client_load(["lms", "load"]) == LmsLoad("lms", None)


def test_the_incidents_unit_and_other_wrappers_are_seen_through():
    # lms-load.service, "Load lms qwen model after boot delay": the delay in the script, as
    # such units are written, or as an ExecStartPre=, and lms by its full path or from PATH.
    for argv in (
        ["/bin/sh", "-c", "sleep 60; lms load qwen/qwen3-30b-a3b -y"],
        ["/usr/bin/bash", "-lc", "sleep 60 && ~/.lmstudio/bin/lms load qwen/qwen3-30b-a3b --yes"],
        [
            "bash",
            "-o",
            "pipefail",
            "-c",
            "sleep 60\nexec lms load 'qwen/qwen3-30b-a3b' -y >/tmp/l 2>&1",
        ],
        ["/usr/bin/env", "HOME=/home/x", "nice", "-n", "5", "lms", "load", "qwen/qwen3-30b-a3b"],
        ["sh", "-c", "if true; then /home/x/.cache/lm-studio/bin/lms load qwen/qwen3-30b-a3b; fi"],
        ["sh", "-c", "(sleep 60; lms load $MODEL)"],
        ["lms", "load", "${MODEL}"],
    ):
        load = client_load(argv, {"MODEL": "qwen/qwen3-30b-a3b"})
        assert load is not None and load.key == "qwen/qwen3-30b-a3b", argv
    units = [["/bin/sleep", "60"], ["/home/x/.lmstudio/bin/lms", "load", "qwen3", "-y"]]
    first = lms_argv.first_client_load(units)
    assert first is not None and first.key == "qwen3"
    assert client_load(["sh", "-c", "lms load $MODEL"]) == LmsLoad("lms", "$MODEL")
    for argv in (
        ["lms", "ls"],
        ["lms", "server", "start"],
        ["sh", "-c", "echo lms load x"],
        ["llama-server", "-m", "/m/x.gguf"],
        ["sh", "-c", "lms load 'unbalanced"],
    ):
        assert client_load(argv) is None, argv


def test_what_lms_refuses_is_named():
    for argv, said in (
        (["--gpu", "2"], "lms load --gpu '2': must be off, max or a number from 0 to 1"),
        (["--gpu", "nan"], "lms load --gpu 'nan': must be off, max"),
        (["-c", "0"], r"lms load -c '0': must be in \[1, "),
        (["--context-length", "big"], "lms load --context-length 'big': not a whole number"),
        (["--bogus"], "lms load '--bogus': not an option lms knows"),
        (["-z"], "lms load '-z': not an option lms knows"),
        (["x", "-c"], "lms load -c needs a value"),
    ):
        with pytest.raises(SpecError, match=f"^{said}"):
            client_load(["lms", "load", *argv])


def test_servers_are_told_apart():
    assert server(["/home/x/.lmstudio/llmster/0.0.9/llmster"]) == "llmster"
    assert server(["/home/x/.lmstudio/bin/lms", "daemon", "up"]) == "lms daemon up"
    assert server(["sh", "-c", "sleep 5; lms server start --port 1234"]) == "lms server start"
    assert server(["/opt/LM-Studio-0.3.30-x64.AppImage", "--run-as-service"]) == (
        "LM Studio --run-as-service"
    )
    assert server(["/opt/LM Studio/lm-studio"]) == "LM Studio"
    assert server(["/home/xLab/.lmstudio/.internal/utils/node", "x.js"]) == "LM Studio worker"
    for argv in (
        ["lms", "load", "x"],
        ["lms", "server", "stop"],
        ["lms", "daemon", "down"],
        ["ollama", "serve"],
        ["llama-server", "-m", "/m/x.gguf"],
    ):
        assert not lms_argv.is_server(argv), argv
    assert lms_argv.first_server([["/bin/true"], ["lms", "daemon", "up"]]) == "lms daemon up"


def test_what_loads_nothing_here_is_said_without_a_look_at_the_disk(tmp_path: Path):
    nowhere = tmp_path / "absent"
    assert predict(nowhere, "x", "--estimate-only") == Prediction(
        0, "lms load --estimate-only (LM Studio's own estimate): loads nothing"
    )
    assert predict(nowhere, "--help").bytes == 0
    remote = predict(nowhere, "x", "--host", "gpu-box")
    assert remote.bytes is None and "loads on that machine" in remote.source
    local = predict(nowhere, "x", "--host", "127.0.0.1")
    assert "loads on that machine" not in local.source
    assert predict(nowhere).source == (
        "lms load: lms load without a model key: it asks which model, on a terminal"
    )


# --- keys and files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "file", "rule"),
    [
        ("lmstudio-community/qwen3-30b-a3b", f"{QWEN}/{QWEN_FILE}", "by name"),
        ("lmstudio-community/Qwen3-30B-A3B-GGUF", f"{QWEN}/{QWEN_FILE}", "by name"),
        ("Qwen3-30B-A3B", f"{QWEN}/{QWEN_FILE}", "by name"),
        ("qwen/qwen3-30b-a3b", f"{QWEN}/{QWEN_FILE}", "by its hub model.yaml"),
        ("someone/qwen3-30b-a3b", f"{QWEN}/{QWEN_FILE}", "by its last component"),
        (f"{QWEN}/{QWEN_FILE}", f"{QWEN}/{QWEN_FILE}", "path"),
        ("gma27", "unsloth/gemma-3-27b-it-GGUF/gemma-3-27b-it-Q4_K_M.gguf", "by lms's fuzzy match"),
        ("bartowski/big", "bartowski/Big-GGUF/Big-Q4_K_M-00001-of-00003.gguf", "by name"),
        (
            "bartowski/Big-GGUF/Big-Q4_K_M-00002-of-00003.gguf",
            "bartowski/Big-GGUF/Big-Q4_K_M-00001-of-00003.gguf",
            "path",
        ),
        ("multi@q8_0", "lmstudio-community/Multi-GGUF/Multi-Q8_0.gguf", "by name"),
    ],
)
def test_every_key_form_leads_to_its_file(home: Path, key: str, file: str, rule: str):
    got = found(key, home)
    models = home / ".lmstudio" / "models"
    assert (got.model, got.rule, got.folder) == (str(models / file), rule, str(models))
    assert (got.mmproj is None) == ("gemma" not in file)


def test_an_absolute_path_a_projector_and_exact(home: Path):
    models = home / ".lmstudio" / "models"
    absolute = found(str(models / QWEN / QWEN_FILE), home, "--exact")
    assert absolute.model == str(models / QWEN / QWEN_FILE) and absolute.rule == "path"
    gemma = found("gemma-3-27b-it", home)
    assert gemma.mmproj == str(models / "unsloth" / "gemma-3-27b-it-GGUF" / "mmproj-F16.gguf")
    taken = r"--exact takes a model's path publisher/repo/file\.gguf"
    with pytest.raises(ModelFileError, match=taken):
        found("qwen3-30b-a3b", home, "--exact")


def test_a_moved_downloads_folder_the_home_pointer_and_older_installs(tmp_path: Path):
    # settings.json moves the models; the pointer moves LM Studio's home; LMSTUDIO_HOME wins.
    moved = tmp_path / "data" / "models"
    tiny(moved / "pub" / "Moved-GGUF", "Moved-Q4_K_M")
    h = tmp_path / "h1"
    (h / ".lmstudio").mkdir(parents=True)
    (h / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": str(moved)}))
    assert found("moved", h).model == str(moved / "pub" / "Moved-GGUF" / "Moved-Q4_K_M.gguf")

    elsewhere = tmp_path / "elsewhere"
    tiny(elsewhere / "models" / "pub" / "There-GGUF", "There-Q4_K_M")
    h2 = tmp_path / "h2"
    h2.mkdir()
    (h2 / ".lmstudio-home-pointer").write_text(f"{elsewhere}\n")
    assert found("there", h2).folder == str(elsewhere / "models")

    h3 = tmp_path / "h3"
    tiny(h3 / ".cache" / "lm-studio" / "models" / "pub" / "Old-GGUF", "Old-Q4_K_M")
    assert found("old", h3).folder == str(h3 / ".cache" / "lm-studio" / "models")
    assert found("there", h3, env={"LMSTUDIO_HOME": str(elsewhere)}).folder == str(
        elsewhere / "models"
    )

    # What lms itself falls back from: no downloadsFolder, one that is not a string.
    for settings in ("{}", '{"downloadsFolder": 7}', "not json", "[" * 100_000):
        (h / ".lmstudio" / "settings.json").write_text(settings)
        gone = f"{h}/.lmstudio/models: cannot open: No such file"
        with pytest.raises(ModelFileError, match=gone):
            found("moved", h)
    # And what it would not: a relative folder, '..', a relative pointer.
    (h / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": "models"}))
    with pytest.raises(ModelFileError, match="downloadsFolder: 'models': not an absolute path"):
        found("moved", h)
    (h / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": "/a/../b"}))
    with pytest.raises(ModelFileError, match=r"'\.\.' is not followed"):
        found("moved", h)
    (h2 / ".lmstudio-home-pointer").write_text("lmstudio")
    relative = "lmstudio-home-pointer: 'lmstudio': not an absolute path"
    with pytest.raises(ModelFileError, match=relative):
        found("there", h2)


def test_an_ambiguous_key_is_unknown_and_names_its_candidates_capped(tmp_path: Path, home: Path):
    for publisher in "abcdefg":
        tiny(tmp_path / ".lmstudio" / "models" / publisher / "same-GGUF", "same-Q4_K_M")
    with pytest.raises(ModelFileError) as e:
        found("same", tmp_path)
    assert str(e.value) == (
        "model key 'same' matches 7 models (by name): a/same-GGUF, b/same-GGUF, c/same-GGUF,"
        " d/same-GGUF, e/same-GGUF and 2 more; which one lms loads is not known"
    )
    with pytest.raises(
        ModelFileError, match=r"holds 2 GGUF models \(Multi-Q4_K_M\.gguf, Multi-Q8_0\.gguf\)"
    ):
        found("lmstudio-community/multi", home)
    with pytest.raises(ModelFileError, match=r"matches 2 models \(by lms's fuzzy match\): "):
        found("3b", home)  # qwen3-30b-a3b and gemma-3-27b-it
    with pytest.raises(
        ModelFileError, match=r"model key 'nothing-like-it': no GGUF model in .* matches"
    ):
        found("nothing-like-it", home)
    # The MLX folder of the hub's second source has no GGUF: not a candidate.
    assert found("qwen/qwen3-30b-a3b", home).model.endswith(QWEN_FILE)


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("../../etc/passwd", "'..' is not followed"),
        ("pub/../../x.gguf", "'..' is not followed"),
        ("$MODEL", "it comes from the shell, not known here"),
        ("x" * 2000, "not a model key"),
        ("/etc/shadow.gguf", "not in LM Studio's models folder"),
        ("a/b/c/d", "neither publisher/repo nor a path to a .gguf"),
        ("a/b/c/d.gguf", "a model's path is publisher/repo/file.gguf"),
        ("pub/", "'' is not a folder or file name"),
    ],
)
def test_hostile_keys_are_refused(home: Path, key: str, said: str):
    with pytest.raises(ModelFileError, match=f"^(model key )?'.*{said}|{said}"):
        found(key, home)


def test_fifos_and_huge_files_are_refused_at_once(tmp_path: Path):
    h = tmp_path / "h"
    lm = h / ".lmstudio"
    repo = lm / "models" / "pub" / "Fifo-GGUF"
    repo.mkdir(parents=True)
    os.mkfifo(repo / "Fifo-Q4_K_M.gguf")  # no writer, ever
    t = time.monotonic()
    p = predict(h, "fifo")
    assert p.bytes is None and p.source.endswith(f"{repo}/Fifo-Q4_K_M.gguf: not a regular file")
    p = predict(h, "pub/Fifo-GGUF/Fifo-Q4_K_M.gguf")
    assert p.source.endswith("Fifo-Q4_K_M.gguf: not a regular file")
    os.mkfifo(lm / "settings.json")
    assert predict(h, "fifo").source == f"lms load fifo: {lm}/settings.json: not a regular file"
    os.unlink(lm / "settings.json")
    with open(lm / "settings.json", "wb") as f:  # sparse: 1 GiB to a reader, nothing on disk
        f.truncate(1 << 30)
    assert predict(h, "fifo").source == (
        f"lms load fifo: {lm}/settings.json: over {lmstudio.MAX_SETTINGS} bytes"
        " (LM Studio's own are a few kB)"
    )
    config = lm / ".internal" / "user-concrete-model-default-config" / "pub" / "Fifo-GGUF"
    config.mkdir(parents=True)
    os.unlink(lm / "settings.json")
    os.mkfifo(config / "Fifo-Q4_K_M.gguf.json")
    assert predict(h, "fifo").source.endswith("Fifo-Q4_K_M.gguf.json: not a regular file")
    assert time.monotonic() - t < 5


def test_a_search_past_its_deadline_ends(home: Path):
    load = client_load(["lms", "load", "qwen3-30b-a3b"])
    assert load is not None
    with pytest.raises(ModelTimeout, match="LM Studio's folders read past the deadline"):
        resolve(load, str(home), deadline=time.monotonic() - 1)


def test_a_folder_too_big_to_search_is_said_so(tmp_path: Path):
    models = tmp_path / ".lmstudio" / "models"
    many = models / "pub"
    many.mkdir(parents=True)
    for i in range(lmstudio.MAX_ENTRIES + 1):
        (many / f"r{i}").mkdir()
    with pytest.raises(ModelFileError, match=f"{many}: over {lmstudio.MAX_ENTRIES} entries"):
        found("r1", tmp_path)


def test_symlinks_to_one_folder_are_listed_once_and_the_walk_has_a_total_budget(tmp_path: Path):
    """Her models folder: 4,095 publisher symlinks to one folder of 4,095 files. Each link
    was listed and kept on its own (928 MiB); a folder reached again is not followed, and
    a walk lists at most MAX_TOTAL_ENTRIES entries in all."""
    import tracemalloc

    models = tmp_path / ".lmstudio" / "models"
    target = tmp_path / "flat"
    target.mkdir()
    models.mkdir(parents=True)
    for i in range(lmstudio.MAX_ENTRIES - 1):
        (target / f"f{i:04}").touch()
        (models / f"p{i:04}").symlink_to(target)
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError, match=r"no GGUF model in .* matches it") as said:
            found("zzzz", tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "entries listed in all" not in str(said.value)
    assert peak < 16 * 2**20, peak  # one listing of each, not 4,095 of the same

    # Distinct folders: the budget ends the walk, and says so.
    wide = tmp_path / "wide" / ".lmstudio" / "models"
    for p in range(5):
        for r in range(lmstudio.MAX_TOTAL_ENTRIES // 4):
            (wide / f"pub{p}" / f"r{r}").mkdir(parents=True)
    with pytest.raises(ModelFileError, match=f"over {lmstudio.MAX_TOTAL_ENTRIES} entries listed"):
        found("zzzz", tmp_path / "wide")


# --- the footprint ----------------------------------------------------------------------------


def test_the_prediction_is_the_estimate_of_the_same_file_and_settings(tmp_path: Path):
    models = lay_out(tmp_path)
    qwen = read_model(str(models / QWEN / QWEN_FILE))
    defaults = Settings(n_ctx=4096, n_parallel=4, kv_unified=True, flash_attn="off", n_ubatch=512)
    p = predict(tmp_path, "qwen/qwen3-30b-a3b", "-y")
    assert p.bytes == estimate(qwen, defaults).total
    assert p.source == (
        f"lms load qwen/qwen3-30b-a3b → {models / QWEN / QWEN_FILE} (by its hub model.yaml),"
        f" ctx 4096 (LM Studio's default): {format_size(p.bytes)}"
    )
    assert p.spec is not None and p.spec.kind == "lmstudio" and p.spec.settings == defaults

    # The model's own config in LM Studio, as the app writes it; the command line wins.
    config = tmp_path / ".lmstudio" / ".internal" / "user-concrete-model-default-config" / QWEN
    config.mkdir(parents=True)
    fields = [
        {"key": "llm.load.contextLength", "value": 16384},
        {"key": "llm.load.numParallelSessions", "value": 1},
        {"key": "llm.load.llama.flashAttention", "value": True},
        {
            "key": "llm.load.llama.kCacheQuantizationType",
            "value": {"checked": True, "value": "q8_0"},
        },
        {
            "key": "llm.load.llama.vCacheQuantizationType",
            "value": {"checked": False, "value": "q4_0"},
        },
        {"key": "llm.load.llama.physicalBatchSize", "value": 1024},
        {"key": "llm.load.useUnifiedKvCache", "value": "yes"},  # not a boolean: left out
        {"key": "llm.prediction.temperature", "value": 0.2},
    ]
    (config / f"{QWEN_FILE}.json").write_text(
        json.dumps({"preset": "", "operation": {"fields": []}, "load": {"fields": fields}})
    )
    configured = Settings(
        n_ctx=16384,
        n_parallel=1,
        kv_unified=True,
        cache_type_k="q8_0",
        flash_attn="on",
        n_ubatch=1024,
    )
    p = predict(tmp_path, "qwen3-30b-a3b")
    assert p.bytes == estimate(qwen, configured).total
    assert "ctx 16384 (the model's LM Studio config)" in p.source
    assert p.spec is not None and any("useUnifiedKvCache 'yes' left out" in n for n in p.spec.notes)
    p = predict(tmp_path, "qwen3-30b-a3b", "--context-length", "40960", "--parallel", "2")
    wider = dataclasses.replace(configured, n_ctx=40960, n_parallel=2)
    assert p.bytes == estimate(qwen, wider).total and "ctx 40960 (--context-length)" in p.source

    # A vision model: its projector beside it is loaded too.
    gemma = models / "unsloth" / "gemma-3-27b-it-GGUF"
    projector = read_model(str(gemma / "mmproj-F16.gguf")).tensor_bytes
    with_projector = dataclasses.replace(defaults, mmproj_bytes=projector)
    p = predict(tmp_path, "gemma-3-27b-it", "--gpu", "off")
    model = read_model(str(gemma / "gemma-3-27b-it-Q4_K_M.gguf"))
    assert p.bytes == estimate(model, with_projector).total
    assert p.spec is not None and p.spec.notes[0].startswith("--gpu off: where the layers go")

    # A split model: every shard's weights.
    p = predict(tmp_path, "bartowski/big")
    big = read_model(str(models / "bartowski" / "Big-GGUF" / "Big-Q4_K_M-00001-of-00003.gguf"))
    assert big.shards == 3 and p.bytes == estimate(big, defaults).total


def test_asking_never_waits(home: Path):
    load = client_load(["lms", "load", "qwen3-30b-a3b"])
    assert load is not None
    predictor = Predictor()
    t = time.monotonic()
    first = lmstudio.predict(predictor, load, MEM_TOTAL, owner=None, home=str(home), wait=False)
    assert time.monotonic() - t < 0.1
    assert first.bytes is not None or first == Prediction(None, PENDING, pending=True)
    give_up = time.monotonic() + 10
    while True:
        p = lmstudio.predict(predictor, load, MEM_TOTAL, owner=None, home=str(home), wait=False)
        if not p.pending:
            break
        assert time.monotonic() < give_up
        time.sleep(0.02)
    assert p.bytes is not None and "(by name), ctx 4096" in p.source


# --- as a real unprivileged user ----------------------------------------------------------------


@pytest.mark.root
def test_her_symlinks_to_root_only_places_tell_her_nothing(mallory: User, public_dir: Path):
    # Root's models: a folder only root may enter, in a folder anyone may search.
    vault = public_dir / "vault"
    tiny(vault / "Secret-GGUF", "Secret-Q4_K_M")
    vault.chmod(0o700)
    shadow = public_dir / "shadow.json"
    shadow.write_text(json.dumps({"downloadsFolder": str(vault)}))
    shadow.chmod(0o600)
    # Her LM Studio: one model of her own; symlinks to root's places and to nowhere.
    models = mallory.home / ".lmstudio" / "models"
    tiny(models / "her" / "Mine-GGUF", "Mine-Q4_K_M")
    (models / "her" / "secret-GGUF").symlink_to(vault / "Secret-GGUF")
    (models / "her" / "absent-GGUF").symlink_to(public_dir / "absent")
    (models / "root").symlink_to(vault)
    (models / "nothing").symlink_to(public_dir / "nothing")
    subprocess.run(["chown", "-hR", f"{mallory.uid}:{mallory.gid}", str(mallory.home)], check=True)

    def said(*argv: str) -> str:
        return predict(mallory.home, *argv, owner=mallory.uid).source

    # Root itself tells them apart: the test is not blind.
    root_sees = predict(mallory.home, "her/secret")
    assert root_sees.bytes is not None and "(by name), ctx 4096" in root_sees.source
    # Her own model, with her rights; a settings.json she cannot read is as good as none.
    mallory.sh(f"ln -s {shadow} ~/.lmstudio/settings.json")
    assert said("mine").startswith(f"lms load mine → {models}/her/Mine-GGUF/Mine-Q4_K_M.gguf")
    # A folder she cannot enter and one that is not there: the same answer.
    nothing = f"no GGUF model in {models} matches it"
    assert said("her/secret") == f"lms load her/secret: model key 'her/secret': {nothing}"
    assert said("her/absent") == f"lms load her/absent: model key 'her/absent': {nothing}"
    assert said("root/secret") == f"lms load root/secret: model key 'root/secret': {nothing}"
    assert said("nothing/secret") == (
        f"lms load nothing/secret: model key 'nothing/secret': {nothing}"
    )
    # A file she cannot open and one that is not there: the same answer, the reader's.
    unreadable = f"cannot open the model (missing, or unreadable to uid {mallory.uid})"
    for key in ("root/Secret-GGUF/Secret-Q4_K_M.gguf", "root/Secret-GGUF/Absent.gguf"):
        assert said(key) == f"lms load {key} → {models}/{key} (path): {models}/{key}: {unreadable}"
    # And her models folder itself, moved to root's vault: the reader's one answer.
    mallory.sh("rm ~/.lmstudio/settings.json")
    mallory.sh(f'echo \'{{"downloadsFolder": "{vault}"}}\' > ~/.lmstudio/settings.json')
    assert said("secret") == f"lms load secret: {vault}: {unreadable}"
    mallory.sh(f'echo \'{{"downloadsFolder": "{public_dir}/absent"}}\' > ~/.lmstudio/settings.json')
    assert said("secret") == f"lms load secret: {public_dir}/absent: {unreadable}"


def test_a_speculative_draft_model_is_found_and_counted(tmp_path: Path):
    """`lms load qwen3-30b-a3b --speculative-draft-model gemma-3-27b-it`: the draft is a key
    of the same models folder, found the same way, and counted as llama.cpp makes a
    draft's context (the main one's settings, f16 KV); before, it was "not counted". A
    draft key that finds nothing is said, and no footprint is made up."""
    models = lay_out(tmp_path)
    p = predict(tmp_path, "qwen/qwen3-30b-a3b", "-y", "--speculative-draft-model", "gemma-3-27b-it")
    assert p.bytes is not None and p.spec is not None and p.estimate is not None, p.source
    draft = models / "unsloth" / "gemma-3-27b-it-GGUF" / "gemma-3-27b-it-Q4_K_M.gguf"
    assert p.spec.draft == str(draft)
    alone = predict(tmp_path, "qwen/qwen3-30b-a3b", "-y")
    assert alone.bytes is not None
    d = read_model(str(draft))
    terms = {t.name: t.bytes for t in p.estimate.terms}
    assert p.spec.draft_settings is not None
    kv = {t.name: t.bytes for t in estimate(d, p.spec.draft_settings).terms}["kv"]
    assert terms["draft"] == d.tensor_bytes + kv
    assert p.bytes > alone.bytes + terms["draft"]
    assert "with draft gemma-3-27b-it-Q4_K_M.gguf, ctx 4096" in p.source
    gone = predict(tmp_path, "qwen/qwen3-30b-a3b", "-y", "--speculative-draft-model", "nothing")
    assert gone.bytes is None and "--speculative-draft-model" in gone.source, gone.source
