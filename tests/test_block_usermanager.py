"""Blocks that hold, on a real user manager: stop, mask, disable, verify, record, release.

The guard runs as a Type=notify unit of a harness `systemd --user` and acts on
enabled loader units with Restart=always, wherever their unit files live. The
checks are the ones an admin makes: `systemctl status` says masked, a start
is refused, nothing comes back, and `spark-guard release` leaves every unit
file and link byte for byte as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import pytest

from lab.guardunit import (
    GUARD,
    PY,
    guard_manager,
    loader_unit,
    log_text,
    restart_guard,
    wait_log,
    write_config,
)
from lab.harness import UserManager, file_tree
from spark_guard.system import cgroupfs
from spark_guard.system.procfs import ProcFS

pytestmark = pytest.mark.systemd

FOOTPRINT = '[loaders.footprint]\n"llama*" = "100TiB"\n'


@pytest.fixture(scope="module")
def um():
    with guard_manager() as manager:
        yield manager


def guard_cli(um: UserManager, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "spark_guard", *args, "--config", str(um.base / "guard.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def record_of(um: UserManager, unit: str) -> dict:
    return json.loads((um.base / "state" / "blocked" / f"user:0:{unit}.json").read_text())


def test_block_holds_wherever_the_unit_file_lives_and_release_undoes_it_exactly(um):
    write_config(um, FOOTPRINT)
    um.systemctl("stop", GUARD)
    # One loader per place a user unit lives, and a template instance; all enabled,
    # all Restart=always: the layout that wedges a machine at boot.
    loader_unit(um, "llama-conf.service", 30, wanted_by="default.target", Restart="always")
    loader_unit(
        um, "llama-data.service", 30, data_dir=True, wanted_by="default.target", Restart="always"
    )
    loader_unit(um, "llama@.service", 30, wanted_by="default.target", Restart="always")
    units = ["llama-conf.service", "llama-data.service", "llama@qwen.service"]
    # And a timer that starts one of them again every second.
    um.write_unit(
        "llama-conf.timer",
        "[Timer]\nOnActiveSec=1s\nOnUnitActiveSec=1s\nAccuracySec=10ms\nUnit=llama-conf.service\n",
    )
    um.systemctl("enable", *units)
    um.systemctl("start", *units, "llama-conf.timer")
    for unit in units:
        um.wait_for(unit, "ActiveState", "active")
    watched = (um.home / ".config" / "systemd", um.home / ".local" / "share" / "systemd")
    before = file_tree(*watched)
    assert any(k.endswith("default.target.wants/llama-data.service") for k in before)

    offset = restart_guard(um)
    for unit in units:
        wait_log(um, rf"^warning unit-blocked: user:0:{unit} is stopped, masked", after=offset)
    for unit in units:
        props = um.show(unit, "ActiveState", "LoadState", "UnitFileState", "NRestarts")
        assert props["ActiveState"] == "inactive", (unit, props)
        assert props["LoadState"] == "masked", (unit, props)
        assert props["UnitFileState"] == "masked-runtime", (unit, props)
        status = um.systemctl("status", unit, check=False).stdout
        assert "Loaded: masked" in status, status
        refused = um.systemctl("start", unit, check=False)
        assert refused.returncode != 0 and "is masked" in refused.stderr, refused
    restarts = {u: um.show(u, "NRestarts")["NRestarts"] for u in units}
    time.sleep(2.0)  # Restart=always and the timer had their chances
    for unit in units:
        assert um.show(unit, "ActiveState", "NRestarts") == {
            "ActiveState": "inactive",
            "NRestarts": restarts[unit],
        }
    # Disabled: the enablement links are gone, the unit files untouched.
    wants = um.home / ".config/systemd/user/default.target.wants"
    assert not any((wants / u).is_symlink() for u in units)
    assert (um.unit_dir / "llama-conf.service").is_file()
    assert (um.data_unit_dir / "llama-data.service").is_file()

    # The record says what was done, why, and exactly which links went.
    record = record_of(um, "llama-data.service")
    assert record["step"] == "blocked" and record["reason"] == "footprint"
    assert record["figures"]["expected"] == 100 * 1024**4
    assert record["mask_path"] == str(um.runtime / "systemd/user.control/llama-data.service")
    assert record["mask_made"] is True
    assert [(ln["path"], ln["target"], ln["removed"]) for ln in record["links"]] == [
        (str(wants / "llama-data.service"), str(um.data_unit_dir / "llama-data.service"), True)
    ]
    done = [what for _, what in record["history"]]
    assert done[0].startswith("stop requested") and done[-1] == "verified: LoadState=masked"
    # The rescue instructions are at the login prompt.
    motd = (um.base / "motd.d" / "spark-guard").read_text()
    for unit in units:
        assert f"user:0:{unit}  blocked since" in motd
    assert "spark-guard release UNIT" in motd
    assert (um.base / "issue").read_text() == motd

    # Release one by its bare name, then the rest (the timer is done with).
    um.systemctl("stop", "llama-conf.timer")
    out = guard_cli(um, "release", "llama-conf")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "released user:0:llama-conf.service: mask removed, 1 link(s) restored\n"
    assert "llama-conf.service" not in (um.base / "motd.d" / "spark-guard").read_text()
    out = guard_cli(um, "release", "--all")
    assert out.returncode == 0, out.stderr
    assert file_tree(*watched) == before  # byte for byte, owners and modes too
    assert not list((um.runtime / "systemd" / "user.control").iterdir())
    assert not (um.base / "motd.d" / "spark-guard").exists()
    assert not (um.base / "issue").exists()
    assert len(list((um.base / "state" / "released").iterdir())) == 3
    for unit in units:
        props = um.show(unit, "LoadState", "UnitFileState")
        assert props == {"LoadState": "loaded", "UnitFileState": "enabled"}, (unit, props)
    # Released means released: the guard leaves it alone when it no longer threatens.
    write_config(um)
    um.systemctl("reload", GUARD)
    um.systemctl("start", "llama-conf.service")
    um.wait_for("llama-conf.service", "ActiveState", "active")
    um.systemctl("stop", "llama-conf.service")


def test_release_of_a_unit_never_blocked_is_a_clear_error(um):
    write_config(um)
    out = guard_cli(um, "release", "nope.service")
    assert out.returncode == 1
    assert out.stderr == (
        f"spark-guard: nope.service: not blocked by spark-guard "
        f"(no record in {um.base}/state/blocked)\n"
    )
    out = guard_cli(um, "release")
    assert out.returncode == 2 and "name the units to release, or --all" in out.stderr


def test_a_unit_that_ignores_sigterm_is_killed_and_a_crashed_guard_resumes(um):
    write_config(um, FOOTPRINT + '[guard]\nstop_timeout = "3s"\nkill_timeout = "1s"\n')
    um.systemctl("stop", GUARD)
    loader_unit(um, "llama-stubborn.service", 20, ignore_term=True, wanted_by="default.target")
    um.systemctl("enable", "--now", "llama-stubborn.service")
    um.wait_for("llama-stubborn.service", "ActiveState", "active")
    offset = restart_guard(um, wait=False)
    wait_log(um, r"^warning unit-stop-requested: stopping user:0:llama-stubborn", after=offset)
    time.sleep(0.5)  # in the wait for the stop, past the record's 'settle' step
    # The guard dies while it waits for the stop: the record on disk names the next step.
    um.systemctl("kill", "--signal=KILL", GUARD)
    um.wait_for(GUARD, "ActiveState", "failed")
    assert record_of(um, "llama-stubborn.service")["step"] == "settle"
    assert um.show("llama-stubborn.service", "ActiveState")["ActiveState"] == "deactivating"

    offset = restart_guard(um)
    m = wait_log(um, r"^warning unit-killed: .*llama-stubborn.*$", after=offset)
    assert "how='KillUnit SIGKILL'" in m.group(0)
    wait_log(um, r"^warning unit-blocked: user:0:llama-stubborn.service", after=offset)
    props = um.show("llama-stubborn.service", "ActiveState", "LoadState")
    assert props == {"ActiveState": "failed", "LoadState": "masked"} or props == {
        "ActiveState": "inactive",
        "LoadState": "masked",
    }
    record = record_of(um, "llama-stubborn.service")
    done = [what for _, what in record["history"]]
    # The restarted guard goes on from the stop's clock on record: no second stop, and the
    # kill follows stop_timeout after the first one, not after a new one.
    assert sum(w.startswith("stop requested") for w in done) == 1
    assert "it did not stop within 3s" in m.group(0)
    assert any(w.startswith("killed: KillUnit SIGKILL (") for w in done)
    assert record["step"] == "blocked" and record["links"][0]["removed"] is True
    assert guard_cli(um, "release", "llama-stubborn").returncode == 0


def test_a_mask_that_disappears_is_laid_again(um):
    write_config(um, FOOTPRINT)
    loader_unit(um, "llama-again.service", 20)
    um.systemctl("start", "llama-again.service")
    offset = restart_guard(um)
    wait_log(um, r"^warning unit-blocked: user:0:llama-again.service", after=offset)
    # What a reboot or a restart of the user's manager does to /run: the mask is gone.
    mask = um.runtime / "systemd" / "user.control" / "llama-again.service"
    mask.unlink()
    um.systemctl("daemon-reload")
    renewed = wait_log(
        um, r"^warning block-renewed: laying the mask on user:0:llama-again", after=offset
    )
    # The event is said as the mask is laid again, not after: it lands a moment later.
    deadline = time.monotonic() + 10
    while not mask.is_symlink() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mask.is_symlink() and os.readlink(mask) == "/dev/null"
    um.wait_for("llama-again.service", "LoadState", "masked")
    time.sleep(0.5)
    # The unit was not running: renewing its mask stops nothing and says so in the record.
    after = log_text(um)[offset + renewed.end() :]
    assert "stopping user:0:llama-again" not in after and "stopped after" not in after
    record = json.loads(
        (um.base / "state" / "blocked" / "user:0:llama-again.service.json").read_text()
    )
    notes = [what for _, what in record["history"]]
    renewal = max(i for i, what in enumerate(notes) if what.startswith("mask gone"))
    assert "not running" in notes[renewal:], notes
    assert guard_cli(um, "release", "llama-again").returncode == 0
    assert "block-failed" not in log_text(um)[offset:]


def test_cgroup_kill_reaches_the_units_processes_and_no_others(um):
    for name in ("victim.service", "bystander.service"):
        um.write_unit(name, "[Service]\nExecStart=/bin/sh -c 'sleep infinity & sleep infinity'\n")
        um.systemctl("start", name)
        um.wait_for(name, "ActiveState", "active")
    pid = int(um.show("victim.service", "MainPID")["MainPID"])
    cgroup = ProcFS().cgroup(pid)
    assert cgroup is not None and cgroup.endswith("/victim.service")
    how = cgroupfs.kill(cgroupfs.v2_root("/sys/fs/cgroup"), cgroup, cgroup_of=ProcFS().cgroup)
    assert how.endswith("cgroup.kill") or how.startswith("SIGKILL to 2 ")
    um.wait_for("victim.service", "ActiveState", "failed")
    assert um.show("bystander.service", "ActiveState")["ActiveState"] == "active"
    um.systemctl("stop", "bystander.service")
    um.systemctl("reset-failed", "victim.service")


def _fds_to(path: str) -> int:
    """How many of this process's fds are open on `path`."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") == path
    return count


