"""The guard, run for real, blocks a loader container through a real dockerd (issue 19).

The guard runs as a unit of a harness user manager (lab/guardunit.py), as in
test_guard_usermanager; the engine is a private dockerd (lab/engine.py) named in
the guard's `[containers] engines`. On this host the containers' cgroups are
dockerd's cgroupfs ones (`/docker/<id>`): the guard finds the id there, asks the
engine who it is off its loop, and judges `container:NAME` as it judges a unit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lab import LAB
from lab.accounts import User
from lab.engine import FIGHTS, LOADER, DockerD
from lab.guardunit import GUARD, PY, guard_manager, log_text, restart_guard, wait_log, write_config
from lab.harness import UserManager, file_tree

pytestmark = [pytest.mark.engine, pytest.mark.root]

LEAVES = LOADER


def _wait(check: Callable[[], bool], timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _state(d: DockerD, name: str) -> tuple[bool, str]:
    c = d.engine().inspect(name)
    return c.running, c.policy


def _config(um: UserManager, d: DockerD, extra: str = "", containers: str = "") -> None:
    write_config(
        um,
        f"""
[containers]
engines = ["{d.socket}"]
{containers}
[protected]
extra = ["container:keep*"]
{extra}
""",
    )


def _cli(um: UserManager, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "spark_guard", *args, "--config", str(um.base / "guard.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _run(d: DockerD, name: str, image: str, restart: str, script: str) -> str:
    return d.docker(
        "run", "-d", "--name", name, "--network", "none", "--restart", restart,
        d.tag(image), "python3", "-c", script,
    )  # fmt: skip


def test_a_loader_container_is_blocked_at_boot_stays_down_and_is_released_exactly(
    dockerd: DockerD,
) -> None:
    d = dockerd
    with guard_manager() as um:
        # Boot: the rescue unit is not up, so the strict phase judges footprints.
        _config(um, d, '[loaders.footprint]\n"container:llm" = "100GiB"\n')
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        # keep: a loader image too, protected by config: never touched.
        _run(d, "keep", "ollama/ollama:test", "always", LEAVES)
        llm = _run(d, "llm", "vllm/vllm-openai:test", "unless-stopped", LEAVES)

        wait_log(um, r"unit-blocked.*container:llm", timeout=30)
        assert _state(d, "llm") == (False, "no"), log_text(um)[-3000:]
        assert _state(d, "keep") == (True, "always")
        record = json.loads((um.base / "state/blocked/container:llm.json").read_text())
        assert (record["manager"], record["unit"], record["step"]) == (
            "container",
            "llm",
            "blocked",
        )
        assert (record["reason"], record["phase"]) == ("footprint", "strict")
        assert record["container"] == {
            "id": llm,
            "image": "vllm/vllm-openai:test",
            "engine": d.socket,
            "restart": "unless-stopped",
            "max_retries": 0,
            "was_running": True,
        }
        assert "keep" not in log_text(um)
        # What the admin reads: the login note and status.
        note = (um.base / "motd.d/spark-guard").read_text()
        assert "container:llm  blocked since" in note
        assert "restart policy set to no" in note
        status = _cli(um, "status")
        assert "container:llm: blocked" in status.stdout
        assert "restart policy no (was unless-stopped)" in status.stdout, status.stdout

        # dockerd restarts (as at every boot): llm stays down, the protected one comes back.
        d.restart()
        assert _wait(lambda: _state(d, "keep")[0])
        time.sleep(1)  # dockerd's restart manager has started what it would by now
        assert _state(d, "llm") == (False, "no")

        # The guard restarts: the record is the first block's, not overwritten.
        restart_guard(um)
        time.sleep(1)
        again = json.loads((um.base / "state/blocked/container:llm.json").read_text())
        assert again["container"]["restart"] == "unless-stopped"

        # The admin says it fits, then releases it: the exact policy back, running, and
        # the guard leaves it be.
        _config(um, d, '[loaders.footprint]\n"container:llm" = "1MiB"\n')
        um.systemctl("reload", GUARD)
        wait_log(um, "config-reloaded")
        out = _cli(um, "release", "container:llm")
        assert out.returncode == 0, out.stderr
        assert "released container:llm: restart policy unless-stopped put back; started" in (
            out.stdout
        )
        assert _state(d, "llm") == (True, "unless-stopped")
        assert not (um.base / "state/blocked/container:llm.json").exists()
        assert not (um.base / "motd.d/spark-guard").exists()
        time.sleep(2)  # a few passes of the guard
        assert _state(d, "llm") == (True, "unless-stopped"), log_text(um)[-2000:]
        d.docker("rm", "-f", "llm", "keep")


def test_a_container_that_ignores_its_stop_is_killed_when_memory_is_short(
    dockerd: DockerD,
) -> None:
    """Below the reserve the guard does not wait out the engine's stop timeout: it kills the
    container's cgroup itself, and the engine, asked to stop it, does not restart it."""
    d = dockerd
    with guard_manager() as um:
        # A reserve no machine has: MemAvailable is below it, and a loader is freed at once.
        _config(um, d, '[budget]\nreserve = "100TiB"\n[guard]\nstop_timeout = "60s"\n')
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        _run(d, "fighter", "vllm/vllm-openai:test", "always", FIGHTS)

        wait_log(um, r"unit-blocked.*container:fighter", timeout=40)
        text = log_text(um)
        assert "unit-killed" in text and "container:fighter: killed its cgroup" in text, text[
            -3000:
        ]
        assert _state(d, "fighter") == (False, "no")
        record = json.loads((um.base / "state/blocked/container:fighter.json").read_text())
        assert record["reason"] == "reserve" and record["container"]["restart"] == "always"
        assert any("killed" in what for _, what in record["history"])
        d.docker("rm", "-f", "fighter")


