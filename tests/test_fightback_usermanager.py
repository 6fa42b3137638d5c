"""A stop that fights back, on a real user manager: the settle is a state, and memory escalates it.

The loader catches SIGTERM and goes on (a handler that does nothing: its
SIGTERM is caught, not ignored, so nothing but time or memory says it will
not stop). The Blocker acts for real through the manager's private socket;
MemAvailable comes from a /proc whose meminfo the test writes (the guard's
`paths.proc`), so the test says when memory is short. This host has no
cgroup v2 freezer (hybrid cgroups): FreezeUnit is refused and noted, and the
stop goes out alone, as on such machines.
"""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from lab.guardunit import PY, guard_manager
from spark_guard import log
from spark_guard.block.blocker import QUICK_SETTLE, Blocker
from spark_guard.core.config import Config
from spark_guard.core.snapshot import Action, Decision, Phase, Reason, UnitRef
from spark_guard.system.managers import Manager

pytestmark = pytest.mark.systemd

MiB = 1024**2
CATCHER = (
    "[Service]\nExecStart={py} -c 'import signal, time; "
    "signal.signal(signal.SIGTERM, lambda *a: None); time.sleep(3600)'\n"
)


@pytest.fixture(scope="module")
def um():
    with guard_manager() as manager:
        yield manager


def meminfo(proc, available_mib: int) -> None:
    (proc / "meminfo").write_text(
        f"MemTotal: {4096 * 1024} kB\nMemAvailable: {available_mib * 1024} kB\n"
    )


def test_a_pending_stop_is_a_state_and_memory_below_the_reserve_escalates_it(um, tmp_path):
    unit = "llama-catcher.service"
    um.write_unit(unit, CATCHER.format(py=PY))
    um.systemctl("start", unit)
    um.wait_for(unit, "ActiveState", "active")
    time.sleep(0.5)  # its handler is installed
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "sys" / "kernel" / "random").mkdir(parents=True)
    (proc / "sys" / "kernel" / "random" / "boot_id").write_text("test\n")
    meminfo(proc, 1024)
    config = Config(
        state=str(tmp_path / "state"),
        motd=str(tmp_path / "motd"),
        issue=str(tmp_path / "issue"),
        proc=str(proc),
        reserve=200 * MiB,
        reserve_percent=0.0,
        stop_timeout=30.0,
        kill_timeout=30.0,
        user_runtime=str(um.user_runtime),
    )
    manager = Manager("user:0", str(um.socket))
    manager.connect()
    log.configure("console")
    blocker = Blocker({"user:0": manager}, config, log.get_logger())
    ref = UnitRef("user:0", unit)
    action = Action("stop", ref, Reason.TREND, "test", {})
    try:
        with capture_logs() as events:
            began = time.monotonic()
            blocker.block([action], Decision(Phase.STRICT, 200 * MiB, (), (action,)))
            took = time.monotonic() - began
            # It did not stop: block() came back after its first look, not at the timeouts.
            assert took < QUICK_SETTLE + 1.0, took
            assert blocker.records[str(ref)].step == "settle"
            assert blocker.settling
            assert um.show(unit, "ActiveState")["ActiveState"] == "deactivating"
            for _ in range(5):  # passes of the loop: memory is fine, nothing is escalated
                blocker.advance()
            assert not any(e["event"] == "unit-killed" for e in events)
            meminfo(proc, 150)  # below the reserve, with the stop still pending
            blocker.advance()
            killed = [e for e in events if e["event"] == "unit-killed"]
            assert killed and killed[0]["how"] == "KillUnit SIGKILL", events
            assert "below the reserve" in killed[0]["error"], killed
            deadline = time.monotonic() + 10
            while blocker.settling and time.monotonic() < deadline:
                time.sleep(0.05)
                blocker.advance()
            blocker.advance()
        record = blocker.records[str(ref)]
        assert record.step == "blocked", record.history
        notes = [what for _, what in record.history]
        assert any(n.startswith("not frozen: ") for n in notes), notes  # no freezer here
        assert any("below the reserve" in n for n in notes), notes
        assert um.show(unit, "LoadState")["LoadState"] == "masked"
    finally:
        manager.close()
        (um.runtime / "systemd" / "user.control" / unit).unlink(missing_ok=True)
        um.systemctl("daemon-reload")
        um.systemctl("reset-failed", unit, check=False)
