"""The guard as a Type=notify unit on a real systemd manager, watching real loaders.

A `systemd --user` instance started by the harness runs both the guard and
loader units that allocate memory for real (capped with LimitAS=). The
guard finds that manager the way it finds every user manager: by its
private socket under the user runtime directory.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from lab.accounts import unprivileged_user
from lab.guardunit import (
    GUARD,
    PY,
    MiB,
    guard_manager,
    loader_unit,
    log_text,
    restart_guard,
    wait_log,
    write_config,
)
from lab.harness import UserManager
from tests.jsonschemas import check

pytestmark = pytest.mark.systemd


@pytest.fixture(scope="module")
def um():
    with guard_manager() as manager:
        yield manager


def test_guard_is_ready_with_status_and_gpu_off_once(um):
    # The library is looked for again every 100 ms (60 s by default): the second look
    # below comes after several retries, each of which could have said it again.
    write_config(um, '[gpu]\nretry = "100ms"\n')
    offset = restart_guard(um)
    # Type=notify: 'active' is only reached once the guard sent READY=1.
    props = um.show(GUARD, "ActiveState", "SubState", "StatusText", "NRestarts")
    assert props["SubState"] == "running"
    assert re.match(
        r"strict; available [\d.]+GiB, reserve [\d.]+GiB; loaders \d+; blocked 0; "
        r"last action: none$",
        props["StatusText"],
    ), props["StatusText"]
    wait_log(um, r"^info guard-started: spark-guard watching .*managers=user:0", after=offset)
    time.sleep(1.0)
    # mlockall: its pages stay in RAM when memory runs out.
    pid = um.show(GUARD, "MainPID")["MainPID"]
    status = Path(f"/proc/{pid}/status").read_text()
    locked = re.search(r"^VmLck:\s+(\d+) kB", status, re.MULTILINE)
    assert locked, status
    locked_kib = int(locked.group(1))
    assert locked_kib > 10 * 1024, status
    # No driver here: GPU accounting is off, said once, and the guard keeps working.
    assert log_text(um)[offset:].count("gpu-accounting-off") == 1
    assert um.show(GUARD, "ActiveState")["ActiveState"] == "active"


def test_loader_is_seen_attributed_and_classified(um):
    write_config(um)
    offset = restart_guard(um)
    # A neutral name: only its command line and its mapped .gguf betray it.
    loader_unit(um, "worker-a.service", 300, model=str(um.models / "ds4.gguf"))
    um.systemctl("start", "worker-a.service")
    m = wait_log(um, r"^info loader-seen: model loader user:0:worker-a.service: .*$", after=offset)
    line = m.group(0)
    assert "model-arg:" in line and "ds4.gguf" in line
    assert "manager=user:0" in line
    # Mapped-file evidence arrives once the process holds enough memory.
    wait_log(um, r"^fake loader holding 300 MiB", after=offset)
    out = subprocess.run(
        [PY, "-m", "spark_guard", "dump", "--json", "--config", str(um.base / "guard.toml")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    dump = json.loads(out.stdout)
    check(dump, "dump")  # its schema, with loaders in it
    assert "user:0" in dump["managers"]
    loaders = {ld["seen"]["unit"]: ld for ld in dump["decision"]["loaders"]}
    worker = loaders["user:0:worker-a.service"]
    assert worker["seen"]["rss"] >= 300 * MiB
    main_pid = int(um.show("worker-a.service", "MainPID")["MainPID"])
    assert main_pid in worker["seen"]["pids"]
    assert any(e.startswith("mapped:") and e.endswith("ds4.gguf") for e in worker["evidence"])
    # The guard's own unit and the rescue unit are not loaders.
    assert not any("spark-guard" in k or "rescue" in k for k in loaders)
    um.systemctl("stop", "worker-a.service")


def test_strict_phase_stops_a_loader_that_would_not_fit(um):
    write_config(um, '[loaders.footprint]\n"llama-big.service" = "100TiB"\n')
    offset = restart_guard(um)
    loader_unit(um, "llama-big.service", 50)
    um.systemctl("start", "llama-big.service")
    m = wait_log(
        um, r"^warning decision: stop user:0:llama-big.service: expects 100.0TiB.*$", after=offset
    )
    assert "reason=footprint" in m.group(0) and "phase=strict" in m.group(0)
    wait_log(um, r"^warning unit-stop-requested: stopping user:0:llama-big.service", after=offset)
    um.wait_for("llama-big.service", "ActiveState", "inactive")
    # STATUS= is sent at the end of the pass, once the block is verified.
    wait_log(um, r"^warning unit-blocked: user:0:llama-big.service", after=offset)
    deadline = time.monotonic() + 5
    while "last action: stop" not in (status := um.show(GUARD, "StatusText")["StatusText"]):
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert "last action: stop user:0:llama-big.service (footprint)" in status
    assert "blocked 1" in status


def test_dry_run_in_steady_phase_logs_the_decision_and_leaves_the_unit(um):
    um.systemctl("start", "rescue-ssh.service")
    # A reserve larger than any machine's memory: MemAvailable is always below it.
    write_config(um, '[budget]\nreserve = "100TiB"\n[guard]\ndry_run = true\n', grace="0s")
    offset = restart_guard(um)
    loader_unit(um, "ollama-idle.service", 100)
    um.systemctl("start", "ollama-idle.service")
    wait_log(um, r"^info phase-changed: boot phase over: steady", after=offset)
    m = wait_log(um, r"^warning decision: stop user:0:ollama-idle.service: .*$", after=offset)
    assert "reason=reserve" in m.group(0) and "phase=steady" in m.group(0)
    wait_log(
        um,
        r"^warning dry-run: dry run: would stop, mask and disable user:0:ollama-idle.service",
        after=offset,
    )
    time.sleep(1.0)
    assert um.show("ollama-idle.service", "ActiveState")["ActiveState"] == "active"
    # Not repeated every pass: once per unit and reason within repeat_after.
    assert log_text(um)[offset:].count("decision: stop user:0:ollama-idle.service") == 1
    # The file turns dry-run off, and a reload makes it so (it used to stick until restart).
    write_config(um, '[budget]\nreserve = "100TiB"\n', grace="0s")
    um.systemctl("reload", GUARD)
    wait_log(um, r"^info config-reloaded", after=offset)
    um.wait_for("ollama-idle.service", "ActiveState", "inactive")
    wait_log(um, r"^warning unit-stop-requested: stopping user:0:ollama-idle.service", after=offset)
    assert guard_cli_release(um, "ollama-idle").returncode == 0
    um.systemctl("stop", "rescue-ssh.service")


def guard_cli_release(um: UserManager, unit: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "spark_guard", "release", unit, "--config", str(um.base / "guard.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_config_on_reload_is_refused_and_at_start_falls_back_loudly(um):
    write_config(um)
    offset = restart_guard(um)
    (um.base / "guard.toml").write_text('[budget]\nreserve = "8GiB"\nsteady = "maybe"\n')
    um.systemctl("reload", GUARD)
    m = wait_log(um, r"^error config-reload-refused: .*$", after=offset)
    assert f"{um.base}/guard.toml:3: budget.steady: must be one of guard, warn, off" in m.group(0)
    assert um.show(GUARD, "ActiveState")["ActiveState"] == "active"
    assert "CONFIG ERROR" not in um.show(GUARD, "StatusText")["StatusText"]
    # Restarted on the broken file: still protecting, on defaults, and saying so.
    offset = restart_guard(um)
    wait_log(
        um,
        r"^error config-invalid: invalid config, protecting with built-in defaults",
        after=offset,
    )
    status = um.show(GUARD, "StatusText")["StatusText"]
    assert status.startswith("CONFIG ERROR, built-in defaults in use: ")
    assert "guard.toml:3: budget.steady" in status


def test_sigterm_stops_cleanly(um):
    write_config(um)
    offset = restart_guard(um)
    um.systemctl("stop", GUARD)
    um.wait_for(GUARD, "ActiveState", "inactive")
    wait_log(um, r"^info guard-stopping: spark-guard stopping", after=offset)
    assert um.show(GUARD, "Result")["Result"] == "success"


def test_user_managers_that_come_and_go_are_followed(um):
    write_config(um)
    offset = restart_guard(um)
    # A second user's manager appears (a login, or linger at boot), then goes: a real
    # unprivileged account, its manager in a cgroup named as PID 1 names it.
    with (
        unprivileged_user() as user,
        UserManager(user=user, user_runtime=um.user_runtime) as other,
    ):
        key = f"user:{user.uid}"
        wait_log(um, rf"^info manager-connected: watching {key} manager", after=offset)
        loader_unit(other, "lmstudio-server.service", 120)
        other.systemctl("start", "lmstudio-server.service")
        m = wait_log(
            um, rf"^info loader-seen: model loader {key}:lmstudio-server.service.*$", after=offset
        )
        assert f"manager={key}" in m.group(0)
    wait_log(um, rf"^info manager-lost: {key} manager", after=offset)
    assert um.show(GUARD, "ActiveState")["ActiveState"] == "active"


NO_FORK = """
import sys
forbidden = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
             "subprocess.Popen", "pty.spawn")
