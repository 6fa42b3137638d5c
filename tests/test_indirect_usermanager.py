"""A load a client asks a server for, on real managers: LM Studio's and Ollama's layouts.

Alice is a real unprivileged account with her own user manager (what linger gives
her at boot). Her LM Studio and Ollama servers are units; so are the clients
that ask them for a model after a boot delay, as the incident's lms-load.service
did. Her model folders are real: LM Studio's ~/.lmstudio/models and Ollama's
manifests and blobs, with sparse GGUFs of Qwen3-30B-A3B's shape. The `lms` and
`ollama` programs are stand-ins (lab/fake_model_server.py) whose server takes
memory only when a client asks it to.

At boot (the strict phase), the load does not fit: the guard refuses it on the
server's unit, where the memory would land, before the server takes a byte,
and names the client in the record and the journal. The client's own unit is
left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab import LAB, synth
from lab.accounts import User, unprivileged_user
from lab.guardunit import PY, guard_manager, restart_guard, wait_log, write_config
from lab.harness import UserManager

pytestmark = pytest.mark.systemd

GiB = 1024**3
QWEN = synth.SPECS["qwen3-30b-a3b"]  # about 17.5 GiB at ctx 4096


@dataclass
class Stage:
    root: UserManager
    am: UserManager
    alice: User

    @property
    def key(self) -> str:
        return f"user:{self.alice.uid}"

    def guard(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PY, "-m", "spark_guard", *args, "--config", str(self.root.base / "guard.toml")],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def her_file(self, path: Path, data: bytes | str, mode: int = 0o644) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in [path.parent, *path.parent.parents]:
            if d == self.alice.home:
                break
            os.chown(d, self.alice.uid, self.alice.gid)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        os.chown(path, self.alice.uid, self.alice.gid)
        path.chmod(mode)

    def her_model(self, path: Path) -> None:
        """A sparse GGUF of Qwen3-30B-A3B's shape at `path`, hers."""
        path.parent.mkdir(parents=True, exist_ok=True)
        made = synth.write(QWEN, path.parent)
        made.rename(path)
        os.chown(path, self.alice.uid, self.alice.gid)
        for d in [path.parent, *path.parent.parents]:
            if d == self.alice.home:
                break
            os.chown(d, self.alice.uid, self.alice.gid)

    def her_program(self, path: Path) -> None:
        """The stand-in, under the real program's name."""
        text = (LAB / "fake_model_server.py").read_text()
        self.her_file(path, f"#!{PY}\n{text}", 0o755)

    def her_unit(self, name: str, text: str) -> None:
        self.her_file(self.am.unit_dir / name, text)
        self.am.systemctl("daemon-reload")

    def record(self, unit: str) -> dict[str, object]:
        path = self.root.base / "state" / "blocked" / f"{self.key}:{unit}.json"
        return json.loads(path.read_text())


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    with (
        unprivileged_user() as alice,
        guard_manager() as root,
        UserManager(user=alice, user_runtime=root.user_runtime) as am,
    ):
        # Room for 4 GiB above the reserve, whatever this machine's memory: a 17.5 GiB
        # load does not fit. Boot: the grace period is an hour.
        meminfo = re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())
        assert meminfo is not None
        reserve = int(meminfo[1]) * 1024 - 4 * GiB
        write_config(root, f'[budget]\nreserve = "{reserve // 2**20}MiB"\nreserve_percent = 0\n')
        restart_guard(root)
        wait_log(root, rf"manager-connected: watching user:{alice.uid} manager")
        yield Stage(root, am, alice)


def _spool(stage: Stage) -> list[str]:
    spool = stage.alice.home / ".fake-model-server"
    return sorted(p.name for p in spool.glob("*")) if spool.exists() else []


