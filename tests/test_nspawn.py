"""The guard as a system service under systemd as PID 1, in a booted Debian container.

The layout that wedges real machines: the same loader as a system unit in
/etc/systemd/system, a template instance from /usr/lib/systemd/system, and a
user unit of a linger user, all enabled, all Restart=always, all allocating
memory for real (capped). The guard runs with its shipped, hardened unit.
Checked as an admin would: each loader stopped, masked, disabled, a start
refused, the records right, nothing back after a reboot, and release leaving
/etc and the user's home exactly as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from lab import LAB
from lab.harness import file_tree, poll
from lab.nspawn import Container

pytestmark = pytest.mark.nspawn

REPO = Path(__file__).parent.parent
ALICE = 1000
LOADERS = ("llama-server.service", "llama@qwen.service", f"user:{ALICE}:llama-user.service")

CONFIG = """
[boot]
grace = "1h"
[loaders.footprint]
"llama*" = "100TiB"
"""

LOADER = """[Unit]
Description=model server ({what})
[Service]
ExecStart=/usr/bin/python3 /opt/fake-loader.py -m /srv/models/ds4.gguf --alloc 48 --rate 16
Restart=always
RestartSec=1s
MemoryMax=256M
LimitAS=1G
[Install]
WantedBy={wanted_by}
"""


def link(path: Path, target: str, owner: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    os.lchown(path, owner, owner)


def lay_out_machine(c: Container) -> None:
    """Install the guard from this checkout, and the loaders, before the first boot."""
    site = c.path("/usr/lib/python3/dist-packages/spark_guard")
    shutil.copytree(
        REPO / "src" / "spark_guard", site, ignore=shutil.ignore_patterns("__pycache__")
    )
    cli = c.path("/usr/bin/spark-guard")
    cli.write_text(
        "#!/usr/bin/python3\nimport sys\nfrom spark_guard.cli import main\nsys.exit(main())\n"
    )
    cli.chmod(0o755)
    shutil.copy(REPO / "units" / "spark-guard.service", c.path("/usr/lib/systemd/system/"))
    shutil.copy(
        REPO / "packaging" / "spark-guard.tmpfiles", c.path("/usr/lib/tmpfiles.d/spark-guard.conf")
    )
    link(
        c.path("/etc/systemd/system/sysinit.target.wants/spark-guard.service"),
        "/usr/lib/systemd/system/spark-guard.service",
    )
    c.path("/etc/spark-guard.toml").write_text(CONFIG)

    models = c.path("/srv/models")
    models.mkdir(parents=True)
    (models / "ds4.gguf").write_bytes(b"GGUF" + b"\0" * 4096)
    shutil.copy(LAB / "fake_loader.py", c.path("/opt/fake-loader.py"))

    # A system unit in /etc, and a template instance from /usr/lib, both enabled.
    wants = c.path("/etc/systemd/system/multi-user.target.wants")
    c.path("/etc/systemd/system/llama-server.service").write_text(
        LOADER.format(what="system", wanted_by="multi-user.target")
    )
    link(wants / "llama-server.service", "/etc/systemd/system/llama-server.service")
    c.path("/usr/lib/systemd/system/llama@.service").write_text(
        LOADER.format(what="%i", wanted_by="multi-user.target")
    )
    link(wants / "llama@qwen.service", "/usr/lib/systemd/system/llama@.service")

    # alice, with linger, and her own enabled loader in ~/.config/systemd/user.
    add_linger_user(c, "alice", ALICE, "llama-user.service")


def add_linger_user(c: Container, user: str, uid: int, unit: str) -> None:
    """A user with linger and an enabled loader in ~/.config/systemd/user, all theirs."""
    for name, line in (
        ("passwd", f"{user}:x:{uid}:{uid}::/home/{user}:/bin/sh"),
        ("group", f"{user}:x:{uid}:"),
        ("shadow", f"{user}:!:20000:0:99999:7:::"),
    ):
        with open(c.path(f"/etc/{name}"), "a") as f:
            f.write(line + "\n")
    user_dir = c.path(f"/home/{user}/.config/systemd/user")
    user_dir.mkdir(parents=True)
    (user_dir / unit).write_text(
        LOADER.format(what=user, wanted_by="default.target").replace("MemoryMax=256M\n", "")
    )
    link(user_dir / "default.target.wants" / unit, f"/home/{user}/.config/systemd/user/{unit}")
    for dirpath, dirs, files in os.walk(c.path(f"/home/{user}")):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            os.lchown(name, uid, uid)
    c.path("/var/lib/systemd/linger").mkdir(parents=True, exist_ok=True)
    c.path(f"/var/lib/systemd/linger/{user}").touch()


def tree(c: Container) -> dict[str, tuple[object, ...]]:
    """/etc/systemd, alice's home and the template, keyed by their paths in the container."""
    roots = ("/etc/systemd", "/home/alice", "/usr/lib/systemd/system/llama@.service")
    return {k[len(str(c.root)) :]: v for k, v in file_tree(*(c.path(r) for r in roots)).items()}