def test_a_release_during_the_guards_pass_is_not_undone(um, tmp_path):
    """release holds the lock while the guard, having seen a vanished mask, waits for it."""
    import threading

    from structlog.testing import capture_logs

    from spark_guard import log
    from spark_guard.block.blocker import Blocker
    from spark_guard.block.records import Record, RecordStore
    from spark_guard.core.block import Step
    from spark_guard.core.config import Config
    from spark_guard.system.managers import Manager

    control = um.runtime / "systemd" / "user.control"
    config = Config(
        state=str(tmp_path / "state"), motd=str(tmp_path / "motd"), issue=str(tmp_path / "issue")
    )
    store = RecordStore(config.state)
    record = Record(
        unit="llama-race.service",
        manager="user:0",
        reason="footprint",
        detail="test",
        phase="strict",
        step=Step.BLOCKED,
        mask_path=str(control / "llama-race.service"),
        mask_made=True,
    )
    store.save(record)
    manager = Manager("user:0", str(um.socket))
    manager.connect()
    log.configure("console")
    blocker = Blocker({"user:0": manager}, config, log.get_logger())
    with capture_logs() as events:
        with store.lock():
            guard = threading.Thread(target=blocker.advance)
            guard.start()
            # The guard has seen the mask missing and waits for the lock (it gives up after
            # 1 s): its own fd to the lock file is open beside this one.
            lock = str(tmp_path / "state" / "lock")
            deadline = time.monotonic() + 5
            while _fds_to(lock) < 2:
                assert guard.is_alive() and time.monotonic() < deadline, "never at the lock"
                time.sleep(0.005)
            saved = store.load(record.ref)
            assert saved is not None
            store.retire(saved)
        guard.join(timeout=10)
    manager.close()
    assert not (control / "llama-race.service").exists()
    assert store.load(record.ref) is None
    assert not any(e["event"] == "block-renewed" for e in events)
    assert blocker.records == {}
