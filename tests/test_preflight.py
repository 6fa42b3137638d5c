"""`spark-guard preflight`: the verdict on files, against a /proc whose memory the test sets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import synth
import testdata

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
    assert "MemAvailable 100.0GiB - reserve 9.0GiB - other loaders still loading 0B" in out.stdout
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
    assert result["room"] == 100 * GiB - result["reserve"] - result["pending"]
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


def test_a_missing_or_corrupt_model_is_one_clear_line_and_exit_two(machine, tmp_path):
    out = preflight(machine, str(tmp_path / "gone.gguf"))
    assert out.returncode == 2
    assert out.stderr == (
        f"spark-guard: {tmp_path}/gone.gguf: footprint unknown: "
        f"{tmp_path}/gone.gguf: No such file or directory\n"
    )
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    out = preflight(machine, str(bad))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "unknown GGUF version" in out.stderr


def test_a_real_small_model_fits(machine):
    out = preflight(machine, str(testdata.smollm2()), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["n_ctx"] == 8192  # -c 0: SmolLM2's trained context