def ref_parts(ref: str) -> tuple[int | None, str]:
    if ref.startswith("user:"):
        _, uid, name = ref.split(":", 2)
        return int(uid), name
    return None, ref


def record(c: Container, ref: str) -> dict[str, Any] | None:
    path = c.path(f"/var/lib/spark-guard/blocked/{ref}.json")
    return json.loads(path.read_text()) if path.exists() else None


def wait_blocked(c: Container, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [record(c, r) for r in LOADERS]
        if all(r is not None and r["step"] == "blocked" for r in records):
            return
        time.sleep(0.2)
    journal = c.run("journalctl", "--no-pager", "-u", "spark-guard", "-n", "60", check=False)
    raise AssertionError(f"not all blocked: {records}\n{journal.stdout}")


@pytest.fixture(scope="module")
def machine():
    with Container() as c:
        lay_out_machine(c)
        c.before = tree(c)  # type: ignore[attr-defined]
        c.boot()
        yield c


def test_loaders_on_both_levels_are_stopped_blocked_disabled_and_recorded(machine):
    c = machine
    c.wait_for("spark-guard.service", "ActiveState", "active")
    wait_blocked(c)
    for ref in LOADERS:
        uid, unit = ref_parts(ref)
        props = c.show(unit, "ActiveState", "LoadState", "NRestarts", user=uid)
        assert props == {"ActiveState": "inactive", "LoadState": "masked", "NRestarts": "0"}, (
            ref,
            props,
        )
        scope = ("--user",) if uid else ()
        status = c.run("systemctl", *scope, "status", unit, user=uid, check=False).stdout
        assert "Loaded: masked" in status, status
        refused = c.run("systemctl", *scope, "start", unit, user=uid, check=False)
        assert refused.returncode != 0 and "is masked" in refused.stderr, refused
    # Disabled: the links are gone, the unit files are where the admin put them.
    assert not c.path("/etc/systemd/system/multi-user.target.wants/llama-server.service").exists()
    assert not c.path("/etc/systemd/system/multi-user.target.wants/llama@qwen.service").exists()
    assert not os.path.lexists(
        c.path("/home/alice/.config/systemd/user/default.target.wants/llama-user.service")
    )
    assert c.path("/etc/systemd/system/llama-server.service").is_file()

    system = record(c, "llama-server.service")
    assert system is not None
    assert system["reason"] == "footprint" and system["figures"]["expected"] == 100 * 1024**4
    assert system["mask_path"] == "/run/systemd/system.control/llama-server.service"
    assert [(ln["path"], ln["target"], ln["removed"]) for ln in system["links"]] == [
        (
            "/etc/systemd/system/multi-user.target.wants/llama-server.service",
            "/etc/systemd/system/llama-server.service",
            True,
        )
    ]
    user = record(c, f"user:{ALICE}:llama-user.service")
    assert user is not None
    assert user["mask_path"] == f"/run/user/{ALICE}/systemd/user.control/llama-user.service"
    assert [(ln["path"], ln["uid"]) for ln in user["links"]] == [
        ("/home/alice/.config/systemd/user/default.target.wants/llama-user.service", ALICE)
    ]
    # The mask in alice's runtime dir is hers, as if her manager had made it.
    for path in (user["mask_path"], os.path.dirname(user["mask_path"])):
        assert c.run("stat", "-c", "%u:%g", path).stdout == f"{ALICE}:{ALICE}\n"

    # What the admin sees: the status line, journal fields, the login note.
    status = c.show("spark-guard.service", "StatusText")["StatusText"]
    assert "blocked 3" in status and "last action: stop" in status
    journal = c.run("journalctl", "-o", "json", "-u", "spark-guard", "SG_EVENT=unit-blocked").stdout
    entries = [json.loads(line) for line in journal.splitlines()]
    assert {e["SG_UNIT"] for e in entries} == set(LOADERS)
    assert all(e["MESSAGE_ID"] and e["PRIORITY"] == "4" for e in entries)
    motd = c.run("cat", "/run/motd.d/spark-guard").stdout
    for ref in LOADERS:
        assert f"  {ref}  blocked since " in motd
    assert "spark-guard release UNIT" in motd


def test_after_a_reboot_no_loader_starts_and_release_restores_everything(machine):
    c = machine
    wait_blocked(c)
    c.reboot()
    c.wait_for("spark-guard.service", "ActiveState", "active")
    c.wait_for(f"user@{ALICE}.service", "ActiveState", "active")
    time.sleep(3.0)  # multi-user.target and alice's default.target had their chance
    for ref in LOADERS:
        uid, unit = ref_parts(ref)
        props = c.show(unit, "ActiveState", "ActiveEnterTimestampMonotonic", "NRestarts", user=uid)
        assert props == {
            "ActiveState": "inactive",
            "ActiveEnterTimestampMonotonic": "0",  # never started this boot
            "NRestarts": "0",
        }, (ref, props)
    # Blocked until released: the guard laid its masks again at boot.
    c.wait_for("llama-server.service", "LoadState", "masked")
    c.wait_for("llama-user.service", "LoadState", "masked", user=ALICE)

    out = c.run("spark-guard", "release", "--all")
    assert sorted(out.stdout.splitlines()) == sorted(
        f"released {ref}: mask removed, 1 link(s) restored" for ref in LOADERS
    )
    assert tree(c) == c.before  # /etc/systemd and alice's home, byte for byte
    for ref in LOADERS:
        uid, unit = ref_parts(ref)
        scope = ("--user",) if uid else ()
        assert c.run("systemctl", *scope, "is-enabled", unit, user=uid).stdout == "enabled\n"
        assert c.show(unit, "LoadState", user=uid)["LoadState"] == "loaded"
    assert c.run("test", "-e", "/run/motd.d/spark-guard", check=False).returncode == 1
    assert not list(c.path("/var/lib/spark-guard/blocked").glob("*.json"))
    released = c.run("journalctl", "-o", "json", "SG_EVENT=unit-released").stdout
    assert {json.loads(line)["SG_UNIT"] for line in released.splitlines()} == set(LOADERS)


def test_units_in_run_and_in_etc_systemd_user_are_blocked_too(machine):
    c = machine
    c.wait_for("spark-guard.service", "ActiveState", "active")
    # A runtime unit file (generators and `systemctl link --runtime` put them there),
    # and a unit every user has, from /etc/systemd/user, started by alice.
    loader = LOADER.format(what="runtime", wanted_by="multi-user.target")
    c.run("sh", "-c", f"cat > /run/systemd/system/llama-run.service <<'EOF'\n{loader}EOF")
    c.path("/etc/systemd/user/llama-global.service").write_text(
        LOADER.format(what="global", wanted_by="default.target").replace("MemoryMax=256M\n", "")
    )
    c.run("systemctl", "daemon-reload")
    c.run("systemctl", "--user", "daemon-reload", user=ALICE)
    c.run("systemctl", "start", "llama-run.service")
    c.run("systemctl", "--user", "start", "llama-global.service", user=ALICE)
    refs = ("llama-run.service", f"user:{ALICE}:llama-global.service")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all((r := record(c, ref)) and r["step"] == "blocked" for ref in refs):
            break
        time.sleep(0.2)
    for ref in refs:
        uid, unit = ref_parts(ref)
        scope = ("--user",) if uid else ()
        assert c.show(unit, "ActiveState", "LoadState", user=uid) == {
            "ActiveState": "inactive",
            "LoadState": "masked",
        }, ref
        refused = c.run("systemctl", *scope, "start", unit, user=uid, check=False)
        assert "is masked" in refused.stderr, refused
    out = c.run("spark-guard", "release", *refs)
    assert out.returncode == 0, out.stderr
    for ref in refs:
        uid, unit = ref_parts(ref)
        assert c.show(unit, "LoadState", user=uid)["LoadState"] == "loaded"


def test_audit_sees_every_level_and_rescue_blocks_them_all(machine):
    c = machine
    c.wait_for("spark-guard.service", "ActiveState", "active")
    # bob has linger since a moment ago: his manager is not up, his unit files are read.
    add_linger_user(c, "bob", 1001, "bob-llama.service")

    out = c.run("spark-guard", "audit", "--json", check=False)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    loaders = {u["unit"]: u for u in report["loaders"]}
    assert set(loaders) >= {
        "llama-server.service",
        "llama@qwen.service",
        f"user:{ALICE}:llama-user.service",
        "user:1001:bob-llama.service",
    }
    assert loaders["user:1001:bob-llama.service"]["from_files"] is True
    assert loaders["user:1001:bob-llama.service"]["file_state"] == "enabled"
    # Debian 12 is merged-/usr: systemd names it by /lib.
    assert loaders["llama@qwen.service"]["fragment"].endswith("/lib/systemd/system/llama@.service")
    lingering = {x["user"]: x["running"] for x in report["lingering"]}
    assert lingering == {"alice": True, "bob": False}
    codes = {(f["code"], f["unit"]) for f in report["findings"]}
    assert ("linger-autostart", "user:1001:bob-llama.service") in codes
    assert sum(code == "duplicate" for code, _ in codes) >= 3  # one model, five units

    # The admin's first seconds: the guard is not there to help, loaders are loading.
    c.run("systemctl", "stop", "spark-guard.service")
    c.run("systemctl", "start", "llama-server.service", "llama@qwen.service")
    c.run("systemctl", "--user", "start", "llama-user.service", user=ALICE)
    rescued = c.run("spark-guard", "rescue", check=False)
    assert rescued.returncode == 0, rescued.stdout + rescued.stderr
    for ref in LOADERS:
        uid, unit = ref_parts(ref)
        props = c.show(unit, "ActiveState", "LoadState", user=uid)
        assert props["LoadState"] == "masked" and props["ActiveState"] in ("inactive", "failed")
    assert "load average" in rescued.stdout
    assert c.run("spark-guard", "release", "--all").returncode == 0
    c.run("systemctl", "start", "spark-guard.service")


def test_a_fake_manager_of_hers_in_her_init_scope_is_believed_by_none_of_roots_tools(machine):
    """Issue 40, H7: root's tools connected to a user's socket without PID 1 vouching. A
    fake of hers moved into her own init.scope (her delegation lets her), put in place
    of her manager's socket, is uid hers and runs where her manager runs, and it claims
    her manager's cgroup: every other check passes. audit and rescue believed it. Now
    PID 1 is asked first, as the daemon asks it: user@UID.service's main process is not
    the fake, so nothing it says is read, and audit says so."""
    c = machine
    shutil.copy(LAB / "fake_manager.py", c.path("/opt/fake-manager.py"))
    sockets = f"/run/user/{ALICE}/systemd"
    tree = f"/user.slice/user-{ALICE}.slice/user@{ALICE}.service"
    fake = [f"{sockets}/private.fake", tree, "/home/alice/.config/systemd/user", "x.service"]
    run = ["systemd-run", "--user", "--unit=sg-fake", "python3", "/opt/fake-manager.py"]
    c.run(*run, *fake, user=ALICE)
    listening, _ = poll(
        lambda: not c.run("test", "-S", f"{sockets}/private.fake", check=False).returncode, 20
    )
    journal = c.run("journalctl", "--user-unit=sg-fake", "-n", "20", check=False).stdout
    assert listening, f"the fake never listened:\n{journal}"
    pid = c.show("sg-fake.service", "MainPID", user=ALICE)["MainPID"]
    # The unified hierarchy's (a hybrid host's is at /sys/fs/cgroup/unified): the kernel's
    # word the guard reads first.
    move = (
        f"for d in /sys/fs/cgroup/unified /sys/fs/cgroup; do f=$d{tree}/init.scope/cgroup.procs; "
        f'if [ -e "$f" ]; then echo {pid} > "$f"; exit; fi; done; exit 1'
    )
    c.run("sh", "-c", move, user=ALICE)
    c.run("mv", f"{sockets}/private", f"{sockets}/private.real", user=ALICE)
    c.run("mv", f"{sockets}/private.fake", f"{sockets}/private", user=ALICE)
    try:
        out = c.run("spark-guard", "audit", "--json", check=False)
        report = json.loads(out.stdout)
        assert f"user:{ALICE}" not in report["managers"], report["managers"]
        unreached = [f["message"] for f in report["findings"] if f["code"] == "manager-unreached"]
        assert any(f"pid {pid} " in m and "PID 1 says main pid" in m for m in unreached), unreached
        dry = c.run("spark-guard", "rescue", "--dry-run", check=False)
        assert dry.returncode == 1, dry.stdout + dry.stderr
        assert f"not reached: user:{ALICE}: pid {pid} " in dry.stderr, dry.stderr
    finally:
        c.run("mv", f"{sockets}/private", f"{sockets}/private.fake", user=ALICE, check=False)
        c.run("mv", f"{sockets}/private.real", f"{sockets}/private", user=ALICE, check=False)
        c.run("kill", pid, check=False)
        c.run("systemctl", "--user", "reset-failed", "sg-fake.service", user=ALICE, check=False)