def test_rescue_blocks_running_loader_containers_and_release_all_undoes_it(
    dockerd: DockerD,
) -> None:
    d = dockerd
    with guard_manager() as um:
        _config(um, d)
        _run(d, "rescued", "ghcr.io/ggml-org/llama.cpp:server", "on-failure:5", LEAVES)
        _run(d, "keep-me", "vllm/vllm-openai:test", "always", LEAVES)  # protected
        _run(d, "web", "nginx:test", "unless-stopped", LEAVES)  # not a loader
        out = _cli(um, "rescue", "--stop-timeout", "2")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "container:rescued" in out.stdout and "restart no" in out.stdout, out.stdout
        assert _state(d, "rescued") == (False, "no")
        assert _state(d, "keep-me") == (True, "always")
        assert _state(d, "web") == (True, "unless-stopped")
        record = json.loads((um.base / "state/blocked/container:rescued.json").read_text())
        assert (record["step"], record["reason"]) == ("blocked", "rescue")
        assert (record["container"]["restart"], record["container"]["max_retries"]) == (
            "on-failure",
            5,
        )
        # As the package's removal releases: the policy back, started at the next boot.
        out = _cli(um, "release", "--all", "--no-start")
        assert out.returncode == 0, out.stderr
        assert "released container:rescued: restart policy on-failure:5 put back\n" in out.stdout
        assert _state(d, "rescued") == (False, "on-failure:5")
        d.docker("rm", "-f", "rescued", "keep-me", "web")


