"""The admin's toolkit on a real user manager: audit, harden, status, rescue.

Loader units are spread over ~/.config/systemd/user and ~/.local/share,
one is a template instance with an escaped name, one is known only by its
ExecStart, two load the same model, and one unit has failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time

import pytest

from lab import LAB
from lab.guardunit import GUARD, PY, guard_manager, restart_guard, write_config
from lab.harness import UserManager
from tests.jsonschemas import check

pytestmark = pytest.mark.systemd

ODD = "llama@models-qwen3\\x2d32b.service"  # systemd-escape for .../qwen3-32b


@pytest.fixture(scope="module")
def um():
    with guard_manager() as manager:
        server = manager.base / "bin" / "llama-server"
        server.parent.mkdir()
        server.write_text(f'#!/bin/sh\nexec {PY} {LAB}/fake_loader.py --alloc 10 "$@"\n')
        server.chmod(0o755)
        model = manager.base / "models" / "shared.gguf"
        model.write_bytes(b"GGUF")
        unit = f"[Service]\nExecStart={server} -m {model} -c 4096\nRestart=always\n"
        install = "[Install]\nWantedBy=default.target\n"
        manager.write_unit("llama-conf.service", unit + install)
        manager.write_unit("llama-data.service", unit + install, data_dir=True)
        manager.write_unit(
            "llama@.service", f"[Service]\nExecStart={server} -m /models/%I.gguf\n{install}"
        )
        other = manager.base / "models" / "other.gguf"
        other.write_bytes(b"GGUF")
        manager.write_unit("worker-7.service", f"[Service]\nExecStart={server} -m {other}\n")
        manager.write_unit("broken.service", "[Service]\nExecStart=/bin/false\n")
        manager.systemctl("enable", "llama-conf.service", "llama-data.service", ODD)
        manager.systemctl("start", "broken.service", check=False)
        # The units this module's tests expect to be loaders, carried on the manager (as
        # guard_manager() carries .models): not an attribute UserManager declares.
        manager.loaders = [  # type: ignore[attr-defined]
            "llama-conf.service",
            "llama-data.service",
            ODD,
            "worker-7.service",
        ]
        yield manager


def cli(um: UserManager, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "spark_guard", *args, "--config", str(um.base / "guard.toml")],
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


def test_audit_finds_every_loader_the_duplicate_the_failed_unit_and_a_missing_name(um):
    write_config(um)
    um.systemctl("stop", GUARD)
    out = cli(um, "audit", "nope.service", "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    check(report, "audit")  # with loaders, failed units and findings of every kind
    assert sorted(u["unit"] for u in report["loaders"]) == sorted(f"user:0:{n}" for n in um.loaders)
    odd = next(u for u in report["loaders"] if u["unit"] == f"user:0:{ODD}")
    assert odd["file_state"] == "enabled"
    findings = {(f["code"], f["unit"]) for f in report["findings"]}
    assert ("duplicate", "user:0:llama-data.service") in findings
    assert ("failed", "user:0:broken.service") in findings
    assert ("no-such-unit", "nope.service") in findings
    assert ("restart-storm", "user:0:llama-conf.service") in findings
    assert ("no-memory-max", "user:0:worker-7.service") in findings
    duplicate = next(f for f in report["findings"] if f["code"] == "duplicate")
    assert duplicate["severity"] == "critical"
    assert duplicate["fix"] == "systemctl --user -M root@ disable --now llama-data.service"
    assert set(report["accounting"]) >= {"used", "rss", "gpu", "kernel", "gap", "probably"}
    assert report["mem_total"] > report["mem_available"] > 0
    # On a terminal: tables and one finding per line with its fix.
    text = cli(um, "audit").stdout
    assert "model loaders:" in text and f"user:0:{ODD}" in text
    assert "CRITICAL duplicate" in text and "fix: systemctl --user -M root@ disable" in text


def test_harden_writes_a_drop_in_that_loads_and_undo_removes_it(um):
    write_config(um)
    unit_file = um.unit_dir / "llama-conf.service"
    before = hashlib.sha256(unit_file.read_bytes()).hexdigest()
    dry = cli(um, "harden", "user:0:llama-conf.service", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    drop_in = um.unit_dir / "llama-conf.service.d" / "50-spark-guard.conf"
    assert f"+++ {drop_in}" in dry.stdout and not drop_in.exists()
    assert "GPU allocations are not charged to the cgroup" in dry.stdout
    asked = cli(um, "harden", "user:0:llama-conf.service")  # no terminal, no --yes
    assert asked.returncode == 2 and "add --yes" in asked.stderr and not drop_in.exists()

    done = cli(um, "harden", "user:0:llama-conf.service", "--yes")
    assert done.returncode == 0, done.stderr
    props = um.show(
        "llama-conf.service",
        "MemoryMax",
        "OOMScoreAdjust",
        "StartLimitBurst",
        "StartLimitIntervalUSec",
        "RestartUSec",
        "Nice",
        "DropInPaths",
        "After",
    )
    assert props["DropInPaths"] == str(drop_in)
    assert (props["OOMScoreAdjust"], props["StartLimitBurst"], props["Nice"]) == ("800", "3", "10")
    assert props["StartLimitIntervalUSec"] == "15min" and props["RestartUSec"] == "30s"
    assert int(props["MemoryMax"]) > 0 and "ssh.service" in props["After"]
    assert hashlib.sha256(unit_file.read_bytes()).hexdigest() == before  # never edited
    again = cli(um, "harden", "user:0:llama-conf.service", "--yes")
    assert again.stdout.endswith("already in place\n")

    undo = cli(um, "harden", "user:0:llama-conf.service", "--undo")
    assert undo.returncode == 0, undo.stderr
    assert not drop_in.parent.exists()
    assert um.show("llama-conf.service", "OOMScoreAdjust")["OOMScoreAdjust"] == "0"


def test_harden_writes_nothing_it_cannot_record_first(um):
    # Its records cannot be written (here a file where the directory goes; on a real
    # machine a full /var/lib): the drop-in is never written, so nothing is left that
    # harden --undo could not take back.
    write_config(um)
    hardened = um.base / "state" / "hardened"
    hardened.parent.mkdir(exist_ok=True)
    if hardened.is_dir():
        hardened.rmdir()  # (emptied by the undo of the test before)
    hardened.write_text("not a directory\n")
    try:
        out = cli(um, "harden", "user:0:worker-7.service", "--yes")
        assert out.returncode == 2, out.stdout + out.stderr
        assert str(hardened) in out.stderr and out.stderr.count("\n") == 1, out.stderr
        assert not (um.unit_dir / "worker-7.service.d").exists()
        assert um.show("worker-7.service", "DropInPaths")["DropInPaths"] == ""
    finally:
        hardened.unlink()


def test_harden_leaves_a_drop_in_it_did_not_write(um):
    write_config(um)
    theirs = um.unit_dir / "worker-7.service.d" / "50-spark-guard.conf"
    theirs.parent.mkdir()
    theirs.write_text("[Service]\nNice=5\n")
    out = cli(um, "harden", "user:0:worker-7.service", "--yes")
    assert out.returncode == 2
    assert out.stderr == (
        f"spark-guard: {theirs} exists and spark-guard did not write it; leaving it alone\n"
    )
    assert theirs.read_text() == "[Service]\nNice=5\n"
    theirs.unlink()
    theirs.parent.rmdir()
    missing = cli(um, "harden", "user:0:nope.service", "--yes")
    assert (
        missing.returncode == 2
        and missing.stderr == "spark-guard: user:0:nope.service: no such unit\n"
    )


def test_status_shows_what_the_running_guard_published(um):
    write_config(um)
    restart_guard(um)
    um.systemctl("start", "worker-7.service")
    deadline = time.monotonic() + 20
    while True:
        out = cli(um, "status", "--json")
        state = json.loads(out.stdout) if out.stdout else {}
        if any(ld["unit"] == "user:0:worker-7.service" for ld in state.get("loaders", [])):
            break
        assert time.monotonic() < deadline, out
        time.sleep(0.2)
    assert out.returncode == 0 and state["alive"] is True and state["phase"] == "strict"
    check(state, "status")  # a running guard's, with a loader in it
    worker = next(ld for ld in state["loaders"] if ld["unit"] == "user:0:worker-7.service")
    assert worker["expected"] is None and "other.gguf" in worker["prediction"]
    text = cli(um, "status").stdout
    assert text.startswith("spark-guard: running (pid ") and "user:0:worker-7.service" in text
    um.systemctl("stop", GUARD, "worker-7.service")
    dead = cli(um, "status")
    assert dead.returncode == 3 and "NOT RUNNING" in dead.stdout  # systemctl's 3


def test_rescue_stops_and_blocks_every_loader_and_release_undoes_it(um):
    write_config(um)
    um.systemctl("stop", GUARD)
    um.systemctl("start", "llama-conf.service", "llama-data.service", ODD, "worker-7.service")
    out = cli(um, "rescue")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in um.loaders:
        props = um.show(name, "ActiveState", "LoadState")
        assert props["LoadState"] == "masked", (name, props)
        assert props["ActiveState"] in ("inactive", "failed"), (name, props)  # not running
        assert f"user:0:{name}" in out.stdout
    assert "MemAvailable" in out.stdout and "load average" in out.stdout
    running = um.systemctl("list-units", "--state=running", "--no-legend", "--plain").stdout
    assert not any(n in running for n in um.loaders)
    records = sorted(os.listdir(um.base / "state" / "blocked"))
    assert records == sorted(f"user:0:{n}.json" for n in um.loaders)
    undo = cli(um, "release", "--all")
    assert undo.returncode == 0, undo.stderr
    for name in ("llama-conf.service", "llama-data.service", ODD):
        assert um.show(name, "LoadState", "UnitFileState") == {
            "LoadState": "loaded",
            "UnitFileState": "enabled",
        }
