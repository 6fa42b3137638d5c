"""A hostile local user against the guard: each attack done for real, as an unprivileged uid.

The stage: the guard runs as root, as a unit of root's own manager (standing
in for PID 1: its units are the ones a user must never reach). Mallory is a
real account (passwd entry, her own home, uid and gid), and her
`systemd --user` runs as her, in a cgroup named user@UID.service as PID 1
names it, with her runtime dir under the same root-owned runtime root the
guard watches. Every attack step is a command run as her (setpriv: her uid
and gid, no groups, no capabilities); every admin step is the real
`spark-guard` command root would run. The tests assert outcomes an admin
would check: what changed outside her tree (nothing), root's units (running,
not masked), the guard (active, never restarted), its login note (printable).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lab import LAB, synth
from lab.accounts import User, unprivileged_user
from lab.guardunit import (
    GUARD,
    PY,
    guard_manager,
    log_text,
    restart_guard,
    wait_log,
    write_config,
)
from lab.harness import UserManager, file_tree, poll
from spark_guard.statefile import readers_gid

pytestmark = pytest.mark.systemd

TINY = synth.Spec("Tiny", "llama", 2, 256, 4, 4, 64, 64, 2048, 1000, n_ff=512)


@dataclass
class Stage:
    root: UserManager  # root's manager, with the guard in it
    mum: UserManager  # Mallory's manager
    mallory: User
    server: Path  # a llama-server stand-in anyone may run
    models: Path  # root-owned, world-readable models
    big: Path  # DeepSeek-V3's header: 200+ GiB to any reader, a few kB on disk
    tiny: Path

    @property
    def key(self) -> str:
        return f"user:{self.mallory.uid}"

    def guard(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        """The admin's command, as root, against the guard's config."""
        return subprocess.run(
            [PY, "-m", "spark_guard", *args, "--config", str(self.root.base / "guard.toml")],
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def her_unit(self, name: str, exec_start: str, extra: str = "", install: str = "") -> Path:
        """A unit Mallory writes in her own ~/.config/systemd/user."""
        text = f"[Service]\nExecStart={exec_start}\nRestart=on-failure\n{extra}"
        if install:
            text += f"\n[Install]\nWantedBy={install}\n"
        path = self.mum.unit_dir / name
        self.mallory.run(PY, "-c", f"open({str(path)!r}, 'w').write({text!r})")
        self.mum.systemctl("daemon-reload")
        return path

    def her_files(self, names: list[str], text: str) -> None:
        """Many unit files of hers at once (one process as her), and her manager reloaded."""
        write = "import sys, pathlib; d = pathlib.Path(sys.argv[1]); t = sys.argv[2]\n"
        write += "for n in sys.argv[3:]: (d / n).write_text(t)"
        self.mallory.run(PY, "-c", write, str(self.mum.unit_dir), text, *names)
        self.mum.systemctl("daemon-reload")

    def her_files_gone(self, names: list[str]) -> None:
        unlink = (
            "import sys, pathlib; [(pathlib.Path(sys.argv[1]) / n).unlink() for n in sys.argv[2:]]"
        )
        self.mallory.run(PY, "-c", unlink, str(self.mum.unit_dir), *names)
        self.mum.systemctl("daemon-reload")

    def guard_props(self) -> dict[str, str]:
        return self.root.show(GUARD, "ActiveState", "NRestarts", "MainPID")

    def state(self) -> dict[str, Any]:
        return json.loads((self.root.base / "run" / "state.json").read_text())


@pytest.fixture(scope="module")
def stage() -> Iterator[Stage]:
    with (
        unprivileged_user() as mallory,
        guard_manager() as root,
        UserManager(user=mallory, user_runtime=root.user_runtime) as mum,
    ):
        tools = root.base / "bin"
        tools.mkdir()
        server = tools / "llama-server"
        server.write_text(f'#!/bin/sh\nexec {PY} {LAB}/fake_loader.py --alloc 20 "$@"\n')
        server.chmod(0o755)
        models = root.base / "models"
        big = synth.write(synth.SPECS["deepseek-v3"], models)
        tiny = synth.write(TINY, models)
        write_config(root)
        restart_guard(root)
        wait_log(root, rf"manager-connected: watching user:{mallory.uid} manager")
        yield Stage(root, mum, mallory, server, models, big, tiny)


@pytest.fixture(autouse=True)
def guard_keeps_running(stage: Stage, request: pytest.FixtureRequest) -> Iterator[None]:
    """After every attack: the guard is up and was never restarted (but by the test
    itself, marked restarts_guard), then a clean slate."""
    before = stage.guard_props()
    yield
    after = stage.guard_props()
    assert after["ActiveState"] == "active", log_text(stage.root)[-6000:]
    assert after["NRestarts"] == before["NRestarts"] == "0"
    if request.node.get_closest_marker("restarts_guard") is None:
        assert after["MainPID"] == before["MainPID"]
    stage.guard("release", "--all")


def _blocked(stage: Stage, unit: str, offset: int) -> None:
    wait_log(stage.root, rf"^warning unit-blocked: {stage.key}:{re.escape(unit)}", after=offset)


# --- 1. release must not write where her symlink points ---------------------------


def test_release_never_writes_through_her_symlinked_wants_dir(stage: Stage) -> None:
    unit_dir = stage.mum.unit_dir
    her_before = file_tree(unit_dir)
    stage.her_unit("llama-ds.service", f"{stage.server} -m {stage.big}", install="default.target")
    stage.mum.systemctl("enable", "llama-ds.service")
    enabled = file_tree(unit_dir)
    offset = len(log_text(stage.root))
    stage.mum.systemctl("start", "--no-block", "llama-ds.service")
    _blocked(stage, "llama-ds.service", offset)

    # Root's unit directory stands for /etc/systemd/system: a link there is a root unit.
    victim = stage.root.unit_dir
    victim_before = file_tree(victim)
    wants = unit_dir / "default.target.wants"
    stage.mallory.sh(f"rm -rf '{wants}'; ln -s '{victim}' '{wants}'")

    out = stage.guard("release", "--all")
    assert out.returncode != 0
    assert str(wants) in out.stderr, out.stderr
    assert file_tree(victim) == victim_before  # nothing created, changed or chowned
    stage.root.systemctl("daemon-reload")
    assert stage.root.show("llama-ds.service", "LoadState")["LoadState"] == "not-found"

    # She puts her directory back: release then restores her files byte for byte.
    stage.mallory.sh(f"rm '{wants}'; mkdir '{wants}'")
    out = stage.guard("release", "--all")
    assert out.returncode == 0, out.stderr
    assert file_tree(unit_dir) == enabled
    stage.mum.systemctl("disable", "llama-ds.service")
    (unit_dir / "llama-ds.service").unlink()
    assert set(file_tree(unit_dir)) >= set(her_before)


# --- 2. harden must not write through her symlinks ---------------------------------


def test_harden_never_writes_through_her_symlinks(stage: Stage) -> None:
    ref = f"{stage.key}:llama-h.service"
    stage.her_unit("llama-h.service", "/bin/sleep infinity")
    victim = stage.root.unit_dir
    before = file_tree(victim)
    drop_dir = stage.mum.unit_dir / "llama-h.service.d"

    # Her drop-in directory is a symlink to root's unit directory.
    stage.mallory.sh(f"ln -s '{victim}' '{drop_dir}'")
    out = stage.guard("harden", ref, "--yes")
    assert out.returncode != 0 and str(drop_dir) in out.stderr, out.stderr
    assert file_tree(victim) == before

    # Her drop-in is a symlink to a root-owned file: never read as ours, never written.
    secret = stage.root.base / "root-file.conf"
    secret.write_text("root's\n")
    secret.chmod(0o600)
    secret_before = file_tree(secret)
    stage.mallory.sh(
        f"rm '{drop_dir}'; mkdir '{drop_dir}'; ln -s '{secret}' '{drop_dir}/50-spark-guard.conf'"
    )
    out = stage.guard("harden", ref, "--yes")
    assert out.returncode != 0, out.stdout
    assert file_tree(secret) == secret_before and file_tree(victim) == before

    # Her own, untouched tree: the drop-in is written, and it is hers.
    stage.mallory.sh(f"rm -rf '{drop_dir}'")
    out = stage.guard("harden", ref, "--yes")
    assert out.returncode == 0, out.stderr
    made = drop_dir / "50-spark-guard.conf"
    assert made.stat().st_uid == stage.mallory.uid and drop_dir.stat().st_uid == stage.mallory.uid
    assert stage.guard("harden", ref, "--undo").returncode == 0
    assert not drop_dir.exists()
    (stage.mum.unit_dir / "llama-h.service").unlink()


# --- 3. a mask cannot be aimed at another manager ----------------------------------


def test_her_mask_cannot_be_redirected_into_roots_control_dir(stage: Stage) -> None:
    # Root runs cron.service; root's runtime control dir holds an admin's own mask.
    stage.root.write_unit("cron.service", "[Service]\nExecStart=/bin/sleep infinity\n")
    stage.root.systemctl("start", "cron.service")
    control = stage.root.runtime / "systemd" / "user.control"
    control.mkdir(exist_ok=True)
    (control / "admin-masked.service").symlink_to("/dev/null")
    control_before = file_tree(control)

    # She names her loader cron.service and points her control dir at root's.
    hers = stage.mum.runtime / "systemd" / "user.control"
    stage.mallory.sh(f"rm -rf '{hers}'; ln -s '{control}' '{hers}'")
    stage.her_unit("cron.service", f"{stage.server} -m {stage.big}")
    offset = len(log_text(stage.root))
    stage.mum.systemctl("start", "--no-block", "cron.service")
    failed = wait_log(
        stage.root, rf"^error block-failed: {stage.key}:cron.service: mask: .*$", after=offset
    )
    assert str(hers) in failed.group(0)
    stage.root.systemctl("daemon-reload")
    assert stage.root.show("cron.service", "LoadState", "ActiveState") == {
        "LoadState": "loaded",
        "ActiveState": "active",
    }
    assert file_tree(control) == control_before

    # Release (the mirror): the admin's mask of that name and root's cron stay as they are.
    stage.guard("release", "--all")
    assert file_tree(control) == control_before
    assert stage.root.show("cron.service", "ActiveState")["ActiveState"] == "active"

    # Her directory back as it should be: the block completes, in her tree only.
    stage.mallory.sh(f"rm '{hers}'; mkdir '{hers}'")
    stage.mum.systemctl("reset-failed", check=False)
    offset = len(log_text(stage.root))
    stage.mum.systemctl("start", "--no-block", "cron.service")
    _blocked(stage, "cron.service", offset)
    mask = hers / "cron.service"
    assert os.readlink(mask) == "/dev/null" and mask.lstat().st_uid == stage.mallory.uid
    assert file_tree(control) == control_before
    stage.guard("release", "--all")
    stage.root.systemctl("stop", "cron.service")
    (stage.mum.unit_dir / "cron.service").unlink()


# --- 4. a fake manager on her socket is not believed --------------------------------


def test_a_fake_manager_on_her_socket_is_not_believed(stage: Stage) -> None:
    # Root's loader, within budget, running in root's manager.
    stage.root.write_unit(
        "llama-root.service", f"[Service]\nExecStart={stage.server} -m {stage.tiny}\n"
    )
    stage.root.systemctl("start", "llama-root.service")
    root_cgroup = stage.root.show("llama-root.service", "ControlGroup")["ControlGroup"]
    app_slice = os.path.dirname(root_cgroup)

    with unprivileged_user() as eve:
        # Eve has no systemd of her own running: she listens where it would, and lies.
        runtime = stage.root.user_runtime / str(eve.uid)
        runtime.mkdir(mode=0o700)
        os.chown(runtime, eve.uid, eve.gid)
        eve.sh(f"mkdir '{runtime}/systemd'")
        log = eve.home / "fake.log"
        fake = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={eve.uid}",
                f"--regid={eve.gid}",
                "--clear-groups",
                "sh",
                "-c",
                f"exec {PY} {LAB}/fake_manager.py {runtime}/systemd/private {app_slice} "
                f"{stage.root.runtime}/systemd/user.control llama-root.service > {log} 2>&1",
            ]
        )
        try:
            offset = len(log_text(stage.root))
            untrusted = wait_log(
                stage.root, rf"^warning manager-untrusted: .*user:{eve.uid}.*$", after=offset
            )
            assert "not this user's systemd" in untrusted.group(0)
            time.sleep(2)  # several passes
            assert "call " not in log.read_text()  # refused before its first answer
            units = [ld["unit"] for ld in stage.state()["loaders"]]
            assert "user:0:llama-root.service" in units
            assert not any(u.startswith(f"user:{eve.uid}:") for u in units)
        finally:
            fake.kill()
            fake.wait()

        # The same, by a symlink: her systemd dir points at root's manager's.
        (runtime / "systemd" / "private").unlink(missing_ok=True)
        eve.sh(
            f"rmdir '{runtime}/systemd'; ln -s '{stage.root.runtime}/systemd' '{runtime}/systemd'"
        )
        offset = len(log_text(stage.root))
        wait_log(
            stage.root,
            rf"^warning manager-untrusted: .*user:{eve.uid}.*symlink",
            after=offset,
            timeout=25,
        )
        os.unlink(runtime / "systemd")
        runtime.rmdir()

    props = stage.root.show("llama-root.service", "ActiveState", "NRestarts", "LoadState")
    assert props == {"ActiveState": "active", "NRestarts": "0", "LoadState": "loaded"}
    stage.root.systemctl("stop", "llama-root.service")


# --- 5 and 9. model files that hang or explode, argv that costs -----------------------


def test_models_that_hang_or_explode_and_huge_argv_do_not_stop_the_guard(stage: Stage) -> None:
    models = stage.mallory.home / "models"
    stage.mallory.sh(f"mkdir -p '{models}'; mkfifo '{models}/fifo.gguf'")
    # A sparse 1 TiB file whose header claims 2^34 tensors; one with 2^36 empty strings.
    write = (
        "import struct,sys\n"
        "with open(sys.argv[1],'wb') as f:\n"
        "  f.write(b'GGUF'+struct.pack('<IQQ',3,2**34,0)); f.truncate(2**40)\n"
        "with open(sys.argv[2],'wb') as f:\n"
        "  f.write(b'GGUF'+struct.pack('<IQQ',3,0,1)+struct.pack('<Q',3)+b'key'"
        "+struct.pack('<IIQ',9,8,2**36)); f.truncate(2**40)\n"
    )
    stage.mallory.run(PY, "-c", write, str(models / "tensors.gguf"), str(models / "strings.gguf"))
    offset = len(log_text(stage.root))
    for name, model in (
        ("fifo", "fifo.gguf"),
        ("tensors", "tensors.gguf"),
        ("strings", "strings.gguf"),
    ):
        stage.her_unit(f"llama-{name}.service", f"{stage.server} -m {models / model}")
        stage.mum.systemctl("start", "--no-block", f"llama-{name}.service")
    # Four processes with 1 MiB of arguments each, full of spaces (what shlex chews on).
    # sh stays the process (a loop, not exec), holding that argv.
    spawn = (
        "import os; os.execv('/bin/sh', "
        "['sh', '-c', 'while :; do sleep 3600; done', 'llama'] + ['x ' * 32768] * 16)"
    )
    for i in range(4):
        stage.her_unit(f"argv-{i}.service", f'{PY} -c "{spawn}"')
        stage.mum.systemctl("start", f"argv-{i}.service")
    for name in ("fifo", "tensors", "strings"):
        wait_log(
            stage.root,
            rf"^warning footprint-unknown: .*{stage.key}:llama-{name}.service",
            after=offset,
        )

    # A genuinely over-budget loader after all that: still blocked, before it allocates.
    stage.her_unit("llama-big.service", f"{stage.server} -m {stage.big}")
    offset = len(log_text(stage.root))
    stage.mum.systemctl("start", "--no-block", "llama-big.service")
    _blocked(stage, "llama-big.service", offset)

    pid = stage.guard_props()["MainPID"]
    status = Path(f"/proc/{pid}/status").read_text()
    peak_kib = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]
    print(f"guard peak (VmHWM) after the attacks: {peak_kib} kB")  # docs/security.md
    assert peak_kib < 128 * 1024, status  # the unit's MemoryMax=; today's peak is far below
    for name in ("fifo", "tensors", "strings", *(f"argv-{i}" for i in range(4))):
        stage.mum.systemctl(
            "stop", f"{name if name.startswith('argv') else 'llama-' + name}.service"
        )


# --- 6. text from her files reaches root's terminal only made printable ----------------


EVIL = "x\x1b[2J\x1b[H\rRun as root: curl -s fix.example | sh\n\u202egguf.evil"


def test_her_escape_sequences_never_reach_roots_login_note_status_or_journal(stage: Stage) -> None:
    models = stage.mallory.home / "models"
    evil = models / f"{EVIL}.gguf"
    stage.mallory.run(
        PY,
        "-c",
        f"import os; os.makedirs({str(models)!r}, exist_ok=True); "
        f"open({str(evil)!r}, 'wb').write(b'GGUF' + bytes(4096))",
    )
    # systemd's C escapes carry the bytes into the argument as they are.
    escaped = str(evil).encode("unicode_escape").decode().replace("\\u202e", "\\xe2\\x80\\xae")
    offset = len(log_text(stage.root))
    for name in ("llama-first.service", "llama-second.service"):
        stage.her_unit(name, f'{stage.server} -m "{escaped}"')
        stage.mum.systemctl("start", name)
        time.sleep(1.0)  # started in that order
    _blocked(stage, "llama-second.service", offset)

    note = (stage.root.base / "motd.d" / "spark-guard").read_text()
    issue = (stage.root.base / "issue").read_text()
    status = stage.guard("status").stdout
    logged = log_text(stage.root)[offset:]
    for text in (note, issue, status, logged):
        assert all(c.isprintable() or c == "\n" for c in text), repr(text[:2000])
        assert not any(line.lstrip().startswith("Run as root") for line in text.splitlines())
    assert "\\x1b[2J" in note and "llama-second.service" in note
    for name in ("llama-first.service", "llama-second.service"):
        stage.mum.systemctl("stop", name, check=False)


# --- 7. the duplicate rule cannot be turned against root's units -----------------------


def test_her_units_cannot_get_a_root_unit_blocked_as_a_duplicate(stage: Stage) -> None:
    # She starts first, merely naming root's model; root's loader starts after.
    stage.her_unit("sleep-dup.service", f'/bin/sh -c "sleep infinity" sh {stage.tiny}')
    stage.mum.systemctl("start", "sleep-dup.service")
    # And a real loader of the same file, also before root's.
    stage.her_unit("llama-copy.service", f"{stage.server} -m {stage.tiny}")
    stage.mum.systemctl("start", "llama-copy.service")
    time.sleep(1.0)
    stage.root.write_unit(
        "llama-sys.service", f"[Service]\nExecStart={stage.server} -m {stage.tiny}\n"
    )
    offset = len(log_text(stage.root))
    stage.root.systemctl("start", "llama-sys.service")
    _blocked(stage, "llama-copy.service", offset)  # across levels, the user's copy goes
    time.sleep(1.5)
    assert stage.root.show("llama-sys.service", "ActiveState", "LoadState") == {
        "ActiveState": "active",
        "LoadState": "loaded",
    }
    assert stage.mum.show("sleep-dup.service", "ActiveState")["ActiveState"] == "active"
    assert "decision: stop user:0:llama-sys.service" not in log_text(stage.root)[offset:]
    stage.root.systemctl("stop", "llama-sys.service")
    stage.mum.systemctl("stop", "sleep-dup.service")


def test_her_unit_named_as_pid1s_sshd_is_hers_and_refused(stage: Stage) -> None:
    """Protected names are PID 1's: her own ~/.config/systemd/user/sshd@.service, started
    as sshd@llm.service and loading a model that cannot fit, is refused and blocked like
    any unit of hers (before, the name alone kept it from being judged at all)."""
    stage.her_unit("sshd@.service", f"{stage.server} -m {stage.big}")
    offset = len(log_text(stage.root))
    stage.mum.systemctl("start", "sshd@llm.service")
    _blocked(stage, "sshd@llm.service", offset)
    assert stage.mum.show("sshd@llm.service", "LoadState")["LoadState"] == "masked"
    assert stage.mum.show("sshd@llm.service", "ActiveState")["ActiveState"] != "active"


def test_state_json_names_what_others_load_to_root_and_adm_only(stage: Stage) -> None:
    """The published state names every user's loaders and what their prediction read
    (folders inside a 0700 tree, for `lms load`): root's and group adm's, not hers; her
    `spark-guard status` says so in one line."""
    path = stage.root.base / "run" / "state.json"
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 0, readers_gid())
    out = stage.mallory.run(
        PY,
        "-m",
        "spark_guard",
        "status",
        "--config",
        str(stage.root.base / "guard.toml"),
        check=False,
    )
    # 4: cannot say (exits.py); she is not told whether the guard runs.
    assert out.returncode == 4 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().endswith("run status as root, or as a member of adm"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""


# --- 8. no answer tells her whether a root-only file exists ----------------------------


def test_whether_a_root_only_path_exists_is_not_revealed(stage: Stage) -> None:
    secret = stage.root.base / "secret"
    secret.mkdir(mode=0o700)
    synth.write(TINY, secret)
    present = next(secret.glob("*.gguf"))
    absent = secret / "absent.gguf"
    for name, model in (("llama-s1.service", present), ("llama-s2.service", absent)):
        stage.her_unit(name, f"{stage.server} -m {model}", extra="RestartSec=1h\n")
        stage.mum.systemctl("start", "--no-block", name)
    deadline = time.monotonic() + 20
    said: dict[str, str] = {}
    while time.monotonic() < deadline and len(said) < 2:
        for ld in stage.state()["loaders"]:
            if (
                ld["unit"] in (f"{stage.key}:llama-s1.service", f"{stage.key}:llama-s2.service")
                and ld["prediction"]
                and "reading" not in ld["prediction"]
            ):
                said[ld["unit"]] = ld["prediction"]
        time.sleep(0.2)
    assert len(said) == 2, said
    first = said[f"{stage.key}:llama-s1.service"].replace(str(present), "PATH")
    second = said[f"{stage.key}:llama-s2.service"].replace(str(absent), "PATH")
    assert first == second
    for name in ("llama-s1.service", "llama-s2.service"):
        stage.mum.systemctl("stop", name, check=False)


# --- 9. a loader whose manager is out of view is still hers to judge ---------------------


def test_her_loader_with_her_manager_out_of_view_is_killed_in_her_subtree(stage: Stage) -> None:
    """She renames her manager's socket, then a timer of hers starts a loader that cannot
    fit. Her processes run below user@UID.service: PID 1's, protected, or no manager's
    at all, so before they grew unseen. Now they are hers by the kernel's word (cgroup
    below user@UID.service and her real uid), judged, and killed within her own
    subtree; once her manager answers again the block completes as any other."""
    write_config(stage.root, '[loaders.footprint]\n"llama-hide.service" = "100TiB"\n')
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    # It allocates as a loader does (1 GiB): a steady guard looks at every process when
    # MemAvailable falls, and at least once a minute.
    stage.her_unit("llama-hide.service", f"{PY} {LAB}/fake_loader.py -m {stage.tiny} --alloc 1024")
    timer = stage.mum.unit_dir / "llama-hide.timer"
    # AccuracySec=: a timer's default accuracy is a minute, and systemd may take all of it.
    stage.mallory.run(
        PY,
        "-c",
        f"open({str(timer)!r}, 'w').write('[Timer]\\nOnActiveSec=4s\\nAccuracySec=100ms\\n')",
    )
    stage.mum.systemctl("daemon-reload")
    stage.mum.systemctl("start", "llama-hide.timer")
    socket = stage.mum.runtime / "systemd" / "private"
    hidden = socket.with_name("private.hidden")
    offset = len(log_text(stage.root))
    stage.mallory.run("mv", str(socket), str(hidden))
    try:
        wait_log(stage.root, rf"manager-lost: {stage.key} manager", after=offset)
        try:
            seen = wait_log(
                stage.root,
                rf"loader-seen: model loader {stage.key}:llama-hide\.service.*",
                30,
                offset,
            )
        except AssertionError as e:
            ps = subprocess.run(
                ["ps", "-o", "pid,uid,stat,args", "-u", str(stage.mallory.uid)],
                capture_output=True,
                text=True,
            ).stdout
            cgroups = {
                p: Path(f"/proc/{p}/cgroup").read_text()
                for p in re.findall(r"^\s*(\d+)", ps, re.M)
                if Path(f"/proc/{p}/cgroup").exists()
            }
            state = stage.state()
            raise AssertionError(
                f"{e}\nps:\n{ps}\ncgroups: {cgroups}\nstate units: "
                f"{[u.get('unit') for u in state.get('loaders', [])]} phase "
                f"{state.get('phase')}\nher manager:\n"
                f"{stage.mum.log.read_text(errors='replace')[-3000:]}"
            ) from None
        assert "its manager is out of view: judged by what the kernel shows" in seen.group(0)
        # Paused, not killed (a kill is what Restart= answers with a new run): the stop
        # goes through her manager if it answers within stop_timeout.
        paused = wait_log(
            stage.root,
            rf"unit-stop-failed: cannot stop {stage.key}:llama-hide\.service.*",
            20,
            offset,
        )
        assert "its processes are paused (SIGSTOP) until it answers" in paused.group(0)
        # She sends her own processes SIGCONT: a paused loader that runs again is killed.
        resumed = time.monotonic()
        stage.mallory.run("pkill", "-CONT", "-f", "fake_loader.py", check=False)
        killed = wait_log(
            stage.root, rf"unit-killed: {stage.key}:llama-hide\.service.*", 20, offset
        )
        assert "killed its cgroup" in killed.group(0), killed.group(0)
        # At the next passes, not at the end of the pause's stop_timeout (10 s).
        assert time.monotonic() - resumed < 6, time.monotonic() - resumed
    finally:
        stage.mallory.run("mv", str(hidden), str(socket))
    # Her manager answers again: the block completes, masked like any other.
    _blocked(stage, "llama-hide.service", offset)
    assert stage.mum.show("llama-hide.service", "LoadState")["LoadState"] == "masked"
    # Nobody else's unit was touched.
    assert stage.root.show("rescue-ssh.service", "LoadState")["LoadState"] == "loaded"
    stage.mum.systemctl("stop", "llama-hide.timer")
    write_config(stage.root)
    stage.root.systemctl("reload", GUARD)


def test_root_tools_never_give_an_all_clear_past_her_manager_out_of_view(stage: Stage) -> None:
    """Issue 40, H5: she renames her manager's socket while her loader runs. No manager
    the admin's tools reach lists it, and they listed only what managers list: `rescue
    --dry-run` said "nothing to stop" and `audit` found no loader, both exit 0. They see
    what the daemon sees now: the kernel shows her unit's processes below her
    user@UID.service. Audit names it; rescue kills it in her subtree and says it is not
    held (her manager may run it again), exit 1 either way."""
    stage.her_unit(
        "llama-unseen.service",
        f"{PY} {LAB}/fake_loader.py -m {stage.tiny} --alloc 16",
        extra="Restart=no\n",
    )
    stage.mum.systemctl("start", "llama-unseen.service")
    assert not _gone(stage, "llama-unseen|fake_loader.py -m", 0)
    socket = stage.mum.runtime / "systemd" / "private"
    hidden = socket.with_name("private.hidden")
    offset = len(log_text(stage.root))
    stage.mallory.run("mv", str(socket), str(hidden))
    unit = f"{stage.key}:llama-unseen.service"
    try:
        wait_log(stage.root, rf"manager-lost: {stage.key} manager", after=offset)
        dry = stage.guard("rescue", "--dry-run")
        assert f"would kill (its manager is out of view: no mask until it answers): {unit}" in (
            dry.stdout
        ), dry.stdout + dry.stderr
        assert dry.returncode == 1, dry.stdout + dry.stderr
        audit = stage.guard("audit")
        line = next((ln for ln in audit.stdout.splitlines() if "unlisted-loader" in ln), "")
        assert unit in audit.stdout and "whose manager was not reached" in line, audit.stdout
        assert audit.returncode == 1, audit.stdout + audit.stderr
        out = stage.guard("rescue")
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(unit)), "")
        assert re.search(r"\sunreached\s+killed\s", line), out.stdout + out.stderr
        assert f"{stage.key}: its manager is out of view" in out.stdout, out.stdout
        assert out.returncode == 1, out.stdout + out.stderr
        assert _gone(stage, "fake_loader.py -m")
    finally:
        stage.mallory.run("mv", str(hidden), str(socket))
    wait_log(stage.root, rf"manager-connected: watching {stage.key} manager", after=offset)
    # Rescue wrote nothing for it: no record, no mask (nothing for release to undo).
    assert stage.mum.show("llama-unseen.service", "LoadState")["LoadState"] == "loaded"


def test_her_unit_too_big_to_read_costs_rescue_no_all_clear(stage: Stage) -> None:
    """A fault review of H5: rescue counted her manager as reached when it connected, not
    when her units were listed. Her unit with an Environment= over DETAILS_CAP is not
    read, and the first such unit ended the listing of all of hers: no loader of hers
    was listed, none was left to the kernel's view, and rescue said "no model loaders
    found", exit 0, while her loader ran. The others are read now; a manager not listed
    whole is judged by what the kernel shows, and rescue and audit exit 1."""
    from spark_guard.system.managers import DETAILS_CAP

    draft = stage.root.base / "draft-env.service"
    draft.write_text(
        f"[Service]\nExecStart={PY} {LAB}/fake_loader.py -m {stage.tiny} --alloc 16\n"
        # Three lines: one string over 128 KiB is more than execve() takes (E2BIG).
        + "".join(f"Environment=PAD{i}={'x' * (DETAILS_CAP // 3 + 4096)}\n" for i in range(3))
    )
    draft.chmod(0o644)
    path = stage.mum.unit_dir / "aaa-env.service"
    stage.mallory.run(
        PY, "-c", "import shutil, sys; shutil.copyfile(*sys.argv[1:])", str(draft), str(path)
    )
    stage.mum.systemctl("daemon-reload")
    stage.mum.systemctl("start", "aaa-env.service")
    unit = f"{stage.key}:aaa-env.service"
    try:
        assert not _gone(stage, "fake_loader.py -m", 0)
        audit = stage.guard("audit")
        assert audit.returncode == 1, audit.stdout + audit.stderr
        assert unit in audit.stdout and "whose manager was not reached" in audit.stdout, (
            audit.stdout
        )
        out = stage.guard("rescue")
        assert f"not reached: {stage.key}: its units could not all be listed" in out.stderr, (
            out.stdout + out.stderr
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(unit)), "")
        assert re.search(r"\sunreached\s+killed\s", line), out.stdout + out.stderr
        assert out.returncode == 1, out.stdout + out.stderr
        assert _gone(stage, "fake_loader.py -m")
    finally:
        stage.mum.systemctl("stop", "aaa-env.service", check=False)
        stage.mallory.run("rm", "-f", str(path))
        stage.mum.systemctl("daemon-reload")


# --- 10. processes that are no unit: a cgroup of her own, her job in root's unit --------


def _gone(stage: Stage, pattern: str, timeout: float = 5, uid: int | None = None) -> bool:
    """No process of hers (or of `uid`) matches `pattern` (pgrep -f), within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            ["pgrep", "-u", str(stage.mallory.uid if uid is None else uid), "-f", "--", pattern],
            capture_output=True,
            text=True,
        ).stdout.split()
        if not out:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.parametrize(
    "where", ["hideout", "init.scope", "ghost.service", "subuid", "deep", "deepest", "itself"]
)
def test_her_loader_in_a_cgroup_that_names_no_unit_is_hers_and_killed(
    stage: Stage, where: str
) -> None:
    """She moves her loader out of its unit into a cgroup of her own below her
    user@UID.service (`hideout`), into her manager's init.scope, or into one she named
    `ghost.service`, a unit her manager does not know; or her loader runs as one of her
    subuids, as a rootless container's does (`subuid`: root stands in for newuidmap). No
    manager accounts for it there, and before it counted as PID 1's protected
    user@UID.service (or as a unit that does not run), growing unseen. Now it is a group
    of hers, judged at her level, and a stop kills her processes in it: her manager (the
    oldest in init.scope) lives on, and nothing of root's is touched. `deep`: below her
    hideout she makes a cgroup tree 1,000 levels deep, which made the walk of the kill
    raise RecursionError: her loader was never killed; `deepest`: her loader is 1,000
    levels down, beyond the bounded walk, and was never killed either; `itself`: in
    user@UID.service itself, not below it (issue 40, H3), where it counted for PID 1's
    protected unit, and its kill must take neither her manager nor her units."""
    base = f"/sys/fs/cgroup/unified/{stage.mum.cgroup}"
    target = base if where == "itself" else f"{base}/{where}"
    if where == "itself":
        where = f"user@{stage.mallory.uid}.service"  # the group is named by its cgroup
    glob = f"*{where}"
    if where == "subuid":
        _her_subuid_loader(stage, target, glob)
        return
    write_config(stage.root, f'[loaders.footprint]\n"{glob}" = "100TiB"\n')
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    stage.her_unit(
        "mover.service", f"{PY} {LAB}/fake_loader.py -m {stage.tiny} --alloc 64 --hide-{where}"
    )
    stage.mum.systemctl("start", "mover.service")
    pid = stage.mum.show("mover.service", "MainPID")["MainPID"]
    stage.her_unit("bystander.service", "/bin/sleep 3600")  # a unit of hers, not a loader
    stage.mum.systemctl("start", "bystander.service")
    # From her shell, as her: the cgroup tree below user@UID.service is delegated to her.
    down = "/".join(["a"] * 1000)
    if where == "deepest":
        stage.mallory.sh(f"mkdir -p {target}; cd {target} && mkdir -p {down}")
        stage.mallory.sh(f"cd {target}/{down} && echo {pid} > cgroup.procs")
    else:
        stage.mallory.sh(f"mkdir -p {target}; echo {pid} > {target}/cgroup.procs")
    if where == "deep":
        stage.mallory.sh(f"cd {target} && mkdir -p {down}")
    killed = wait_log(
        stage.root, rf"unit-killed: {stage.key}:\S*{re.escape(where)}: killed .*", 30, offset
    )
    if where.startswith("deep"):  # (the harness's own teardown walks recursively)
        stage.mallory.sh(f"find {target} -mindepth 1 -depth -type d -exec rmdir {{}} +")
    assert f"of uid {stage.mallory.uid}" in killed.group(0), killed.group(0)
    assert "no mask laid, nothing to undo" in killed.group(0)
    # The process she moved is dead (her mover.service's Restart= may start another run).
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), killed.group(0)
    seen = wait_log(stage.root, rf"loader-seen: model loader {stage.key}:\S*{where}", 5, offset)
    assert stage.key in seen.group(0)
    # Her manager answers still (spared: the oldest in its init.scope), her other unit
    # runs on, and nothing was masked or recorded.
    assert stage.mum.show("mover.service", "LoadState")["LoadState"] == "loaded"
    assert stage.mum.show("bystander.service", "ActiveState")["ActiveState"] == "active"
    stage.mum.systemctl("stop", "bystander.service")
    assert not list((stage.root.base / "state" / "blocked").glob(f"{stage.key}*"))
    assert stage.root.show("rescue-ssh.service", "LoadState")["LoadState"] == "loaded"
    write_config(stage.root)
    stage.root.systemctl("reload", GUARD)


def _her_subuid_loader(stage: Stage, target: str, glob: str) -> None:
    """A loader of her user namespace's (uid 100000 + hers) in a cgroup of her tree."""
    write_config(stage.root, f'[loaders.footprint]\n"{glob}" = "100TiB"\n')
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    sub = 100000 + stage.mallory.uid
    os.makedirs(target, exist_ok=True)
    loader = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={sub}",
            f"--regid={sub}",
            "--clear-groups",
            PY,
            f"{LAB}/fake_loader.py",
            "-m",
            str(stage.tiny),
            "--alloc",
            "64",
            "--subuid",
        ],
        stdin=subprocess.DEVNULL,
    )
    try:
        Path(target, "cgroup.procs").write_text(str(loader.pid))
        killed = wait_log(stage.root, rf"unit-killed: {stage.key}:\S*subuid: killed .*", 30, offset)
        assert "no mask laid, nothing to undo" in killed.group(0), killed.group(0)
        assert loader.wait(5) == -9  # SIGKILL: the kill reached her subuid
        assert not list((stage.root.base / "state" / "blocked").glob(f"{stage.key}*"))
        assert stage.root.show("rescue-ssh.service", "LoadState")["LoadState"] == "loaded"
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.wait()
        write_config(stage.root)
        stage.root.systemctl("reload", GUARD)


def test_rescue_kills_her_group_and_its_fork_storm_until_none_is_left(stage: Stage) -> None:
    """The admin's rescue reaches processes that are no unit: her loader in a cgroup of her
    own, beside a shell that forks as fast as it can. A kill has a budget on the loop,
    and rescue used to get a single one at groups; now it kills again until a kill finds
    nothing new of hers, and says the group was killed. (The daemon's footprint leaves
    the tiny model alone, and its boot allowance for a group of unknown size is set out
    of the way: a storm's thousand processes' RSS add up past 2 GiB. The rescue is the
    admin's, not the guard's.)"""
    write_config(stage.root, unsized="1TiB")
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    target = f"/sys/fs/cgroup/unified/{stage.mum.cgroup}/stormy"
    stage.mallory.sh(f"mkdir -p {target}")
    drop = ["setpriv", f"--reuid={stage.mallory.uid}", f"--regid={stage.mallory.uid}"]
    storm = subprocess.Popen(
        [
            *drop,
            "--clear-groups",
            "sh",
            "-c",
            f"read go; {PY} {LAB}/fake_loader.py -m {stage.tiny} --alloc 16 --stormy & "
            "while :; do sleep 60 & done",
        ],
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        Path(target, "cgroup.procs").write_text(str(storm.pid))  # root stands in for her move
        assert storm.stdin is not None
        storm.stdin.write("go\n")
        storm.stdin.close()
        deadline = time.monotonic() + 10
        while _gone(stage, "--stormy", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the storm under way
        assert len(Path(target, "cgroup.procs").read_text().split()) > 20
        out = stage.guard("rescue")
        line = next((ln for ln in out.stdout.splitlines() if "stormy" in ln), "")
        assert re.search(r"\sno unit\s+killed\s", line), out.stdout + out.stderr
        assert "killed processes that are no unit: nothing to undo" in out.stdout
        assert storm.wait(5) == -9
        time.sleep(0.5)
        assert Path(target, "cgroup.procs").read_text().split() == []
        assert _gone(stage, "--stormy", 0)
    finally:
        if storm.poll() is None:
            storm.kill()
            storm.wait()
        for pid in Path(target, "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        time.sleep(0.2)
        stage.mallory.sh(f"rmdir {target}")
        write_config(stage.root)
        offset = len(log_text(stage.root))
        stage.root.systemctl("reload", GUARD)
        wait_log(stage.root, "config-reloaded", after=offset)


@pytest.mark.parametrize("as_", ["her uid", "her subuid"])
def test_her_job_in_a_unit_of_roots_is_hers_not_the_units(stage: Stage, as_: str) -> None:
    """Root's jobs.service runs what users put in its spool as them, as Debian's cron runs
    crontabs (no pam_systemd: the job stays in cron.service's cgroup), or as one of her
    subuids (her job in a user namespace of hers). Her job is a fake llama-server naming
    the model root's llama-root.service loads, started first: before, it counted for
    jobs.service, root's, which kept the model and got root's later loader refused as
    the duplicate (and a subuid, outside a login range, would again). Now her processes
    in root's unit are a group of their uid: her copy is the one refused, and killed,
    the uid named; jobs.service and root's loader run on, unmasked."""
    spool = stage.root.base / "spool"
    spool.mkdir(mode=0o1777, exist_ok=True)
    spool.chmod(0o1777)
    u = stage.mallory
    uid = u.uid if as_ == "her uid" else 100000 + u.uid
    runner = (
        f'while :; do for f in {spool}/*.job; do [ -f "$f" ] || continue; '
        f'mv "$f" "$f.run"; setpriv --reuid={uid} --regid={uid} --clear-groups '
        'bash "$f.run" & '
        "done; sleep 0.2; done"
    )
    stage.root.write_unit("jobs.service", f"[Service]\nExecStart=/bin/sh -c '{runner}'\n")
    stage.root.systemctl("start", "jobs.service")
    offset = len(log_text(stage.root))
    job = spool / "her.job"
    stage.mallory.run(
        PY,
        "-c",
        f"open({str(job)!r}, 'w').write('exec -a llama-server {PY} {LAB}/fake_loader.py "
        f"-m {stage.tiny} --alloc 16 --her-job\\n')",
    )
    deadline = time.monotonic() + 10
    while _gone(stage, "--her-job", 0, uid) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # her copy is the first started
    stage.root.write_unit(
        "llama-root.service", f"[Service]\nExecStart={stage.server} -m {stage.tiny}\n"
    )
    stage.root.systemctl("start", "llama-root.service")
    killed = wait_log(stage.root, rf"unit-killed: user:{uid}:\S*jobs\.service: .*", 30, offset)
    assert f"of uid {uid}" in killed.group(0) and "duplicate" in killed.group(0), killed.group(0)
    assert _gone(stage, "--her-job", uid=uid)
    time.sleep(2)
    text = log_text(stage.root)[offset:]
    for unit in ("jobs.service", "llama-root.service"):
        assert f"decision: stop user:0:{unit}" not in text, text[-3000:]
    for unit in ("jobs.service", "llama-root.service"):
        props = stage.root.show(unit, "ActiveState", "LoadState")
        assert props == {"ActiveState": "active", "LoadState": "loaded"}, (unit, props)
    stage.root.systemctl("stop", "jobs.service", "llama-root.service")


# --- 11. a load asked over a server's API, from outside any unit -----------------------


def test_a_server_asked_over_its_api_is_stopped_never_masked(stage: Stage) -> None:
    """Ollama has no authentication: from an ssh session she asks root's ollama.service
    for a model that cannot fit. No unit asked the load, so the server's unit is not what
    brings it back: before, the rule masked and disabled root's server for everyone. Now
    it is stopped (frozen first), not masked or disabled, nothing recorded: it may start
    again, loading nothing. (The footprint here is the admin's figure, standing in for
    the load her request started.)"""
    ollama = stage.root.base / "bin" / "ollama"
    ollama.write_text(f'#!/bin/sh\nexec {PY} {LAB}/fake_loader.py --alloc 20 --ollama "$@"\n')
    ollama.chmod(0o755)
    write_config(stage.root, '[loaders.footprint]\n"ollama.service" = "100TiB"\n')
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    stage.root.write_unit(
        "ollama.service",
        f"[Service]\nExecStart={ollama} serve\nRestart=always\n"
        "[Install]\nWantedBy=default.target\n",
    )
    stage.root.systemctl("enable", "--now", "ollama.service")
    said = wait_log(
        stage.root, r"unit-stop-requested: stopping user:0:ollama\.service.*", 30, offset
    )
    assert "not masking or disabling it" in said.group(0), said.group(0)
    stage.root.wait_for("ollama.service", "ActiveState", "inactive")
    props = stage.root.show("ollama.service", "LoadState", "UnitFileState")
    assert props == {"LoadState": "loaded", "UnitFileState": "enabled"}, props
    assert not list((stage.root.base / "state" / "blocked").glob("*ollama*"))
    text = log_text(stage.root)[offset:]
    assert "unit-blocked: user:0:ollama.service" not in text
    write_config(stage.root)
    stage.root.systemctl("reload", GUARD)
    stage.root.systemctl("disable", "ollama.service")


@pytest.mark.restarts_guard
def test_a_server_that_will_not_stop_is_killed_and_one_that_preloads_is_blocked(
    stage: Stage,
) -> None:
    """Root's server, asked over its API, is stopped without a mask; but its ExecStop=
    never ends and TimeoutStopSec=infinity. Before, it stayed deactivating, holding its
    memory, counted as leaving. Now the stop is escalated as a block's is: SIGKILL after
    the stop timeout, still not masked. A server whose own unit asks the load
    (ExecStartPost= preloads it with curl) loads by itself: blocked, masked, and released
    as any other."""
    ollama = stage.root.base / "bin" / "ollama"
    ollama.write_text(f'#!/bin/sh\nexec {PY} {LAB}/fake_loader.py --alloc 20 --ollama "$@"\n')
    ollama.chmod(0o755)
    write_config(
        stage.root,
        '[guard]\nstop_timeout = "5s"\n[loaders.footprint]\n"ollama-*.service" = "100TiB"\n',
    )
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    stage.root.write_unit(
        "ollama-stuck.service",
        f"[Service]\nExecStart={ollama} serve\nExecStop=/bin/sleep infinity\n"
        "TimeoutStopSec=infinity\n",
    )
    stage.root.systemctl("start", "ollama-stuck.service")
    said = wait_log(
        stage.root, r"unit-stop-requested: stopping user:0:ollama-stuck\.service.*", 30, offset
    )
    assert "not masking or disabling it" in said.group(0), said.group(0)
    # The guard goes before its SIGKILL (an upgrade, a crash): the next one sends it.
    stage.root.systemctl("stop", GUARD)
    assert "unit-killed" not in log_text(stage.root)[offset:]
    assert stage.root.show("ollama-stuck.service", "ActiveState")["ActiveState"] == "deactivating"
    offset = restart_guard(stage.root)
    killed = wait_log(stage.root, r"unit-killed: user:0:ollama-stuck\.service: .*", 30, offset)
    assert "did not stop within 5s" in killed.group(0), killed.group(0)
    # SIGKILLed: its result is the signal's, so it ends failed, not inactive.
    stage.root.wait_for("ollama-stuck.service", "ActiveState", "failed")
    assert stage.root.show("ollama-stuck.service", "LoadState")["LoadState"] == "loaded"
    # Its own unit preloads a model: the load is the unit's.
    offset = len(log_text(stage.root))
    curl = (
        "-/usr/bin/curl -s -m 1 http://127.0.0.1:11434/api/generate "
        """-d '{"model":"qwen3:30b","keep_alive":-1}'"""
    )
    stage.root.write_unit(
        "ollama-preload.service",
        f"[Service]\nExecStart={ollama} serve\nExecStartPost={curl}\n",
    )
    # --no-block: the guard may stop it during ExecStartPost=, which cancels the job.
    stage.root.systemctl("start", "--no-block", "ollama-preload.service")
    wait_log(stage.root, r"^warning unit-blocked: user:0:ollama-preload\.service.*", 40, offset)
    assert stage.root.show("ollama-preload.service", "LoadState")["LoadState"] == "masked"
    write_config(stage.root)
    stage.root.systemctl("reload", GUARD)
    stage.guard("release", "user:0:ollama-preload.service", "--no-start", check=True)
    assert stage.root.show("ollama-preload.service", "LoadState")["LoadState"] == "loaded"


# --- 10. the first look at her unit, before her manager answers, is a full look --------


def _look(sensor: Any, ref: str) -> Any:
    """Her unit as one full look of the sensor sees it (a pass of the guard)."""
    units = {str(u.ref): u for u in sensor.snapshot(rescue=False).units}
    assert ref in units, sorted(units)
    return units[ref]


def test_her_unit_seen_before_her_manager_answers_is_foreseen_from_its_argv(
    stage: Stage,
) -> None:
    """The incident at boot (issue 38): a linger user's loader runs before the guard has
    connected to her manager. The first look judges it by what the kernel shows: its
    processes' argv name the model, so its footprint is foreseen from the model's header
    at once, not "unknown" for its whole run. Once her manager answers, the unit is read
    again (ExecStart=) and foreseen from that: nothing from the silent moment is kept."""
    from spark_guard import config as config_mod
    from spark_guard import log
    from spark_guard.core.snapshot import Foreseen
    from spark_guard.sense import Sensor

    name = "llama-early.service"
    # A llama-server the kernel names as such: a script run through its #! line shows as
    # `python3 /path/llama-server -m MODEL` (stage.server is a shell that execs python).
    server = stage.root.base / "sbin" / "llama-server"
    server.parent.mkdir(exist_ok=True)
    server.write_text(f"#!{PY}\n" + (LAB / "fake_loader.py").read_text())
    server.chmod(0o755)
    stage.her_unit(name, f"{server} -m {stage.tiny} -c 2048 --alloc 20")
    stage.mum.systemctl("start", name)
    ref = f"{stage.key}:{name}"
    config = config_mod.load(str(stage.root.base / "guard.toml"))
    sensor = Sensor(config, log.get_logger())
    sensor.wait_for_models = True  # a command's sensor: each model read is waited for
    try:
        deadline = time.monotonic() + 20
        first = _look(sensor, ref)
        while not first.cmdlines and time.monotonic() < deadline:
            first = _look(sensor, ref)  # (her server may not have exec'd python yet)
        assert first.unmanaged == "its manager is out of view"
        assert first.exec_start == ()  # nothing read from her manager yet
        assert any(str(stage.tiny) in line for line in first.cmdlines), first.cmdlines
        assert first.foreseen is Foreseen.KNOWN, first.prediction
        assert first.predicted is not None and first.predicted > 0

        sensor.refresh_managers()  # her manager answers
        after = _look(sensor, ref)
        assert after.unmanaged == ""
        assert after.exec_start and str(stage.tiny) in after.exec_start[0], after.exec_start
        assert after.foreseen is Foreseen.KNOWN and after.predicted == first.predicted
    finally:
        sensor.close()
        stage.mum.systemctl("stop", name, check=False)


def test_her_loader_paused_while_her_manager_is_away_runs_on_once_released(
    stage: Stage,
) -> None:
    """A loader of hers paused (SIGSTOP) while her manager is out of view, then released
    by the admin before her manager answers: it is not left stopped for good. It runs on
    (SIGCONT), and is never killed by the pause's deadline."""
    write_config(stage.root, '[loaders.footprint]\n"llama-wait.service" = "100TiB"\n')
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    socket = stage.mum.runtime / "systemd" / "private"
    hidden = socket.with_name("private.hidden")
    stage.her_unit("llama-wait.service", f"{PY} {LAB}/fake_loader.py -m {stage.tiny} --alloc 16")
    # A timer of hers starts it once her manager is out of the guard's view.
    timer = stage.mum.unit_dir / "llama-wait.timer"
    stage.mallory.run(
        PY,
        "-c",
        f"open({str(timer)!r}, 'w').write('[Timer]\\nOnActiveSec=3s\\nAccuracySec=100ms\\n')",
    )
    stage.mum.systemctl("daemon-reload")
    stage.mum.systemctl("start", "llama-wait.timer")
    offset = len(log_text(stage.root))
    stage.mallory.run("mv", str(socket), str(hidden))
    try:
        wait_log(stage.root, rf"manager-lost: {stage.key} manager", after=offset)
        wait_log(
            stage.root,
            rf"cannot stop {stage.key}:llama-wait\.service: .*paused \(SIGSTOP\)",
            20,
            offset,
        )
        pid = stage.mum.show("llama-wait.service", "MainPID")["MainPID"]
        assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "T"
        out = stage.guard("release", f"{stage.key}:llama-wait.service")
        assert out.returncode == 0, out.stdout + out.stderr
        deadline = time.monotonic() + 10
        state = "T"
        while state == "T" and time.monotonic() < deadline:
            time.sleep(0.1)
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        assert state != "T", "still stopped after its release"
        # Past the pause's deadline (stop_timeout, 10 s), it runs still: never killed.
        time.sleep(10.5)
        assert Path(f"/proc/{pid}").exists()
        assert f"unit-killed: {stage.key}:llama-wait" not in log_text(stage.root)[offset:]
    finally:
        stage.mallory.run("mv", str(hidden), str(socket), check=False)
        stage.mum.systemctl("stop", "llama-wait.service", check=False)
        write_config(stage.root)
        offset = len(log_text(stage.root))
        stage.root.systemctl("reload", GUARD)
        wait_log(stage.root, "config-reloaded", after=offset)


# --- 12. issue 40: no state of a unit hides a loader ------------------------------------


def test_her_loader_hidden_in_her_own_endless_stop_is_judged_and_killed(stage: Stage) -> None:
    """H2: ExecStop=/bin/sleep infinity and TimeoutStopSec=infinity, and her own `systemctl
    --user stop --no-block` while her server is still small: the unit is deactivating for
    as long as she likes while its server runs on and grows. A deactivating unit was
    never judged (and below the reserve it counted as leaving). Now only a stop the guard
    sent makes one leaving: hers is judged as running, blocked once it holds more than
    [boot] unsized while it grows, and its stop escalated to SIGKILL on the guard's clock."""
    write_config(stage.root, '[guard]\nstop_timeout = "3s"\n', unsized="128MiB")
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)
    unit = "llama-quiet.service"  # no model named: its size is unknown
    stage.her_unit(
        unit,
        f"{stage.server} --alloc 600 --rate 40 --quiet-stop",
        extra="ExecStop=/bin/sleep infinity\nTimeoutStopSec=infinity\n",
    )
    offset = len(log_text(stage.root))
    stage.mum.systemctl("start", unit)
    stage.mum.systemctl("stop", "--no-block", unit)  # at once: it holds a few MiB
    stage.mum.wait_for(unit, "ActiveState", "deactivating")
    stopped = wait_log(
        stage.root, rf"unit-stop-requested: stopping {stage.key}:{re.escape(unit)}.*", 30, offset
    )
    assert "unsized" in stopped.group(0), stopped.group(0)
    killed = wait_log(stage.root, rf"unit-killed: {stage.key}:{re.escape(unit)}: .*", 30, offset)
    assert "did not stop within 3s" in killed.group(0), killed.group(0)
    _blocked(stage, unit, offset)
    assert stage.mum.show(unit, "LoadState")["LoadState"] == "masked"
    assert _gone(stage, "--quiet-stop")
    write_config(stage.root)
    offset = len(log_text(stage.root))
    stage.root.systemctl("reload", GUARD)
    wait_log(stage.root, "config-reloaded", after=offset)


# --- 13. issue 40: what she can make the guard write is bounded --------------------------


def test_her_many_blocked_units_are_a_few_lines_of_roots_note_and_state(stage: Stage) -> None:
    """Issue 40, H8: each unit of hers that cannot fit is a block, and each block was a
    line of the login note at every ssh login and on the console, and an entry of
    state.json rewritten every full look: 200 made 203 lines, 10,000 would make a
    13 MB file. Her 36 blocked instances are banner.ROWS_PER_MANAGER lines of the note
    and statefile.PER_MANAGER entries of state.json; the rest are counted, and status
    says how many."""
    from spark_guard.block.banner import ROWS_PER_MANAGER
    from spark_guard.statefile import PER_MANAGER

    count = PER_MANAGER + 4
    stage.her_unit("llama-many@.service", f"{stage.server} -m {stage.big}")
    offset = len(log_text(stage.root))
    names = [f"llama-many@{i}.service" for i in range(count)]
    stage.mum.systemctl("start", "--no-block", *names)
    try:

        def all_blocked() -> bool:
            done = re.findall(r"^warning unit-blocked: ", log_text(stage.root)[offset:], re.M)
            return len(done) >= count

        assert poll(all_blocked, 90)[0], log_text(stage.root)[offset:][-3000:]
        motd = stage.root.base / "motd.d" / "spark-guard"

        def written() -> bool:  # (by the pass that blocked the last of them, or a later one)
            left = stage.state().get("left_out", {}).get("blocked", {}).get(stage.key)
            return f"in all: {stage.key} {count})" in motd.read_text() and left is not None

        assert poll(written, 30)[0], (motd.read_text(), stage.state().get("left_out"))
        note = motd.read_text()
        lines = note.splitlines()
        assert sum("llama-many@" in ln for ln in lines) == ROWS_PER_MANAGER, note
        assert f"... and {count - ROWS_PER_MANAGER} more" in note, note
        assert f"in all: {stage.key} {count})" in note, note
        assert len(lines) < ROWS_PER_MANAGER + 8, note
        state = stage.state()
        hers = [b for b in state["blocked"] if b["unit"].startswith(f"{stage.key}:llama-many@")]
        assert len(hers) == PER_MANAGER
        assert state["left_out"]["blocked"] == {stage.key: count - PER_MANAGER}
        status = stage.guard("status").stdout
        assert f"blocked ({count}):" in status, status
        assert f"  ... and {count - PER_MANAGER} more of {stage.key} (" in status, status
    finally:
        stage.mum.systemctl("stop", *names, check=False)


# --- 14. issue 40: her manager is a peer, never one the loop waits on --------------------


def test_her_thousands_of_queued_start_jobs_leave_the_loop_its_pace(stage: Stage) -> None:
    """Issue 40, H6: each new unit of hers cost a call to her manager on the loop, with a
    byte budget and no count: 3,000 start jobs queued behind a unit of hers that never
    finishes made a pass of 35.7 s, and again whenever she re-queues them. A pass now
    asks her manager of DETAILS_PER_PASS new units, within DETAILS_SECONDS, running units
    first; the rest wait their turn. Root's loader that cannot fit, started while her
    queue is fresh, is blocked within seconds, not after her 3,000 calls."""
    from spark_guard.sense.asking import DETAILS_PER_PASS

    count = 3000
    assert count > 50 * DETAILS_PER_PASS
    stage.her_unit("gate.service", "/bin/sleep infinity", extra="Type=oneshot\n")
    template = stage.mum.unit_dir / "q@.service"
    text = "[Unit]\nAfter=gate.service\nRequires=gate.service\n[Service]\nExecStart=/bin/true\n"
    stage.mallory.run(PY, "-c", f"open({str(template)!r}, 'w').write({text!r})")
    stage.mum.systemctl("daemon-reload")
    stage.root.write_unit(
        "llama-late.service", f"[Service]\nExecStart={stage.server} -m {stage.big}\n"
    )
    try:
        stage.mum.systemctl("start", "--no-block", "gate.service")
        stage.mum.systemctl("start", "--no-block", *(f"q@{i}.service" for i in range(count)))
        jobs = stage.mum.systemctl("list-jobs", "--no-legend").stdout.count("q@")
        assert jobs == count, jobs
        offset = len(log_text(stage.root))
        started = time.monotonic()
        stage.root.systemctl("start", "--no-block", "llama-late.service")
        wait_log(stage.root, r"^warning unit-blocked: user:0:llama-late\.service", 60, offset)
        took = time.monotonic() - started
        assert took < 10, (took, log_text(stage.root)[offset:][-3000:])
        assert stage.state()["decision_seconds"] < 3, stage.state()["decision_seconds"]
    finally:
        stage.mum.systemctl("stop", "gate.service", check=False)
        stage.mum.systemctl("cancel", check=False)


def test_rescue_stops_her_running_loader_not_her_thousand_files_that_never_run(
    stage: Stage,
) -> None:
    """Issue 40, H9: thousands of unit files of hers named like loaders, none of them
    running. rescue stopped, disabled, masked and recorded each, and at 2,500 it ran out
    of her manager's time before her running loader. It stops what runs or starts now
    (and PID 1's enabled loaders), PID 1's first; her files that never run are the
    daemon's to judge if one ever starts."""
    count = 300
    names = [f"llama-idle-{i}.service" for i in range(count)]
    stage.her_files(names, "[Service]\nExecStart=/bin/llama-server -m /m.gguf\n")
    stage.her_unit("llama-live.service", f"{stage.server} -m {stage.tiny}")
    stage.mum.systemctl("start", "llama-live.service")
    try:
        out = stage.guard("rescue")
        assert out.returncode == 0, out.stdout + out.stderr
        rows = [ln for ln in out.stdout.splitlines() if ln.startswith(f"{stage.key}:")]
        assert [r.split()[0] for r in rows] == [f"{stage.key}:llama-live.service"], out.stdout
        assert stage.mum.show("llama-live.service", "LoadState")["LoadState"] == "masked"
        idle = stage.mum.show(names[0], "LoadState")["LoadState"]
        assert idle == "loaded", idle
        released = stage.guard("release", "--all", "--dry-run").stdout
        assert "llama-idle-" not in released, released
    finally:
        stage.her_files_gone(names)


# --- issue 40, H1, H4, H10: her manager is a peer the guard talks to, never waits on ------


def _her_manager(stage: Stage) -> Any:
    """The project's own Manager for her, connected and verified as the daemon's is."""
    from spark_guard.system.managers import connect_to

    return connect_to(stage.key, "/nonexistent/systemd/private", str(stage.root.user_runtime))


def _rss(pid: str = "self") -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]) * 1024  # type: ignore[index]


def test_her_managers_chatter_never_piles_up_in_the_guard(stage: Stage) -> None:
    """Issue 40, H1: systemd sends UnitNew, JobNew, PropertiesChanged... to every client of
    its private socket. On the connection the guard held open to her manager, her churn
    of start/stop jobs queued up between two calls (96,260 messages after 9 s), and the
    next call read them all with the GIL held: 1.41 s, the guard's RSS 28 -> 167 MiB,
    over its MemoryMax=128M. Each call to her manager is on a connection of its own now:
    nothing of hers waits in the guard for the next one."""
    target = stage.mum.unit_dir / "g@.target"
    stage.mallory.run(PY, "-c", f"open({str(target)!r}, 'w').write('[Unit]\\nDescription=g\\n')")
    cycles = stage.mallory.home / "cycles"
    units = "$$(seq -f g@%%g.target 0 99)"
    stage.her_unit(
        "churn.service",
        "/bin/sh -c 'n=0; while :; do systemctl --user start "
        f"{units}; systemctl --user stop {units}; n=$$((n+1)); echo $$n > {cycles}; done'",
    )
    m = _her_manager(stage)
    guard_pid = stage.guard_props()["MainPID"]
    try:
        stage.mum.systemctl("start", "churn.service")
        done, _ = poll(lambda: cycles.exists() and int(cycles.read_text() or 0) >= 30, 120)
        assert done, stage.mum.show("churn.service", "ActiveState")
        before = _rss()
        began = time.monotonic()
        states = m.unit_states(["churn.service", "g@0.target"])
        took, grew = time.monotonic() - began, _rss() - before
        assert states["churn.service"].active_state == "active", states
        assert took < 0.5, took
        assert grew < 8 << 20, grew
        assert _rss(guard_pid) < 100 << 20, _rss(guard_pid)  # (MemoryMax=128M shipped)
    finally:
        m.close()
        stage.mum.systemctl("stop", "churn.service", check=False)
        stage.mallory.run("rm", "-f", str(target), str(cycles))


def test_her_busy_manager_never_stalls_the_guards_other_threads(stage: Stage) -> None:
    """Issue 40, H10: her manager kept busy listing thousands of her unit files is not
    stopped or frozen, so it is asked; a pystemd call to it waited with the GIL held,
    and every thread of the guard stopped with it (1,000 files: 1.2-1.3 s a call;
    2,000: 5 s). Her manager is asked with the GIL free, within a deadline: the guard's
    other threads run on while it is slow."""
    from spark_guard.system.managers import DETAILS_TIMEOUT, ManagerError

    count = 3000
    names = [f"idle-{i}.service" for i in range(count)]
    stage.her_files(names, "[Service]\nExecStart=/bin/true\n")
    busy = stage.mallory.home / "busy"
    stage.mallory.run("touch", str(busy))
    loop = f"while [ -e {busy} ]; do systemctl --user list-unit-files >/dev/null; done"
    stage.her_unit("busy.service", f"/bin/sh -c '{loop} & {loop} & wait'")
    m = _her_manager(stage)
    gaps = [0.0]
    stop = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.wait(0.01):
            now = time.monotonic()
            gaps[0] = max(gaps[0], now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    took = []
    try:
        stage.mum.systemctl("start", "busy.service")
        ticker.start()
        for _ in range(5):
            began = time.monotonic()
            with contextlib.suppress(ManagerError):
                m.silent_until = 0.0  # asked each time, as if its silence were over
                m.unit_states(["busy.service"])
            took.append(time.monotonic() - began)
    finally:
        stop.set()
        m.close()
        stage.mallory.run("rm", "-f", str(busy))
        stage.mum.systemctl("stop", "busy.service", check=False)
        stage.her_files_gone(names)
    assert max(took) < DETAILS_TIMEOUT + 0.5, took
    assert gaps[0] < 0.5, (gaps[0], took)


@pytest.mark.parametrize("accept", ["no", "yes"])
def test_her_socket_unit_where_her_manager_listens_is_not_believed(
    stage: Stage, accept: str
) -> None:
    """Issue 40, H4: a `.socket` unit of hers listening beside her manager's private
    socket, then renamed onto it. Her manager made the listener, so SO_PEERCRED names
    her manager and every check of the listener passed; her service answered each call
    in 4.5 s, any state she liked. The guard now asks her manager only on a connection
    whose other end her manager holds, and no other process of hers (Accept=no: her
    service holds it; Accept=yes: the instance spawned for it): her service is never
    sent a call, and the guard goes on, her manager out of view, until she puts it back."""
    systemd_dir = stage.mum.runtime / "systemd"
    log = stage.mallory.home / f"bus-{accept}.log"
    service = "bus@.service" if accept == "yes" else "bus.service"
    stdin = "StandardInput=socket\n" if accept == "yes" else ""
    stage.her_unit(service, f"{PY} {LAB}/socket_bus.py {log}", extra=stdin)
    socket_unit = stage.mum.unit_dir / "bus.socket"
    text = f"[Socket]\nListenStream=%t/systemd/private2\nAccept={accept}\nRemoveOnStop=yes\n"
    stage.mallory.run(PY, "-c", f"open({str(socket_unit)!r}, 'w').write({text!r})")
    stage.mum.systemctl("daemon-reload")
    stage.mum.systemctl("start", "bus.socket")
    offset = len(log_text(stage.root))
    stage.mallory.sh(f"cd '{systemd_dir}'; mv private private.real; mv private2 private")
    try:
        refused = wait_log(
            stage.root, rf"^warning manager-untrusted: .*{stage.key}.*$", 30, offset
        ).group(0)
        assert "a socket unit's, not the manager's own" in refused, refused
        assert not log.exists() or "call" not in log.read_text(), log.read_text()
        assert stage.state()["decision_seconds"] < 3, stage.state()["decision_seconds"]
    finally:
        offset = len(log_text(stage.root))
        stage.mallory.sh(f"cd '{systemd_dir}'; mv private private2; mv private.real private")
        stage.mum.systemctl("stop", "bus.socket", check=False)
        stage.mallory.run("rm", "-f", str(socket_unit), str(log))
        stage.mum.systemctl("daemon-reload")
    wait_log(stage.root, rf"manager-connected: watching {stage.key} manager", 30, offset)


def test_her_manager_gets_a_time_budget_in_roots_tools_then_the_kernels_view(
    stage: Stage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, H9: thousands of unit files of hers, each a dozen calls to read: rescue's
    inventory spent her manager's time before PID 1's loaders and her running one. A
    user's manager is read within USER_SECONDS (here none at all); past it she is not
    listed whole, root's tools say so, and her running loader is judged by what the
    kernel shows, as the daemon judges it. Root's own managers have no such budget."""
    import dataclasses

    import structlog

    from spark_guard import config as config_mod
    from spark_guard.sense.sensor import sense_once
    from spark_guard.tools import inventory

    stage.her_unit("llama-live.service", f"{stage.server} -m {stage.tiny}")
    stage.mum.systemctl("start", "llama-live.service")
    try:
        config = config_mod.load_for_command(stage.root.base / "guard.toml")
        assert config is not None
        monkeypatch.setattr(inventory, "USER_SECONDS", 0.0)
        inv = inventory.collect(config)
        assert stage.key not in inv.managers and "user:0" in inv.managers, inv.managers
        said = [u for u in inv.unreached if u.startswith(f"{stage.key}: not listed whole")]
        assert said, inv.unreached
        what_runs = dataclasses.replace(config, gpu=False, containers=False)
        snapshot, _, _ = sense_once(what_runs, structlog.get_logger())
        loose = inventory.unlisted(snapshot, config, inv.managers)
        assert [str(ld.ref) for ld in loose] == [f"{stage.key}:llama-live.service"], loose
    finally:
        stage.mum.systemctl("stop", "llama-live.service")