def test_a_users_scope_named_after_a_container_is_hers_not_the_containers(
    dockerd: DockerD, mallory: User
) -> None:
    """Any user names the cgroups of her own manager: mallory puts a process that takes
    200 MiB into `docker-<id>.scope` under her user@UID.service, naming root's container.
    The guard counts it as her scope, never as the container: her memory cannot make
    root's container the one judged, blocked or charged."""
    d = dockerd
    with (
        guard_manager() as um,
        UserManager(user=mallory, user_runtime=um.user_runtime) as hers,
    ):
        _config(um, d)
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        wait_log(um, rf"watching user:{mallory.uid} manager")
        cid = _run(d, "llm", "vllm/vllm-openai:test", "unless-stopped", LEAVES)
        script = hers.home / "decoy.sh"
        script.write_text(
            'cg=$(sed -n "s/^0:://p" /proc/self/cgroup); root=/sys/fs/cgroup/unified\n'
            '[ -d "$root$cg" ] || root=/sys/fs/cgroup\n'
            f'dir="$root$(dirname "$cg")/docker-{cid}.scope"\n'
            'mkdir "$dir" && echo $$ > "$dir/cgroup.procs" || exit 1\n'
            f"exec {PY} {LAB}/fake_loader.py --alloc 200 --rate 0\n"
        )
        hers.write_unit("decoy.service", f"[Service]\nExecStart=/bin/sh {script}\n")
        hers.systemctl("start", "decoy.service")
        status = hers.systemctl("status", "decoy.service", check=False).stdout
        assert hers.show("decoy.service", "ActiveState")["ActiveState"] == "active", status

        def seen() -> dict[str, Any]:
            state = json.loads((um.base / "run/state.json").read_text())
            return {ld["unit"]: ld for ld in state["loaders"]}

        # Her process is in a cgroup of that name, and holds its 200 MiB.
        pid = int(hers.show("decoy.service", "MainPID")["MainPID"])
        assert _wait(lambda: f"docker-{cid}.scope" in Path(f"/proc/{pid}/cgroup").read_text())
        assert _wait(lambda: _rss(pid) >= 200 << 20)
        assert _wait(lambda: "container:llm" in seen())
        time.sleep(2)  # passes of the guard, each of which sees her process
        llm = seen()["container:llm"]
        assert llm["rss"] < 150 << 20, (llm, log_text(um)[-2000:])
        assert not any(u.endswith(f"docker-{cid}.scope") for u in seen())
        d.docker("rm", "-f", "llm")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_while_dockerd_does_not_answer_its_files_say_who_and_the_kernel_stops_it(
    dockerd: DockerD,
) -> None:
    """At boot dockerd restarts containers before its API answers. Here its API is silent
    (dockerd stopped with SIGSTOP, its container running on): the guard reads who the
    container is from dockerd's files, refuses it on its footprint, and kills its cgroup
    when the engine does not answer the stop; once dockerd answers again, the run its
    policy started is stopped and blocked through it."""
    d = dockerd
    with guard_manager() as um:
        _config(
            um,
            d,
            '[loaders.footprint]\n"container:llm" = "100GiB"\n',
            containers=f'docker_root = "{d.base}/data"',
        )
        llm = _run(d, "llm", "vllm/vllm-openai:test", "unless-stopped", LEAVES)
        pid = d.engine().inspect(llm).pid
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        try:
            um.systemctl("start", GUARD)
            wait_log(um, r"container:llm: killed its cgroup \(its engine did not answer", 60)
            assert _wait(lambda: not Path(f"/proc/{pid}").exists(), 10)
            assert "engine-unanswered" in log_text(um)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        wait_log(um, r"unit-blocked.*container:llm", timeout=60)
        assert _state(d, "llm") == (False, "no"), log_text(um)[-3000:]
        record = json.loads((um.base / "state/blocked/container:llm.json").read_text())
        assert record["container"]["restart"] == "unless-stopped"
        d.docker("rm", "-f", "llm")


def test_her_earlier_fake_never_gets_roots_loader_container_stopped(
    dockerd: DockerD, mallory: User, public_dir: Path
) -> None:
    """Issue 28 §3, as a real uid against a real dockerd: mallory's unit runs `exec -a
    llama-server tail -f /dev/null -- -m <model>`, naming the host file that root's
    container loads through its bind mount (/models/x.gguf inside), and starts first.
    Before, root's container was stopped as the duplicate. A container of root's engine
    ranks with root's units, and its model is the mount's source on the host: her unit is
    the copy refused; the container runs on, its policy untouched."""
    d = dockerd
    models = public_dir / "models"
    models.mkdir()
    model = models / "x.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 4096)
    model.chmod(0o644)
    with (
        guard_manager() as um,
        UserManager(user=mallory, user_runtime=um.user_runtime) as hers,
    ):
        _config(um, d)
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        wait_log(um, rf"watching user:{mallory.uid} manager")
        offset = len(log_text(um))
        fake = f"exec -a llama-server tail -f /dev/null -- -m {model}"
        hers.write_unit("fake.service", f"[Service]\nExecStart=/bin/bash -c '{fake}'\n")
        hers.systemctl("start", "fake.service")
        time.sleep(1.5)  # hers is the first started
        # Root's loader container: it maps the model through its bind mount and holds
        # 300 MiB, so the guard reads its maps (a process under 256 MiB is not scanned).
        script = (
            "import mmap, time\n"
            "f = open('/models/x.gguf', 'rb')\n"
            "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
            "held = b'x' * (300 << 20)\n"
            "time.sleep(3600)\n"
        )
        d.docker(
            "run", "-d", "--name", "llm", "--network", "none", "--restart", "unless-stopped",
            "-v", f"{models}:/models:ro", d.tag("vllm/vllm-openai:test"), "python3", "-c", script,
        )  # fmt: skip
        refused = wait_log(
            um, rf"decision: stop user:{mallory.uid}:fake\.service: .*", 30, offset
        ).group(0)
        assert f"{model} is already loaded by container:llm" in refused, refused
        assert "root's unit keeps it over a user's copy" in refused, refused
        time.sleep(2)
        text = log_text(um)[offset:]
        assert "decision: stop container:llm" not in text, text[-3000:]
        assert _state(d, "llm") == (True, "unless-stopped")
        d.docker("rm", "-f", "llm")
        um.systemctl("stop", GUARD)


