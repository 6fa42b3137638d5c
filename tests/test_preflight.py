"""`spark-guard preflight`: the verdict on files, against a /proc whose memory the test sets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lab import synth
from tests import data

GiB = 1024**3


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """A 128 GiB machine with 100 GiB available, as the guard's /proc reader sees it."""
    d = tmp_path_factory.mktemp("preflight")
    proc = d / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(
        f"MemTotal: {128 * GiB // 1024} kB\nMemFree: 1 kB\nMemAvailable: {100 * GiB // 1024} kB\n"
    )
    (d / "guard.toml").write_text(
        f'[paths]\nproc = "{proc}"\nsystem_manager = "/nonexistent"\nuser_runtime = "{d}/run"\n'
        "[gpu]\nenabled = false\n"
    )
    models = d / "models"
    models.mkdir()
    for key in ("qwen3-30b-a3b", "deepseek-v3", "gemma-3-27b"):
        synth.write(synth.SPECS[key], models)
    return d


def preflight(machine, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_guard",
            "preflight",
            *args,
            "--config",
            str(machine / "guard.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_model_that_fits_exits_zero_and_shows_its_terms(machine):
    out = preflight(
        machine, str(machine / "models" / "Qwen3-30B-A3B.gguf"), "-c", "4096", "-np", "1"
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        f"{machine}/models/Qwen3-30B-A3B.gguf: Qwen3-30B-A3B.gguf, ctx 4096: "
    )
    assert lines[1].split()[:3] == ["weights", "56.9GiB", "exact"]
    assert lines[2].split()[:3] == ["kv", "384.0MiB", "exact"]
    assert lines[3].split()[2] == "approx" and lines[4].split()[2] == "approx"
    # No manager in this fake machine: the other loaders are not counted, and it says so.
    assert (
        "MemAvailable 100.0GiB - reserve 9.0GiB - other loaders still loading (not counted"
        in out.stdout
    )
    assert lines[-1].startswith("verdict: fits (")


def test_a_model_that_does_not_fit_exits_one_and_says_by_how_much(machine):
    first = machine / "models" / "DeepSeek-V3.gguf"
    out = preflight(machine, str(first), "-c", "32768", "--json")
    assert out.returncode == 1, out.stderr
    result = json.loads(out.stdout)
    assert result["fits"] is False and result["n_ctx"] == 32768
    assert [t["name"] for t in result["terms"]] == ["weights", "kv", "compute", "host", "margin"]
    kv = next(t for t in result["terms"] if t["name"] == "kv")
    assert kv["bytes"] == 61 * 32768 * 576 * 2 and kv["exact"] is True
    assert result["pending"] is None  # no manager here: not counted, not 0
    assert result["room"] == 100 * GiB - result["reserve"]
    assert result["total"] > result["room"]


def test_settings_on_the_command_line_change_the_estimate(machine):
    gemma = str(machine / "models" / "Gemma-3-27B.gguf")
    small = json.loads(preflight(machine, gemma, "-c", "32768", "--json").stdout)
    full = json.loads(preflight(machine, gemma, "-c", "32768", "--swa-full", "--json").stdout)
    kv_small = next(t["bytes"] for t in small["terms"] if t["name"] == "kv")
    kv_full = next(t["bytes"] for t in full["terms"] if t["name"] == "kv")
    row = 16 * 128 * 2 * 2  # Gemma-3-27B: 16 KV heads x 128 x (K + V) x f16
    # llama-server's defaults for a bare file: 4 slots on one unified cache.
    assert kv_small == (10 * 32768 + 52 * (4 * 1024 + 512)) * row
    assert kv_full == 62 * 32768 * row


def test_a_missing_corrupt_or_truncated_model_is_one_clear_line_and_exit_four(machine, tmp_path):
    """ "Cannot say" is 4, not argparse's 2: an ExecStartPre= tells a typo from an unknown
    footprint. A download cut short (the header whole, the tensors past the end) is an
    error, never "weights exact ... fits"."""
    out = preflight(machine, str(tmp_path / "gone.gguf"))
    assert out.returncode == 4
    assert out.stderr == (
        f"spark-guard: {tmp_path}/gone.gguf: footprint unknown: "
        f"{tmp_path}/gone.gguf: No such file or directory\n"
    )
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    out = preflight(machine, str(bad))
    assert out.returncode == 4 and out.stderr.count("\n") == 1
    assert "unknown GGUF version" in out.stderr
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data.smollm2().read_bytes()[: 3 * 2**20])
    out = preflight(machine, str(cut))
    assert out.returncode == 4 and out.stderr.count("\n") == 1, out.stderr
    assert "truncated: tensor" in out.stderr and "a download cut short?" in out.stderr
    typo = preflight(machine, str(cut), "-c", "-1")
    assert typo.returncode == 2 and "-c/--ctx: -1: must be from 0 to" in typo.stderr
    for flag in ("-np", "-ub"):
        zero = preflight(machine, str(cut), flag, "0")
        assert zero.returncode == 2 and "must be from 1" in zero.stderr, zero.stderr


def test_a_real_small_model_fits(machine):
    out = preflight(machine, str(data.smollm2()), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["n_ctx"] == 8192  # -c 0: SmolLM2's trained context


def test_the_verdict_counts_only_what_the_guard_would_let_grow():
    """preflight's room is decide()'s: a loader the guard is refusing (it would not fit)
    adds nothing to what is pending, an admitted one adds what it still has to take."""
    from spark_guard.core.config import Config
    from spark_guard.core.policy import decide
    from spark_guard.core.snapshot import Memory, RescueGroup, SeenUnit, Snapshot, UnitRef
    from spark_guard.tools.preflight import verdict

    def loading(name, since, rss, expected):
        return SeenUnit(
            UnitRef("system", name),
            pids=(1,),
            rss=rss,
            exec_start=(("llama-server", "-m", f"/m/{name}.gguf"),),
            active_since=since,
            predicted=expected,
        )

    admitted = loading("llama-a.service", 1.0, 10 * GiB, 40 * GiB)  # 30 GiB still to come
    refused = loading("llama-b.service", 2.0, GiB, 90 * GiB)  # would not fit after it
    snapshot = Snapshot(
        now=5.0,
        memory=Memory(128 * GiB, 100 * GiB),
        units=(admitted, refused),
        rescue=(RescueGroup(("ssh.service",), True, None),),
    )
    decision = decide(snapshot, Config())
    assert [(a.unit.name, a.reason) for a in decision.actions] == [("llama-b.service", "footprint")]
    v = verdict(50 * GiB, snapshot, decision)
    assert v.pending == 30 * GiB  # not 30 + 89: llama-b is being stopped, not loading
    reserve = Config().reserve_for(128 * GiB)
    assert v.fits and v.room == 100 * GiB - reserve - 30 * GiB
    # The unit asked about is not pending against itself.
    assert verdict(50 * GiB, snapshot, decision, itself=admitted.ref).pending == 0


def test_the_rule_and_the_server_a_client_is_charged_to_are_shown(tmp_path, capsys):
    """preflight prints the rule a figure comes from (the prediction's source, the defaults
    the spec took, its notes) and, for a client unit, the server unit its load is charged
    to, as decide() would charge it; the same in --json."""
    from spark_guard.core.argv.loadspec import parse
    from spark_guard.core.config import Config
    from spark_guard.core.policy import decide
    from spark_guard.core.snapshot import Memory, RescueGroup, SeenUnit, Snapshot, UnitRef
    from spark_guard.foresight.predict import Prediction, Predictor
    from spark_guard.tools import preflight_cli
    from spark_guard.tools.preflight import verdict

    model = synth.write(synth.SPECS["qwen3-30b-a3b"], tmp_path)
    spec = parse(["koboldcpp", str(model), "--gpulayers", "99"])
    assert spec is not None
    pred = Predictor().for_spec(spec, 128 * GiB)
    server = SeenUnit(
        UnitRef("user:1000", "lmstudio-server.service"),
        pids=(7,),
        exec_start=(("lms", "server", "start"),),
    )
    snapshot = Snapshot(
        now=5.0,
        memory=Memory(128 * GiB, 100 * GiB),
        units=(server,),
        rescue=(RescueGroup(("ssh.service",), True, None),),
    )
    decision = decide(snapshot, Config())
    v = verdict(pred.bytes or 0, snapshot, decision)
    preflight_cli._print("kobold.service", pred, v)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kobold.service: koboldcpp Qwen3-30B-A3B.gguf, ctx 8448: ")
    assert out[0].endswith(
        "(--contextsize 8192 (koboldcpp's default); flash attention on (its "
        "default); + 128 cells koboldcpp adds)"
    )
    assert out[1] == "  note: --gpulayers 99: one memory pool, so the total does not depend on it"
    report = preflight_cli._as_json("kobold.service", pred, v, None)
    assert report["rule"] == {
        "kind": "llama.cpp",
        "binary": "koboldcpp",
        "defaults": spec.rule,
        "notes": list(spec.notes),
    }
    assert report["charged_to"] is None and report["client_of"] is None

    # A client (the incident's lms-load.service, a system unit running as uid 1000): its
    # load is charged to that user's LM Studio server; with none running, to itself.
    client = UnitRef("system", "lms-load.service")
    lms = [("/bin/sh", "-c", "sleep 60; lms load qwen/qwen3-30b-a3b")]
    asked = Prediction(20 * GiB, "lms load qwen/qwen3-30b-a3b → ...", runs_as=1000)
    charge = preflight_cli._charge(client, lms, asked, decision, Config())
    assert charge == preflight_cli.Charge("lmstudio", server.ref)
    preflight_cli._print(str(client), asked, v, charge)
    shown = capsys.readouterr().out.splitlines()
    assert shown[1] == (
        "  a client of lmstudio: its load lands in user:1000:lmstudio-server.service's process "
        "and is charged to that unit (the one the guard refuses or blocks)"
    )
    report = preflight_cli._as_json(str(client), asked, v, charge)
    assert (report["client_of"], report["charged_to"]) == (
        "lmstudio",
        "user:1000:lmstudio-server.service",
    )
    alone = decide(replace_units(snapshot), Config())
    assert preflight_cli._charge(client, lms, asked, alone, Config()) == preflight_cli.Charge(
        "lmstudio", None
    )
    # A unit that asks nothing is no client.
    assert preflight_cli._charge(client, [("llama-server",)], asked, decision, Config()) is None


def replace_units(snapshot, *units):
    from dataclasses import replace

    return replace(snapshot, units=units)


# --- --make-room: root only, only where the config allows, and only what is needed ---------


def _unified_machine(d, *, free_gib: float, make_room: bool = True) -> None:
    """A 128 GiB unified-memory machine: MemFree `free_gib`, 90 GiB of clean page cache,
    all of MemFree in 4 MiB blocks; its sys/vm files are plain files here, so what
    make-room writes can be read back."""
    proc = d / "proc"
    (proc / "sys" / "vm").mkdir(parents=True)
    kib = {
        "MemTotal": 128 * GiB,
        "MemFree": int(free_gib * GiB),
        "MemAvailable": 100 * GiB,
        "Active(file)": 40 * GiB,
        "Inactive(file)": 50 * GiB,
        "Dirty": 0,
        "Writeback": 0,
        "Shmem": 0,
        "Mapped": 0,
        "SwapTotal": 0,
    }
    (proc / "meminfo").write_text("".join(f"{k}: {v // 1024} kB\n" for k, v in kib.items()))
    blocks = int(free_gib * GiB) // (4 * 2**20)  # order 10 with 4 KiB pages
    (proc / "buddyinfo").write_text(f"Node 0, zone   Normal {'0 ' * 10}{blocks}\n")
    for name in ("drop_caches", "compact_memory"):
        (proc / "sys" / "vm" / name).write_text("")
    (d / "cgroup").mkdir()  # no memory.reclaim: drop_caches it is (there is no swap)
    (d / "guard.toml").write_text(
        f'[paths]\nproc = "{proc}"\ncgroup = "{d}/cgroup"\nsystem_manager = "/nonexistent"\n'
        f'user_runtime = "{d}/run"\n[gpu]\nenabled = false\n'
        f'[memory]\nunified = "yes"\nmake_room = {str(make_room).lower()}\n'
    )
    synth.write(synth.SPECS["gpt-oss-20b"], d).rename(d / "model.gguf")


def _written(d) -> dict[str, str]:
    vm = d / "proc" / "sys" / "vm"
    return {name: (vm / name).read_text() for name in ("drop_caches", "compact_memory")}


@pytest.mark.root
def test_make_room_drops_cache_as_root_only_where_the_config_allows_it(public_dir, mallory):
    d = public_dir / "low"
    d.mkdir()
    _unified_machine(d, free_gib=2)
    argv = [sys.executable, "-m", "spark_guard", "preflight", "--make-room"]
    model = "model.gguf"
    args = [str(d / model), "-c", "4096", "--config", str(d / "guard.toml")]
    # Mallory cannot make the machine drop its page cache: refused, judged without it.
    her = mallory.run(*argv, *args, check=False)
    assert "--make-room: only root makes room" in her.stderr, her.stderr
    assert "Traceback" not in her.stderr
    assert _written(d) == {"drop_caches": "", "compact_memory": ""}
    # Root: the clean cache the load and the floor need is dropped, then compacted.
    out = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60)
    assert "make-room: reclaimed page cache (drop_caches) and compacted" in out.stdout, (
        out.stdout + out.stderr
    )
    assert _written(d) == {"drop_caches": "1", "compact_memory": "1"}

    # [memory] make_room = false: nothing is written, and it says why.
    off = public_dir / "off"
    off.mkdir()
    _unified_machine(off, free_gib=2, make_room=False)
    out = subprocess.run(
        [*argv, str(off / model), "--config", str(off / "guard.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--make-room: [memory] make_room = false: no room made" in out.stderr, out.stderr
    assert _written(off) == {"drop_caches": "", "compact_memory": ""}

    # MemFree covers the load and the floor, in large blocks: nothing to do, nothing moved.
    calm = public_dir / "calm"
    calm.mkdir()
    _unified_machine(calm, free_gib=100)
    out = subprocess.run(
        [*argv, str(calm / model), "-c", "4096", "--config", str(calm / "guard.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--make-room: nothing to do" in out.stderr, out.stdout + out.stderr
    assert _written(calm) == {"drop_caches": "", "compact_memory": ""}
