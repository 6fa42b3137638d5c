"""Podman's API service, as Debian 12 ships it (4.3), under the guard (issue 19).

Podman's compat API lists, inspects, stops and starts as Docker's does, but has
no call to change a restart policy before Podman 5.1: the guard stops the
loader container (a stop through the API is not undone by its restart policy),
reports that the block cannot hold past the next boot and why, and release
starts it again with the policy it never lost.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.engine import IMAGE, LOADER, PODMAN, PodmanService
from lab.guardunit import GUARD, PY, guard_manager, log_text, wait_log, write_config
from lab.harness import UserManager

pytestmark = [pytest.mark.engine, pytest.mark.root]


@pytest.fixture(scope="module")
def podman() -> Iterator[PodmanService]:
    if shutil.which(PODMAN) is None:
        pytest.fail("podman missing: scripts/deps --test installs it")
    with PodmanService() as pm:
        yield pm


def _config(um: UserManager, pm: PodmanService, size: str) -> None:
    footprint = f'[loaders.footprint]\n"container:llm" = "{size}"\n'
    write_config(um, f'[containers]\nengines = ["{pm.socket}"]\n{footprint}')


def _cli(um: UserManager, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "spark_guard", *args, "--config", str(um.base / "guard.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_loader_container_on_podman_4_is_stopped_and_the_block_says_why_it_cannot_hold(
    podman: PodmanService,
) -> None:
    pm = podman
    engine = pm.engine()
    with guard_manager() as um:
        _config(um, pm, "100GiB")
        um.systemctl("start", GUARD)
        um.wait_for(GUARD, "ActiveState", "active")
        # A loader by its command (llama-server named in its argv), restart policy always.
        pm.podman(
            "run", "-d", "--name", "llm", "--restart", "always", "--network", "none",
            IMAGE, "python3", "-c", LOADER, "llama-server",
        )  # fmt: skip
        cgroup = Path(f"/proc/{engine.inspect('llm').pid}/cgroup").read_text()
        assert "/libpod_parent/libpod-" in cgroup

        wait_log(um, r"block-failed.*container:llm.*cannot change a restart policy", timeout=30)
        now = engine.inspect("llm")
        assert (now.running, now.policy) == (False, "always"), log_text(um)[-3000:]
        time.sleep(1)
        assert not engine.inspect("llm").running  # its policy did not bring it back
        record = json.loads((um.base / "state/blocked/container:llm.json").read_text())
        assert record["step"] == "stop" and "Podman before 5.1" in record["problem"]
        assert record["container"]["restart"] == "always"
        note = (um.base / "motd.d/spark-guard").read_text()
        assert "container:llm  blocking (stop)" in note and "Quadlet" in note
        # Said once, not at every retry.
        assert log_text(um).count("block-failed") == 1

        # It fits after all: released, started, its policy never changed.
        _config(um, pm, "1MiB")
        um.systemctl("reload", GUARD)
        wait_log(um, "config-reloaded")
        out = _cli(um, "release", "container:llm")
        assert out.returncode == 0, out.stderr
        now = engine.inspect("llm")
        assert (now.running, now.policy) == (True, "always")
        pm.podman("rm", "-f", "-t", "0", "llm")