def test_a_rm_container_is_blocked_when_stopped_followed_by_name_and_released_when_gone(
    dockerd: DockerD,
) -> None:
    """Issue 29 §1: `docker run --rm --name X` has no restart policy to change, and docker
    refuses to update one marked for removal: the block never completed. Now it is done
    once the container is stopped (and removed); the same name run again is the same
    loader, blocked again; and release, with the container gone, says so and ends."""
    d = dockerd
    with guard_manager() as um:
        _config(um, d, '[loaders.footprint]\n"container:rmllm" = "100GiB"\n')
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        offset = len(log_text(um))

        def run_rm() -> str:
            return d.docker(
                "run", "-d", "--rm", "--name", "rmllm", "--network", "none",
                d.tag("vllm/vllm-openai:test"), "python3", "-c", LEAVES,
            ).strip()  # fmt: skip

        first = run_rm()
        wait_log(um, r"unit-blocked.*container:rmllm", timeout=30, after=offset)
        assert _wait(lambda: "rmllm" not in d.docker("ps", "-a", "--format", "{{.Names}}"))
        record = json.loads((um.base / "state/blocked/container:rmllm.json").read_text())
        assert (record["step"], record["container"]["id"]) == ("blocked", first)
        assert "removed on its stop (--rm)" in json.dumps(record["history"]), record["history"]
        # Run again under its name (a unit's Restart= would): stopped again, followed.
        offset = len(log_text(um))
        second = run_rm()
        assert second != first
        wait_log(um, r"unit-blocked.*container:rmllm", timeout=30, after=offset)
        assert _wait(lambda: "rmllm" not in d.docker("ps", "-a", "--format", "{{.Names}}"))
        record = json.loads((um.base / "state/blocked/container:rmllm.json").read_text())
        assert record["step"] == "blocked", record
        out = _cli(um, "release", "container:rmllm")
        assert out.returncode == 0, out.stderr
        assert "the container no longer exists, nothing to put back" in out.stdout, out.stdout
        assert not (um.base / "state/blocked/container:rmllm.json").exists()
        assert not (um.base / "motd.d/spark-guard").exists()
        um.systemctl("stop", GUARD)


def test_a_unit_that_wraps_docker_run_is_blocked_with_its_container_and_released(
    dockerd: DockerD,
) -> None:
    """Issue 29 §1, the most common autostart: a unit runs `docker run --rm --name vllm`
    with Restart=always. Its cgroup holds only the client; the loader is the container.
    The container is refused on its footprint and stopped; the unit is blocked with it
    (masked: its Restart= cannot make a new container of that name); both stay down
    through a dockerd restart and the guard's restart; a release of both puts the unit's
    files and links back byte for byte, says the container is gone, and the unit starts
    again and runs its container."""
    d = dockerd
    with guard_manager() as um:
        _config(um, d, '[loaders.footprint]\n"container:vllm" = "100GiB"\n')
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        offset = len(log_text(um))
        image = d.tag("vllm/vllm-openai:test")
        run = (
            f"/usr/bin/docker -H unix://{d.socket} run --rm --name vllm --network none "
            f'{image} python3 -c "import time; held = bytes(64 << 20); time.sleep(3600)"'
        )
        um.write_unit(
            "vllm-wrap.service",
            f"[Service]\nExecStart={run}\nRestart=always\nRestartSec=1\n"
            "[Install]\nWantedBy=default.target\n",
        )
        um.systemctl("enable", "vllm-wrap.service")
        before = file_tree(um.unit_dir)
        um.systemctl("start", "--no-block", "vllm-wrap.service")
        wait_log(um, r"unit-blocked.*container:vllm", timeout=40, after=offset)
        wait_log(um, r"unit-blocked: user:0:vllm-wrap\.service", timeout=20, after=offset)
        # Its client proxies the stop to the container, whose python (PID 1 there) has no
        # handler: the guard's KillUnit ends it, so "failed" is as down as "inactive".
        assert _wait(
            lambda: (
                um.show("vllm-wrap.service", "ActiveState")["ActiveState"] in ("inactive", "failed")
            )
        )
        assert um.show("vllm-wrap.service", "LoadState")["LoadState"] == "masked"
        time.sleep(3)  # RestartSec=1 three times over: nothing made a new container
        assert "vllm" not in d.docker("ps", "-a", "--format", "{{.Names}}").split()
        # Down through a dockerd restart and the guard's.
        d.restart()
        restart_guard(um)
        time.sleep(3)
        assert "vllm" not in d.docker("ps", "-a", "--format", "{{.Names}}").split()
        assert um.show("vllm-wrap.service", "LoadState")["LoadState"] == "masked"
        # It fits after all (no footprint given: the trend guards it): released, and it runs.
        _config(um, d, "")
        offset = len(log_text(um))
        um.systemctl("reload", GUARD)
        wait_log(um, "config-reloaded", after=offset)
        out = _cli(um, "release", "--all")
        assert out.returncode == 0, out.stderr
        assert "released container:vllm: the container no longer exists" in out.stdout, out.stdout
        assert um.show("vllm-wrap.service", "LoadState", "UnitFileState") == {
            "LoadState": "loaded",
            "UnitFileState": "enabled",
        }
        assert file_tree(um.unit_dir) == before
        um.systemctl("start", "vllm-wrap.service")
        assert _wait(lambda: "vllm" in d.docker("ps", "--format", "{{.Names}}").split(), 30)
        # (Its python, PID 1 in the container, has no SIGTERM handler: removed, not stopped.)
        um.systemctl("disable", "vllm-wrap.service")
        um.systemctl("stop", "--no-block", "vllm-wrap.service")
        d.docker("rm", "-f", "vllm")
        um.systemctl("stop", GUARD)


