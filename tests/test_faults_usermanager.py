"""Faults the guard survives, on the real daemon under a real user manager.

The guard runs with the shipped unit's restart and stop settings (units/spark-guard.
service), and each test breaks something under it: what an admin would check
afterwards is that the guard is alive, never restarted, and the loader stopped.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from lab.guardunit import (
    GUARD,
    PY,
    guard_manager,
    loader_unit,
    restart_guard,
    wait_log,
    write_config,
)
from lab.harness import UserManager, file_tree
from tests.test_unit_file import unit_settings

pytestmark = pytest.mark.systemd

SHIPPED = ("Restart", "RestartSec", "TimeoutStopSec", "TimeoutAbortSec")


@pytest.fixture(scope="module")
def um():
    with guard_manager() as manager:
        s = unit_settings()
        service = "".join(f"{k}={s[f'Service.{k}'][0]}\n" for k in SHIPPED)
        unit = f"StartLimitIntervalSec={s['Unit.StartLimitIntervalSec'][0]}\n"
        drop_in = manager.unit_dir / f"{GUARD}.d"
        drop_in.mkdir()
        (drop_in / "shipped.conf").write_text(f"[Unit]\n{unit}[Service]\n{service}")
        manager.systemctl("daemon-reload")
        yield manager


def state_on_a_small_tmpfs(um: UserManager, name: str) -> tuple[str, Path, Path]:
    """A 256 KiB tmpfs, mounted in the manager's namespace (where the guard runs), made the
    guard's state directory: (the manager's pid for nsenter, the directory, the config)."""
    state = um.base / name
    state.mkdir()
    assert um.proc is not None
    pid = str(um.proc.pid)
    mount = ["nsenter", "-t", pid, "-m", "mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs"]
    subprocess.run([*mount, str(state)], check=True)
    config = um.base / "guard.toml"
    config.write_text(config.read_text().replace(f'"{um.base}/state"', f'"{state}"'))
    return pid, state, config


def test_a_read_only_state_dir_costs_the_record_not_the_guard(um):
    """Before: RecordStore.lock() raised, the daemon exited, Restart= brought it back into
    the same fault and the loader it had recorded started and stayed up."""
    write_config(um, '[loaders.footprint]\n"llama-ro.service" = "100TiB"\n')
    state = um.base / "state"
    (state / "blocked").mkdir(parents=True, exist_ok=True)
    # No lock file yet: one made before would still open (read-only) and lock.
    (state / "lock").unlink(missing_ok=True)
    # Read-only in the manager's mount namespace, where the guard runs.
    pid = str(um.proc.pid)
    for args in (["--bind", str(state), str(state)], ["-o", "remount,ro,bind", str(state)]):
        subprocess.run(["nsenter", "-t", pid, "-m", "mount", *args], check=True)
    try:
        offset = restart_guard(um)
        loader_unit(um, "llama-ro.service", 50)
        um.systemctl("start", "llama-ro.service")
        wait_log(um, r"state-busy: cannot lock .*state: Read-only file system", after=offset)
        um.wait_for("llama-ro.service", "ActiveState", "inactive")
        time.sleep(3)  # passes go on: none of them may end the guard
        shown = um.show(GUARD, "ActiveState", "NRestarts", "MainPID")
        assert (shown["ActiveState"], shown["NRestarts"]) == ("active", "0"), shown
        assert um.show("llama-ro.service", "ActiveState")["ActiveState"] != "active"
    finally:
        # Writable again for the tests after this one (the guard's state is theirs too).
        subprocess.run(["nsenter", "-t", pid, "-m", "umount", str(state)], check=False)
        um.systemctl("stop", "llama-ro.service")


def test_a_release_on_a_full_disk_changes_nothing_and_says_so_in_one_line(um):
    """Before: retire() failed after the unmask and the restored links, an OSError ended
    `release --all` with a traceback, and the next pass masked the unit again."""
    write_config(um, '[loaders.footprint]\n"llama-rel.service" = "100TiB"\n')
    pid, state, config = state_on_a_small_tmpfs(um, "state-rel")
    loader_unit(um, "llama-rel.service", 30, wanted_by="default.target", Restart="always")
    um.systemctl("enable", "llama-rel.service")
    watched = um.home / ".config" / "systemd"
    before = file_tree(watched)
    offset = restart_guard(um)
    um.systemctl("start", "llama-rel.service")
    wait_log(um, r"unit-blocked: user:0:llama-rel.service is stopped, masked", after=offset)
    blocked = file_tree(watched)
    fill = f"cat /dev/zero > {state}/filler || true"
    subprocess.run(["nsenter", "-t", pid, "-m", "sh", "-c", fill], check=True)

    def release() -> subprocess.CompletedProcess[str]:
        cmd = [PY, "-m", "spark_guard", "release", "--all", "--config", str(config)]
        return subprocess.run(
            ["nsenter", "-t", pid, "-m", *cmd], capture_output=True, text=True, timeout=60
        )

    out = release()
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (line,) = [ln for ln in out.stderr.splitlines() if "llama-rel" in ln]
    assert "not released, its archive cannot be written" in line
    assert line.endswith("nothing was changed")
    time.sleep(1)  # a pass or two: nothing to lay again, nothing was taken off
    assert file_tree(watched) == blocked
    assert um.show("llama-rel.service", "LoadState")["LoadState"] == "masked"
    subprocess.run(["nsenter", "-t", pid, "-m", "rm", f"{state}/filler"], check=True)
    out = release()
    assert out.returncode == 0, out.stderr
    assert file_tree(watched) == before


def test_a_full_disk_stops_the_loader_but_changes_no_file_until_the_record_is_written(um):
    """Before: the plan could not be saved, disable and mask ran anyway, the record was never
    written even once space was back, and `release` said "not blocked"."""
    write_config(um, '[loaders.footprint]\n"llama-full.service" = "100TiB"\n')
    pid, state, config = state_on_a_small_tmpfs(um, "state-full")
    fill = f"mkdir -p {state}/blocked && (cat /dev/zero > {state}/filler || true)"
    subprocess.run(["nsenter", "-t", pid, "-m", "sh", "-c", fill], check=True)
    loader_unit(um, "llama-full.service", 30, wanted_by="default.target", Restart="always")
    um.systemctl("enable", "llama-full.service")
    watched = um.home / ".config" / "systemd"
    before = file_tree(watched)
    offset = restart_guard(um)
    um.systemctl("start", "llama-full.service")
    wait_log(um, r"block-failed: user:0:llama-full.service: cannot write .*", after=offset)
    # Stopped (the stop changes no file) and kept stopped; nothing else changed.
    um.wait_for("llama-full.service", "ActiveState", "inactive")
    time.sleep(2)
    assert um.show("llama-full.service", "ActiveState")["ActiveState"] != "active"
    assert file_tree(watched) == before  # still enabled: no link removed, none on record
    assert um.show("llama-full.service", "LoadState")["LoadState"] == "loaded"  # no mask
    assert um.show(GUARD, "NRestarts")["NRestarts"] == "0"
    # Space again: the record is written first, then the block completes.
    subprocess.run(["nsenter", "-t", pid, "-m", "rm", f"{state}/filler"], check=True)
    wait_log(um, r"unit-blocked: user:0:llama-full.service is stopped, masked", after=offset)
    path = state / "blocked" / "user:0:llama-full.service.json"  # on the manager's tmpfs
    cat = ["nsenter", "-t", pid, "-m", "cat", str(path)]
    record = json.loads(subprocess.run(cat, capture_output=True, text=True, check=True).stdout)
    assert record["step"] == "blocked" and [lr["removed"] for lr in record["links"]] == [True]
    release = [PY, "-m", "spark_guard", "release", "llama-full", "--config", str(config)]
    out = subprocess.run(
        ["nsenter", "-t", pid, "-m", *release],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert file_tree(watched) == before


def test_a_rescue_racing_the_daemon_leaves_one_complete_record_that_undoes_exactly(um):
    """`spark-guard rescue` run the moment a loader starts, while the daemon blocks the same
    unit: both plan, disable and mask it. What an admin checks after: the guard alive and
    never restarted, the loader stopped and masked, one record that names the link the
    disable removed and the mask it laid, and a release that puts the files back exactly."""
    write_config(um, '[loaders.footprint]\n"llama-race.service" = "100TiB"\n')
    loader_unit(um, "llama-race.service", 30, wanted_by="default.target", Restart="always")
    um.systemctl("enable", "llama-race.service")
    watched = um.home / ".config" / "systemd"
    before = file_tree(watched)
    offset = restart_guard(um)
    config = str(um.base / "guard.toml")
    um.systemctl("start", "--no-block", "llama-race.service")
    rescue = subprocess.run(
        [PY, "-m", "spark_guard", "rescue", "--config", config],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rescue.returncode == 0, rescue.stdout + rescue.stderr
    wait_log(um, r"unit-blocked: user:0:llama-race.service", after=offset)
    um.wait_for("llama-race.service", "LoadState", "masked")
    assert um.show("llama-race.service", "ActiveState")["ActiveState"] != "active"
    assert um.show(GUARD, "NRestarts", "ActiveState") == {"NRestarts": "0", "ActiveState": "active"}
    path = um.base / "state" / "blocked" / "user:0:llama-race.service.json"
    record = json.loads(path.read_text())
    assert record["step"] == "blocked", record
    assert record["mask_made"] is True and record["mask_path"].endswith("/llama-race.service")
    links = [(lr["path"], lr["removed"]) for lr in record["links"]]
    link = watched / "user" / "default.target.wants" / "llama-race.service"
    assert links == [(str(link), True)], links
    # (rescue blocks every loader there is: the earlier tests' too, whose units are still
    # enabled; --all puts them all back.)
    out = subprocess.run(
        [PY, "-m", "spark_guard", "release", "--all", "--config", config],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert file_tree(watched) == before
    assert um.show("llama-race.service", "UnitFileState")["UnitFileState"] == "enabled"