def _blocked_for_its_client(stage: Stage, server: str, client: str, offset: int) -> None:
    line = wait_log(
        stage.root, rf"^warning unit-blocked: {stage.key}:{re.escape(server)}.*$", after=offset
    )[0]
    assert f"clients={stage.key}:{client}" in line or f"{stage.key}:{client}" in line, line
    record = stage.record(server)
    assert (record["reason"], record["clients"]) == ("footprint", [f"{stage.key}:{client}"])
    assert f"the load asked by {stage.key}:{client}" in str(record["detail"])
    assert stage.am.show(server, "LoadState")["LoadState"] == "masked"
    # The client is not the one blocked: its unit file is as she wrote it.
    assert stage.am.show(client, "LoadState")["LoadState"] == "loaded"
    # The server never answered: nothing was loaded.
    time.sleep(1)
    assert [n for n in _spool(stage) if n.endswith(".loaded")] == []


def test_lms_load_at_boot_is_refused_on_her_lm_studio_server(stage: Stage) -> None:
    home = stage.alice.home
    stage.her_model(home / ".lmstudio/models/qwen/Qwen3-30B-A3B-GGUF/Qwen3-30B-A3B-Q4_K_M.gguf")
    stage.her_program(home / ".lmstudio/bin/lms")
    stage.her_unit(
        "lmstudio-server.service",
        "[Service]\nExecStart=%h/.lmstudio/bin/lms server start\nRestart=always\n",
    )
    # The incident's unit: a boot delay, then `lms load` of a Qwen model.
    stage.her_unit(
        "lms-load.service",
        "[Unit]\nDescription=Load lms qwen model after boot delay\n[Service]\nType=oneshot\n"
        'ExecStart=/bin/sh -c "sleep 5; %h/.lmstudio/bin/lms load qwen/Qwen3-30B-A3B-GGUF'
        ' --context-length 4096 -y"\n',
    )
    offset = len(stage.root.log.read_text(errors="replace"))
    stage.am.systemctl("start", "lmstudio-server.service")
    stage.am.wait_for("lmstudio-server.service", "ActiveState", "active")
    stage.am.systemctl("start", "--no-block", "lms-load.service")
    _blocked_for_its_client(stage, "lmstudio-server.service", "lms-load.service", offset)
    log = stage.root.log.read_text(errors="replace")[offset:]
    seen = re.search(rf"loader-seen: model loader {stage.key}:lms-load.service.*", log)
    assert seen and f"lands in {stage.key}:lmstudio-server.service" in seen[0], log[-3000:]
    out = stage.guard("release", f"{stage.key}:lmstudio-server.service")
    assert out.returncode == 0, out.stderr
    assert stage.am.show("lmstudio-server.service", "LoadState")["LoadState"] == "loaded"
    stage.am.systemctl("stop", "lms-load.service")


def test_ollama_run_at_boot_is_refused_on_her_ollama_server(stage: Stage) -> None:
    home = stage.alice.home
    models = home / ".ollama/models"
    digest = hashlib.sha256(b"qwen3:30b").hexdigest()
    stage.her_model(models / "blobs" / f"sha256-{digest}")
    manifest = {
        "schemaVersion": 2,
        "layers": [
            {
                "mediaType": "application/vnd.ollama.image.model",
                "digest": f"sha256:{digest}",
                "size": 1,
            }
        ],
    }
    stage.her_file(models / "manifests/registry.ollama.ai/library/qwen3/30b", json.dumps(manifest))
    stage.her_program(home / "bin/ollama")
    stage.her_unit(
        "ollama.service",
        "[Service]\nExecStart=%h/bin/ollama serve\nEnvironment=OLLAMA_CONTEXT_LENGTH=4096\n"
        "Restart=always\n",
    )
    stage.her_unit(
        "ollama-preload.service",
        '[Service]\nType=oneshot\nExecStart=/bin/sh -c "sleep 5; %h/bin/ollama run qwen3:30b"\n',
    )
    offset = len(stage.root.log.read_text(errors="replace"))
    stage.am.systemctl("start", "ollama.service")
    stage.am.wait_for("ollama.service", "ActiveState", "active")
    stage.am.systemctl("start", "--no-block", "ollama-preload.service")
    _blocked_for_its_client(stage, "ollama.service", "ollama-preload.service", offset)
    out = stage.guard("release", f"{stage.key}:ollama.service")
    assert out.returncode == 0, out.stderr
    stage.am.systemctl("stop", "ollama-preload.service")
    shutil.rmtree(home / ".fake-model-server", ignore_errors=True)
