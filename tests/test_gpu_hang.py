"""A GPU that fell off the bus: NVML calls that never return, under the real guard.

The guard runs as a Type=notify unit of a harness user manager, with a short
WatchdogSec=, through tests/nvml_guard.py: libnvidia-ml.so.1 is replaced at
the C boundary (pynvml.nvmlLib) by tests/fake_nvml.py, whose nvmlInit or
per-process query blocks for good, as a driver call does after an Xid 79.
The real pynvml binding and the guard's own code run unchanged.

Before NVML was asked off the loop, a hung call held the loop: no WATCHDOG=1,
a watchdog kill after WatchdogSec=, a restart, and the same hang at the first
pass of the next run (or no READY=1 at all, for a hung nvmlInit). Checked by
hand with `[gpu] deadline = "1h"`, which waits as the old loop did: NRestarts=3
within 12 s with WatchdogSec=3s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lab.guardunit import GUARD, PY, guard_manager, loader_unit, log_text, wait_log, write_config

pytestmark = pytest.mark.systemd

TESTS = Path(__file__).parent
WATCHDOG = 3.0  # WatchdogSec=: a loop held for longer is killed


@pytest.fixture(scope="module")
def um():
    with guard_manager() as manager:
        yield manager


def nvml_guard(um, spec: str) -> int:
    """The guard's unit, run over the fake NVML of `spec` (tests/nvml_guard.py); restarted.
    Returns the log offset of the new run."""
    um.write_unit(
        GUARD,
        f"""[Unit]
Description=spark-guard under test, with a fake NVML

[Service]
Type=notify
NotifyAccess=main
ExecStart={PY} {TESTS}/nvml_guard.py {spec} -- run --config {um.base}/guard.toml --log console
WatchdogSec={WATCHDOG:g}s
Environment=PYTHONUNBUFFERED=1
""",
    )
    offset = len(log_text(um))
    um.systemctl("restart", GUARD)  # Type=notify: returns once READY=1 came
    return offset


def calls(um) -> list[str]:
    path = um.base / "nvml-calls"
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize(
    ("spec", "hung_call"),
    [
        ("hang-after=3", "nvmlDeviceGetComputeRunningProcesses"),  # mid-run
        ("hang-init", "nvmlInit"),  # at start, before READY=1
    ],
)
def test_a_hung_nvml_call_holds_neither_the_loop_nor_the_watchdog(um, spec, hung_call):
    (um.base / "nvml-calls").unlink(missing_ok=True)
    unit = f"llama-big-{hung_call.lower()}.service"
    write_config(um, f'[loaders.footprint]\n"{unit}" = "100TiB"\n[gpu]\ndeadline = "500ms"\n')
    offset = nvml_guard(um, f"{spec},pid=1:1073741824,calls={um.base}/nvml-calls")
    assert um.show(GUARD, "ActiveState")["ActiveState"] == "active"  # READY=1 came
    m = wait_log(um, r"^warning gpu-hung: .*$", after=offset)
    hung_at = time.monotonic()
    assert f"NVML has not answered {hung_call} within 0.5s" in m.group(0)
    # The loop goes on: an over-budget loader started now is stopped, masked, disabled.
    loader_unit(um, unit, 50)
    um.systemctl("start", unit)
    wait_log(um, rf"^warning unit-blocked: user:0:{unit}", after=offset)
    um.wait_for(unit, "LoadState", "masked")
    # ... and pings the watchdog: three of its periods pass without a kill or a restart.
    time.sleep(max(0.0, hung_at + 3 * WATCHDOG - time.monotonic()))
    props = um.show(GUARD, "ActiveState", "SubState", "NRestarts", "Result")
    assert props == {
        "ActiveState": "active",
        "SubState": "running",
        "NRestarts": "0",
        "Result": "success",
    }, log_text(um)[offset:][-3000:]
    text = log_text(um)[offset:]
    assert text.count("gpu-hung") == 1  # one event per hang, not one per pass
    # No call piles up behind the hung one: one thread, one call out.
    seen = calls(um)
    assert seen.count(hung_call if hung_call == "nvmlInit" else "processes") == (
        1 if hung_call == "nvmlInit" else 4
    ), seen
    # The published state says the figures are stale; with a hung init there are none.
    state = json.loads((um.base / "run" / "state.json").read_text())
    assert state["gpu_stale"] is True
    assert state["gpu_accounting"] is (hung_call != "nvmlInit")
    # A hung NVML does not hold the stop either. Every NVML call after the hung one waits
    # in C behind it (as behind the driver's lock): a guard that shut NVML down on its way
    # out would be held there until TimeoutStopSec= (Result=timeout).
    um.systemctl("stop", GUARD)
    assert um.show(GUARD, "Result")["Result"] == "success"


def test_a_missing_driver_is_retried_and_said_once(um):
    # The retry every 200 ms: in 2 s about ten attempts, and still one warning.
    (um.base / "nvml-calls").unlink(missing_ok=True)
    write_config(um, '[gpu]\nretry = "200ms"\n')
    offset = nvml_guard(um, f"driver-not-loaded,calls={um.base}/nvml-calls")
    time.sleep(2.0)
    assert calls(um).count("nvmlInit") >= 5, calls(um)
    text = log_text(um)[offset:]
    assert text.count("gpu-accounting-off") == 1, text[-3000:]
    assert "the NVIDIA kernel driver is not loaded" in text
    assert um.show(GUARD, "ActiveState")["ActiveState"] == "active"