def test_a_unit_that_runs_compose_up_is_blocked_with_its_projects_container(
    dockerd: DockerD,
) -> None:
    """Issue 29 §1, compose: llm-stack.service runs `docker-compose -f
    /srv/llm/compose.yaml up` (attached, Restart=always), whose vllm service has
    `restart: always`. (A stand-in client does what compose does there: start the
    project's labelled container again, or create it, and attach.) The container is
    refused on its footprint, stopped, its policy set to no; the unit is blocked with it,
    since its next `up` would start the container again whatever its policy; both stay
    down; `release --all` puts back the policy and the unit."""
    d = dockerd
    with guard_manager() as um:
        _config(um, d, '[loaders.footprint]\n"container:llm-vllm-1" = "100GiB"\n')
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        offset = len(log_text(um))
        image = d.tag("vllm/vllm-openai:test")
        client = um.base / "bin" / "docker-compose"
        client.parent.mkdir(exist_ok=True)
        docker = f"/usr/bin/docker -H unix://{d.socket}"
        # As compose does through the API: create the project's container if it is not
        # there, start it, and wait on it (no `run --name` or `start -a` client to see).
        client.write_text(
            "#!/bin/sh\n"
            f"{docker} create --name llm-vllm-1 --label com.docker.compose.project=llm "
            "--label com.docker.compose.service=vllm --restart always --network none "
            f'{image} python3 -c "import time; held = bytes(64 << 20); time.sleep(3600)"'
            " >/dev/null 2>&1\n"
            f"{docker} start llm-vllm-1 >/dev/null\n"
            f"exec {docker} wait llm-vllm-1\n"
        )
        client.chmod(0o755)
        um.write_unit(
            "llm-stack.service",
            f"[Service]\nExecStart={client} -f /srv/llm/compose.yaml up\nRestart=always\n"
            "RestartSec=1\n[Install]\nWantedBy=default.target\n",
        )
        um.systemctl("enable", "--now", "llm-stack.service")
        said = wait_log(um, r"unit-blocked: user:0:llm-stack\.service.*", timeout=40, after=offset)
        # Its python is PID 1 in the container, deaf to SIGTERM: the engine's stop waits
        # its timeout, then kills.
        wait_log(um, r"unit-blocked: container:llm-vllm-1 ", timeout=40, after=offset)
        assert "it runs container:llm-vllm-1" in said.group(0), said.group(0)
        assert um.show("llm-stack.service", "LoadState")["LoadState"] == "masked"
        time.sleep(3)  # RestartSec=1 three times over: nothing started it again
        assert _state(d, "llm-vllm-1") == (False, "no"), log_text(um)[offset:][-3000:]
        out = _cli(um, "release", "--all", "--no-start")
        assert out.returncode == 0, out.stderr
        assert _state(d, "llm-vllm-1") == (False, "always")
        assert um.show("llm-stack.service", "LoadState", "UnitFileState") == {
            "LoadState": "loaded",
            "UnitFileState": "enabled",
        }
        um.systemctl("disable", "llm-stack.service")
        um.systemctl("stop", GUARD)
        d.docker("rm", "-f", "llm-vllm-1")
