"""Foresight on a real user manager: a loader stopped at its start job, by its model's header.

The loaders run a stand-in `llama-server` (lab/fake_loader.py behind the
real binary's name and flags), so the guard reads their command lines as it
reads a real server's, and sparse model files with the metadata of real
models give the estimate something real to chew on.
"""

from __future__ import annotations

import json
import time

import pytest

from lab import LAB, synth
from lab.guardunit import GUARD, PY, guard_manager, restart_guard, wait_log, write_config
from tests import data

pytestmark = pytest.mark.systemd


@pytest.fixture(scope="module")
def um():
    with guard_manager() as manager:
        bin_dir = manager.base / "bin"
        bin_dir.mkdir()
        server = bin_dir / "llama-server"
        server.write_text(f'#!/bin/sh\nexec {PY} {LAB}/fake_loader.py --alloc 20 "$@"\n')
        server.chmod(0o755)
        manager.server = server  # type: ignore[attr-defined]
        manager.deepseek = synth.write(synth.SPECS["deepseek-v3"], manager.base / "models")  # type: ignore[attr-defined]
        yield manager


def test_a_loader_is_stopped_at_its_start_job_before_it_runs(um):
    write_config(um)  # no [loaders.footprint]: the estimate alone decides
    restart_guard(um)
    um.write_unit("slow-prereq.service", "[Service]\nType=oneshot\nExecStart=/bin/sleep 4\n")
    um.write_unit(
        "llama-ds3.service",
        f"""[Unit]
Wants=slow-prereq.service
After=slow-prereq.service
[Service]
ExecStart={um.server} -m {um.deepseek} -c 32768 -np 1
Restart=always
""",
    )
    offset = len(um.log.read_text())
    um.systemctl("start", "--no-block", "llama-ds3.service")
    seen = wait_log(
        um, r"^info loader-seen: model loader user:0:llama-ds3.service.*$", after=offset
    )
    assert "starting=True" in seen.group(0) and "expected_from=estimate" in seen.group(0)
    decision = wait_log(um, r"^warning decision: stop user:0:llama-ds3.service: .*$", after=offset)
    assert "reason=footprint" in decision.group(0) and "unit_rss=0" in decision.group(0)
    wait_log(um, r"^warning unit-blocked: user:0:llama-ds3.service", after=offset)
    props = um.show(
        "llama-ds3.service", "ActiveState", "LoadState", "ExecMainStartTimestampMonotonic"
    )
    assert props == {
        "ActiveState": "inactive",
        "LoadState": "masked",
        "ExecMainStartTimestampMonotonic": "0",  # its process never started
    }
    record = json.loads((um.base / "state/blocked/user:0:llama-ds3.service.json").read_text())
    assert record["figures"]["expected"] > 200 * 1024**3  # 220 GiB of Q2_K weights and more
    out = um.systemctl("status", "llama-ds3.service", check=False).stdout
    assert "Loaded: masked" in out


def test_a_loader_whose_model_cannot_be_read_is_reported_and_left_to_the_trend(um):
    write_config(um)
    offset = restart_guard(um)
    corrupt = um.base / "models" / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 4096)
    um.write_unit(
        "llama-lost.service",
        f"[Service]\nExecStart={um.server} -m {corrupt}\nRestart=on-failure\n",
    )
    um.systemctl("start", "llama-lost.service")
    m = wait_log(um, r"^warning footprint-unknown: .*$", after=offset)
    assert m.group(0).startswith(
        "warning footprint-unknown: footprint of user:0:llama-lost.service unknown "
        f"({corrupt}: at byte 16: tensor count 18446744073709551615 cannot fit in the 4088 "
        "bytes left); guarded by the trend, and during boot by [boot] unsized."
    )
    time.sleep(1.0)
    assert um.show("llama-lost.service", "ActiveState")["ActiveState"] == "active"
    assert um.show(GUARD, "ActiveState")["ActiveState"] == "active"
    um.systemctl("stop", "llama-lost.service")


def test_preflight_as_exec_start_pre_lets_a_fitting_load_start_and_refuses_one_that_does_not(um):
    write_config(um)
    um.systemctl("stop", GUARD)  # preflight alone decides here
    pre = f"ExecStartPre={PY} -m spark_guard preflight %n --config {um.base}/guard.toml\n"
    um.write_unit(
        "small-model.service",
        f"[Service]\n{pre}ExecStart={um.server} -m {data.smollm2()} -c 2048\n",
    )
    um.write_unit(
        "huge-model.service",
        f"[Service]\n{pre}ExecStart={um.server} -m {um.deepseek} -c 32768\n",
    )
    um.systemctl("start", "small-model.service")
    um.wait_for("small-model.service", "ActiveState", "active")
    refused = um.systemctl("start", "huge-model.service", check=False)
    assert refused.returncode != 0
    props = um.show(
        "huge-model.service", "ActiveState", "Result", "ExecMainStartTimestampMonotonic"
    )
    assert props == {
        "ActiveState": "failed",
        "Result": "exit-code",
        "ExecMainStartTimestampMonotonic": "0",
    }
    assert "verdict: does NOT fit" in um.log.read_text()
    um.systemctl("stop", "small-model.service")
    um.systemctl("reset-failed", "huge-model.service")
