"""A user's rootless Podman under the guard (issue 29 §2).

The stage: the guard as a unit of root's harness manager; Mallory and Bob, two
real accounts with subuids, each with her own `systemd --user` (setuid helpers
in reach, as a real user@.service has them) and Debian's podman serving her
own API as Debian's podman.socket does: her manager listens on
$XDG_RUNTIME_DIR/podman/podman.sock, `podman system service` answers as her.
Their containers are made through their own sockets, as them.

On a systemd host her Podman has her manager make `user.slice/libpod-<id>.scope`
for each container. This hybrid host's Podman sees cgroup v1 and makes none for a
rootless user, so the test moves the container's processes into that scope,
standing in for her manager; everything else is hers and real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab.accounts import User, unprivileged_user
from lab.engine import TINY_FIGHTER, TINY_IMAGE, TINY_LOADER, RootlessPodman
from lab.guardunit import GUARD, PY, guard_manager, log_text, restart_guard, wait_log, write_config
from lab.harness import UserManager
from spark_guard.system.engine import Container

pytestmark = [pytest.mark.systemd, pytest.mark.engine, pytest.mark.root]

# Her engine's unit: until the test moves a container into its scope, its processes run in
# that unit's cgroup here (see above), where a real Podman never leaves them.
ENGINE_UNIT = f"user:{RootlessPodman.UNIT}"


@dataclass
class Stage:
    root: UserManager  # root's manager, with the guard in it
    mallory: User
    mum: UserManager
    hers: RootlessPodman
    bob: User
    bum: UserManager
    his: RootlessPodman

    def guard(self, *args: str) -> tuple[int, str]:
        done = subprocess.run(
            [PY, "-m", "spark_guard", *args, "--config", str(self.root.base / "guard.toml")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.returncode, done.stdout + done.stderr

    def configure(self, size: str) -> None:
        # Bob's container is protected by its name; until his engine has answered who it
        # is, the guard sees its processes as a scope of his (libpod-ID.scope), which a
        # duplicate of hers could stop in that window: his scopes are protected too. (That
        # window is a finding of its own, for issue 40's round of hostile users.)
        protected = [
            f"user:{self.bob.uid}:container:llm",
            f"user:{self.bob.uid}:libpod-*.scope",
            ENGINE_UNIT,
        ]
        write_config(
            self.root,
            f'[loaders.footprint]\n"container:llm" = "{size}"\n'
            f"[protected]\nextra = {json.dumps(protected)}\n",
        )
        offset = len(log_text(self.root))
        self.root.systemctl("reload", GUARD)
        wait_log(self.root, "config-reloaded", after=offset)


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    with (
        unprivileged_user() as mallory,
        unprivileged_user() as bob,
        guard_manager() as root,
        UserManager(user=mallory, user_runtime=root.user_runtime, setuid_helpers=True) as mum,
        UserManager(user=bob, user_runtime=root.user_runtime, setuid_helpers=True) as bum,
        RootlessPodman(mum) as hers,
        RootlessPodman(bum) as his,
    ):
        write_config(root)
        restart_guard(root)
        for user in (mallory, bob):
            wait_log(root, rf"manager-connected: watching user:{user.uid} manager")
        yield Stage(root, mallory, mum, hers, bob, bum, his)


def _run_loader(
    engine: RootlessPodman, um: UserManager, name: str = "llm", binary: str = TINY_LOADER
) -> Container:
    """`podman run -d --restart always --name NAME` of a llama-server, as its user, through
    her own socket; its processes put in the scope her manager would make for it."""
    engine.podman(
        "run", "-d", "--name", name, "--restart", "always", "--network", "none",
        TINY_IMAGE, binary, "-m", "/models/big.gguf",
    )  # fmt: skip
    box = engine.engine().inspect(name)
    assert box.running and box.pid and box.policy == "always"
    scope = Path("/sys/fs/cgroup/unified", um.cgroup, "user.slice", f"libpod-{box.id}.scope")
    scope.mkdir(parents=True, exist_ok=True)
    children = Path(f"/proc/{box.pid}/task/{box.pid}/children").read_text().split()
    for pid in [str(box.pid), *children]:
        (scope / "cgroup.procs").write_text(pid)
    return box


def test_her_rootless_loader_is_blocked_through_her_own_engine_and_bobs_is_untouched(
    stage: Stage,
) -> None:
    """Her `--restart always` llama-server container, over its footprint: the guard asks
    her engine who it is (the peer on her socket is her uid), names it
    user:UID:container:llm, judges it at her level, and stops it through her engine, where
    its policy does not bring it back. Podman 4.3 cannot change a restart policy, so the
    block says so (as for root's Podman). Bob's container of the same name, protected for
    him, runs on: his engine is never asked to stop anything. Released, hers runs again
    with the policy it never lost."""
    stage.configure("100GiB")
    his = _run_loader(stage.his, stage.bum)
    offset = len(log_text(stage.root))
    hers = _run_loader(stage.hers, stage.mum)
    key = f"user:{stage.mallory.uid}:container:llm"

    failed = wait_log(
        stage.root, rf"block-failed.*{re.escape(key)}.*cannot change a restart policy.*", 30, offset
    )
    assert "Podman before 5.1" in failed.group(0)
    now = stage.hers.engine().inspect("llm")
    assert (now.id, now.running, now.policy) == (hers.id, False, "always")
    time.sleep(1)
    assert not stage.hers.engine().inspect("llm").running  # its policy did not restart it
    record = json.loads((stage.root.base / "state" / "blocked" / f"{key}.json").read_text())
    assert record["manager"] == f"user:{stage.mallory.uid}" and record["unit"] == "container:llm"
    assert record["step"] == "stop" and "Podman before 5.1" in record["problem"]
    assert record["container"]["restart"] == "always"
    assert record["container"]["engine"] == str(stage.hers.socket)
    note = (stage.root.base / "motd.d" / "spark-guard").read_text()
    assert f"{key}  blocking (stop)" in note

    # Bob's, of the same name, protected: the same run, never asked to stop.
    still = stage.his.engine().inspect("llm")
    assert (still.running, still.pid, still.started_at) == (True, his.pid, his.started_at)
    text = log_text(stage.root)[offset:]
    assert f"user:{stage.bob.uid}:container:llm" not in text
    assert not re.search(r"unit-stop-requested: container:llm", text)

    # It fits after all: released, started, its policy never changed.
    stage.configure("1MiB")
    rc, out = stage.guard("release", key)
    assert rc == 0, out
    now = stage.hers.engine().inspect("llm")
    assert (now.running, now.policy) == (True, "always")
    assert not (stage.root.base / "state" / "blocked" / f"{key}.json").exists()
    for engine in (stage.hers, stage.his):
        engine.podman("rm", "-f", "-t", "0", "llm")


def test_her_container_that_ignores_its_stop_is_killed_below_the_reserve_hers_only(
    stage: Stage,
) -> None:
    """Below the reserve the guard does not wait out her engine's stop (60 s here): it
    kills her container's processes itself, as her groups are killed (her uid and her
    subuids', by the kernel's word), and her engine, asked to stop it, does not restart
    it. A process of root's in her container's scope (a setuid program she ran there) is
    spared."""
    write_config(
        stage.root,
        '[budget]\nreserve = "100TiB"\n[guard]\nstop_timeout = "60s"\n'
        f'[protected]\nextra = ["user:{stage.bob.uid}:container:*", "{ENGINE_UNIT}"]\n',
    )
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    key = f"user:{stage.mallory.uid}:container:fighter"
    fighter = _run_loader(stage.hers, stage.mum, "fighter", TINY_FIGHTER)
    scope = Path("/sys/fs/cgroup/unified", stage.mum.cgroup, "user.slice")
    scope = scope / f"libpod-{fighter.id}.scope"
    roots = subprocess.Popen(["sleep", "3600"])  # root's, in her scope
    try:
        (scope / "cgroup.procs").write_text(str(roots.pid))
        killed = wait_log(stage.root, rf"unit-killed: {re.escape(key)}.*", 40, offset)
        assert f"of uid {stage.mallory.uid}" in killed.group(0), killed.group(0)
        deadline = time.monotonic() + 20
        while stage.hers.engine().inspect("fighter").running and time.monotonic() < deadline:
            time.sleep(0.2)
        now = stage.hers.engine().inspect("fighter")
        assert not now.running, log_text(stage.root)[offset:][-3000:]
        assert roots.poll() is None  # root's process there lives on
        time.sleep(1)
        assert not stage.hers.engine().inspect("fighter").running  # not restarted
        record = json.loads((stage.root.base / "state" / "blocked" / f"{key}.json").read_text())
        assert record["reason"] == "reserve" and record["container"]["restart"] == "always"
    finally:
        roots.kill()
        roots.wait()
        write_config(stage.root)
        stage.root.systemctl("reload", GUARD)
        stage.guard("release", "--all")
        stage.hers.podman("rm", "-f", "-t", "0", "fighter")


# Her own engine, as she may write one: it answers for the id she gives it, says the
# container stopped when asked, and that its policy is "no" once updated.
FAKE_ENGINE = r"""
import json, socket, sys
path, cid = sys.argv[1], sys.argv[2]
stopped = False
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(8)
while True:
    c, _ = s.accept()
    method, target = c.recv(65536).decode().split(" ")[:2]
    status, body = "404 Not Found", b"{}"
    if method == "GET" and target == f"/containers/{cid}/json" or target == "/containers/llm/json":
        status = "200 OK"
        body = json.dumps({
            "Id": cid, "Name": "/llm", "Path": "llama-server", "Args": ["-m", "/m.gguf"],
            "Config": {"Image": "vllm/vllm-openai"},
            "State": {"Running": not stopped, "Status": "exited" if stopped else "running"},
            "HostConfig": {"RestartPolicy": {"Name": "no" if stopped else "always"}},
        }).encode()
    elif method == "POST" and target.startswith(f"/containers/{cid}/stop"):
        stopped, status, body = True, "204 No Content", b""
    elif method == "POST" and target == f"/containers/{cid}/update":
        status = "200 OK"
    c.sendall(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    c.close()
"""


def test_her_engine_that_says_stopped_while_her_loader_runs_is_not_believed(
    stage: Stage,
) -> None:
    """Her own engine (on rootless Docker's socket in her runtime dir) answers for a
    container whose scope holds her loader, says it stopped when the guard asks, and that
    its policy is now "no": her loader runs on. Her engine's word is hers: when the block
    ends with her processes still in the container's scope, the guard kills them (hers
    only), as it kills her groups. Before, the block was verified on her word and her
    loader was never stopped."""
    cid = os.urandom(32).hex()
    sock = stage.mum.runtime / "docker.sock"
    script = stage.mallory.home / "engine.py"
    script.write_text(FAKE_ENGINE)
    u = stage.mallory
    drop = ["setpriv", f"--reuid={u.uid}", f"--regid={u.gid}", "--clear-groups"]
    engine = subprocess.Popen([*drop, PY, str(script), str(sock), cid])
    loader = subprocess.Popen([*drop, "sleep", "3600"])
    try:
        stage.configure("100GiB")
        offset = len(log_text(stage.root))
        scope = Path(
            "/sys/fs/cgroup/unified", stage.mum.cgroup, "user.slice", f"libpod-{cid}.scope"
        )
        scope.mkdir(parents=True)
        (scope / "cgroup.procs").write_text(str(loader.pid))  # her manager's scope, as hers
        key = f"user:{u.uid}:container:llm"
        killed = wait_log(stage.root, rf"unit-killed: {re.escape(key)}.*", 30, offset)
        assert "her engine's block ended" in killed.group(0), killed.group(0)
        assert f"of uid {u.uid}" in killed.group(0), killed.group(0)
        assert loader.wait(5) == -9
    finally:
        for p in (engine, loader):
            if p.poll() is None:
                p.kill()
                p.wait()
        sock.unlink(missing_ok=True)
        stage.guard("release", "--all")