seen = []
def hook(event, args):
    if event.startswith(forbidden):
        seen.append(event)
        raise RuntimeError("forbidden on the action path: " + event)
from spark_guard import config, log
from spark_guard.act import act
from spark_guard.block.blocker import Blocker
from spark_guard.sense import Sensor
from spark_guard.core.step import GuardState, step
log.configure("console")
c = config.load(sys.argv[1])
sensor = Sensor(c, log.get_logger())
blocker = Blocker(sensor.managers, c, log.get_logger())
sys.addaudithook(hook)
# From here on: sense -> decide -> act: stop, mask, disable, verify, all for real.
sensor.refresh_managers()
outcome = step(GuardState(), sensor.snapshot(), c, dry_run=False)
act(outcome, blocker, log.get_logger())
taken = outcome.taken
print("TAKEN", [str(a.unit) for a in taken], "FORBIDDEN", seen)
print("STEP", blocker.records["user:0:llama-nofork.service"].step)  # others may be on record
"""


def test_sense_decide_act_path_never_forks_or_execs(um):
    write_config(um, '[loaders.footprint]\n"llama-nofork.service" = "100TiB"\n')
    um.systemctl("stop", GUARD)
    loader_unit(um, "llama-nofork.service", 40)
    um.systemctl("start", "llama-nofork.service")
    um.wait_for("llama-nofork.service", "ActiveState", "active")
    out = subprocess.run(
        [PY, "-c", NO_FORK, str(um.base / "guard.toml")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "TAKEN ['user:0:llama-nofork.service'] FORBIDDEN []" in out.stdout, out.stdout
    assert "STEP blocked" in out.stdout, out.stdout + out.stderr
    um.wait_for("llama-nofork.service", "ActiveState", "inactive")
    assert um.show("llama-nofork.service", "LoadState")["LoadState"] == "masked"
