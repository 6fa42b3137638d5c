"""Faults the guard survives, on the real daemon under a real user manager.

The guard runs with the shipped unit's restart and stop settings (units/spark-guard.
service), and each test breaks something under it: what an admin would check
afterwards is that the guard is alive, never restarted, and the loader stopped.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from lab.guardunit import (
    GUARD,
    guard_manager,
    loader_unit,
    restart_guard,
    wait_log,
    write_config,
)
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


def test_a_read_only_state_dir_costs_the_record_not_the_guard(um):
    """Before: RecordStore.lock() raised, the daemon exited, Restart= brought it back into
    the same fault and the loader it had recorded started and stayed up."""
    write_config(um, '[loaders.footprint]\n"llama-ro.service" = "100TiB"\n')
    state = um.base / "state"
    (state / "blocked").mkdir(parents=True, exist_ok=True)
    # Read-only in the manager's mount namespace, where the guard runs.
    pid = str(um.proc.pid)
    for args in (["--bind", str(state), str(state)], ["-o", "remount,ro,bind", str(state)]):
        subprocess.run(["nsenter", "-t", pid, "-m", "mount", *args], check=True)
    offset = restart_guard(um)
    loader_unit(um, "llama-ro.service", 50)
    um.systemctl("start", "llama-ro.service")
    wait_log(um, r"state-busy: cannot lock .*state: Read-only file system", after=offset)
    um.wait_for("llama-ro.service", "ActiveState", "inactive")
    time.sleep(3)  # passes go on: none of them may end the guard
    shown = um.show(GUARD, "ActiveState", "NRestarts", "MainPID")
    assert (shown["ActiveState"], shown["NRestarts"]) == ("active", "0"), shown
    assert um.show("llama-ro.service", "ActiveState")["ActiveState"] != "active"
