"""The hostile-user attacks again, against the .deb as installed: systemd as PID 1, a linger user.

A booted Debian 12 container, the package installed with apt and running
with its shipped, hardened unit (its own capabilities, ReadOnlyPaths=/home,
the syscall filter). Mallory (uid 1000) lingers, so her manager is
user@1000.service; Eve (uid 1001) has no manager, only a runtime dir, as a
fresh login leaves it. Each attack is run inside as that uid.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from lab import LAB, synth
from lab.harness import file_tree
from lab.nspawn import Container
from tests.test_nspawn import add_linger_user

pytestmark = pytest.mark.nspawn

MALLORY, EVE = 1000, 1001

CONFIG = """
[boot]
grace = "1h"
[loaders.footprint]
"llama*" = "100TiB"
"cron.service" = "100TiB"
"sshd@*" = "100TiB"
"""

HER_LOADER = """[Service]
ExecStart=/usr/bin/python3 /opt/fake-loader.py -m {model} --alloc 16
Restart=always
RestartSec=1s
[Install]
WantedBy=default.target
"""


# ($$ and %% are systemd's escapes for $ and %.)
CRON = """[Service]
ExecStart=/bin/sh -c 'while :; do for f in /var/spool/jobs/*.job; do [ -f "$$f" ] || continue; \\
  u=$$(stat -c %%u "$$f"); mv "$$f" "$$f.run"; \\
  setpriv --reuid=$$u --regid=$$u --clear-groups bash "$$f.run" & done; sleep 0.5; done'
[Install]
WantedBy=multi-user.target
"""


def her(c: Container, script: str, uid: int = MALLORY) -> str:
    out = c.run("sh", "-ec", script, user=uid, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def journal(c: Container, event: str) -> list[dict[str, str]]:
    out = c.run("journalctl", "-o", "json", "-u", "spark-guard", f"SG_EVENT={event}").stdout
    return [json.loads(line) for line in out.splitlines()]


def wait_event(c: Container, event: str, unit: str = "", timeout: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in journal(c, event) if unit in e.get("SG_UNIT", e.get("MESSAGE", ""))]
        if found:
            return found[-1]
        time.sleep(0.2)
    raise AssertionError(f"no {event} {unit}: {c.run('journalctl', '-u', 'spark-guard').stdout}")


@pytest.fixture(scope="module")
def box(deb: Path):
    with Container() as c:
        shutil.copy(deb, c.path("/root/spark-guard.deb"))
        shutil.copy(LAB / "fake_loader.py", c.path("/opt/fake-loader.py"))
        shutil.copy(LAB / "fake_manager.py", c.path("/opt/fake-manager.py"))
        server = c.path("/usr/local/bin/llama-server")  # a stand-in under the real name
        server.write_text('#!/bin/sh\nexec python3 /opt/fake-loader.py --alloc 16 "$@"\n')
        server.chmod(0o755)
        c.path("/srv/models").mkdir(parents=True)
        c.path("/srv/models/ds4.gguf").write_bytes(b"GGUF" + b"\0" * 4096)
        c.path("/etc/spark-guard.toml").write_text(CONFIG)
        # PID 1's cron.service, which Mallory will name her loader after. It runs what users
        # leave in its spool as them, as Debian's cron runs crontabs: no pam_systemd, so
        # a job stays in cron.service's cgroup.
        c.path("/var/spool/jobs").mkdir(parents=True)
        os.chmod(c.path("/var/spool/jobs"), 0o1777)
        c.path("/etc/systemd/system/cron.service").write_text(CRON)
        wants = c.path("/etc/systemd/system/multi-user.target.wants")
        wants.mkdir(parents=True, exist_ok=True)
        (wants / "cron.service").symlink_to("/etc/systemd/system/cron.service")
        add_linger_user(c, "mallory", MALLORY, "llama-m.service")
        unit = c.path("/home/mallory/.config/systemd/user/llama-m.service")
        unit.write_text(HER_LOADER.format(model="/srv/models/ds4.gguf"))
        with open(c.path("/etc/passwd"), "a") as f:
            f.write(f"eve:x:{EVE}:{EVE}::/home/eve:/bin/sh\n")
        with open(c.path("/etc/group"), "a") as f:
            f.write(f"eve:x:{EVE}:\n")
        c.boot()
        out = c.run(
            "apt-get",
            "install",
            "-y",
            "-q",
            "-o",
            "Dpkg::Options::=--force-confold",  # the admin's /etc/spark-guard.toml stays
            "/root/spark-guard.deb",
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        c.wait_for("spark-guard.service", "ActiveState", "active")
        # Installed after boot: her loader ran first; the guard blocks it now.
        wait_event(c, "unit-blocked", f"user:{MALLORY}:llama-m.service")
        yield c
        props = c.show("spark-guard.service", "ActiveState", "NRestarts")
        assert props == {"ActiveState": "active", "NRestarts": "0"}, props


def test_release_as_installed_never_writes_through_her_symlink(box: Container) -> None:
    c = box
    etc = file_tree(c.path("/etc/systemd/system"))
    wants = "/home/mallory/.config/systemd/user/default.target.wants"
    her(c, f"rm -rf {wants}; ln -s /etc/systemd/system {wants}")
    out = c.run("spark-guard", "release", "--all", check=False)
    assert out.returncode != 0 and wants in out.stderr, out
    assert file_tree(c.path("/etc/systemd/system")) == etc
    her(c, f"rm {wants}; mkdir {wants}")
    out = c.run("spark-guard", "release", "--all", check=False)
    assert out.returncode == 0, out
    link = c.path(f"{wants}/llama-m.service")
    assert link.is_symlink() and link.lstat().st_uid == MALLORY
    her(c, "systemctl --user disable --now llama-m.service")


def test_her_mask_cannot_reach_pid1s_control_dir(box: Container) -> None:
    c = box
    control = "/run/user/1000/systemd/user.control"
    her(c, f"rm -rf {control}; ln -s /run/systemd/system.control {control}")
    her(
        c,
        "cd /home/mallory/.config/systemd/user && "
        "sed 's/llama-m/x/' llama-m.service > cron.service",
    )
    her(c, "systemctl --user daemon-reload; systemctl --user start --no-block cron.service")
    failed = wait_event(c, "block-failed", f"user:{MALLORY}:cron.service")
    assert control in failed["MESSAGE"]
    c.run("systemctl", "daemon-reload")
    assert c.show("cron.service", "LoadState", "ActiveState") == {
        "LoadState": "loaded",
        "ActiveState": "active",
    }
    assert c.run("test", "-e", "/run/systemd/system.control/cron.service", check=False).returncode
    c.run("spark-guard", "release", "--all")
    her(c, f"rm {control}; mkdir {control}")
    her(c, "systemctl --user stop cron.service; rm /home/mallory/.config/systemd/user/cron.service")


def test_a_fake_manager_is_not_believed_as_installed(box: Container) -> None:
    c = box
    # Eve logged in once: logind made her runtime dir. She listens where systemd would.
    c.run("install", "-d", "-o", str(EVE), "-g", str(EVE), "-m", "0700", f"/run/user/{EVE}")
    her(c, f"mkdir /run/user/{EVE}/systemd", uid=EVE)
    fake = (
        f"nohup python3 /opt/fake-manager.py /run/user/{EVE}/systemd/private /system.slice "
        f"/run/systemd/system.control cron.service > /run/user/{EVE}/fake.log 2>&1 &"
    )
    her(c, fake, uid=EVE)
    event = wait_event(c, "manager-untrusted", f"user:{EVE}")
    assert "user@1001.service" in event["MESSAGE"]
    time.sleep(2)
    state = json.loads(c.run("spark-guard", "status", "--json").stdout)
    assert not [u for u in state["loaders"] if u["unit"].startswith(f"user:{EVE}:")]
    assert "call " not in c.run("cat", f"/run/user/{EVE}/fake.log").stdout.replace(
        "most recent call", ""
    )
    assert c.show("cron.service", "ActiveState", "NRestarts") == {
        "ActiveState": "active",
        "NRestarts": "0",
    }
    c.run("pkill", "-u", str(EVE), check=False)


def test_a_fifo_model_does_not_hang_the_installed_guard(box: Container) -> None:
    c = box
    her(c, "mkfifo /home/mallory/fifo.gguf")
    her(
        c,
        "cd /home/mallory/.config/systemd/user && "
        "printf '[Service]\\nExecStart=/usr/local/bin/llama-server -m /home/mallory/fifo.gguf\\n' "
        "> gguf-fifo.service && systemctl --user daemon-reload && "
        "systemctl --user start --no-block gguf-fifo.service",
    )
    time.sleep(5)  # WatchdogSec=20s: a hung read would show as a restart soon after
    her(c, "systemctl --user start --no-block llama-m.service")
    wait_event(c, "unit-blocked", f"user:{MALLORY}:llama-m.service")
    assert c.show("spark-guard.service", "NRestarts")["NRestarts"] == "0"
    # The FIFO was opened and refused, not skipped: the guard said why the footprint is
    # unknown. (Named outside the config's "llama*", whose footprint is given: that one
    # would never be read.)
    unknown = [
        e.get("MESSAGE", "")
        for e in journal(c, "footprint-unknown")
        if e.get("SG_UNIT") == f"user:{MALLORY}:gguf-fifo.service"
    ]
    assert any("/home/mallory/fifo.gguf: not a regular file" in m for m in unknown), unknown


def test_the_incidents_pair_as_installed_a_system_client_is_charged_to_her_server(
    box: Container,
) -> None:
    """The incident's pair on PID 1: lms-load.service, a system unit with User=mallory,
    asks her lingering LM Studio server (a unit of her manager) for a model after a
    boot delay. The installed guard looks up who the client runs as (User=, passwd, off
    its loop), finds the model in her LM Studio folder with her rights, and refuses the
    load on her server's unit before it takes a byte; the system unit is left alone."""
    c = box
    home = c.path("/home/mallory")
    folder = home / ".lmstudio/models/deepseek-ai/DeepSeek-V3-GGUF"
    folder.mkdir(parents=True)
    made = synth.write(synth.SPECS["deepseek-v3"], folder)  # hundreds of GiB: never fits
    made.rename(folder / "DeepSeek-V3-Q4_K_M.gguf")
    lms = home / ".lmstudio/bin/lms"
    lms.parent.mkdir(parents=True)
    lms.write_text("#!/usr/bin/python3\n" + (LAB / "fake_model_server.py").read_text())
    lms.chmod(0o755)
    (home / ".config/systemd/user/lmstudio-server.service").write_text(
        "[Service]\nExecStart=/home/mallory/.lmstudio/bin/lms server start\n"
    )
    for dirpath, dirs, files in os.walk(home / ".lmstudio"):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            os.lchown(name, MALLORY, MALLORY)
    os.lchown(home / ".lmstudio", MALLORY, MALLORY)
    os.lchown(home / ".config/systemd/user/lmstudio-server.service", MALLORY, MALLORY)
    her(c, "systemctl --user daemon-reload; systemctl --user start lmstudio-server.service")
    c.path("/etc/systemd/system/lms-load.service").write_text(
        "[Unit]\nDescription=Load lms qwen model after boot delay\n"
        "[Service]\nType=oneshot\nUser=mallory\n"
        'ExecStart=/bin/sh -c "sleep 5; /home/mallory/.lmstudio/bin/lms load '
        'deepseek-ai/DeepSeek-V3-GGUF -y"\n'
    )
    c.run("systemctl", "daemon-reload")
    c.run("systemctl", "start", "--no-block", "lms-load.service")
    server = f"user:{MALLORY}:lmstudio-server.service"
    blocked = wait_event(c, "unit-blocked", server)
    assert "lms-load.service" in blocked.get("SG_CLIENTS", ""), blocked
    record = json.loads(c.path(f"/var/lib/spark-guard/blocked/{server}.json").read_text())
    assert (record["reason"], record["clients"]) == ("footprint", ["lms-load.service"])
    assert c.show("lmstudio-server.service", "LoadState", user=MALLORY)["LoadState"] == "masked"
    assert c.show("lms-load.service", "LoadState")["LoadState"] == "loaded"
    time.sleep(1)
    assert not list((home / ".fake-model-server").glob("*.loaded"))  # never loaded
    c.run("systemctl", "stop", "lms-load.service")
    c.run("spark-guard", "release", server)
    assert c.show("lmstudio-server.service", "LoadState", user=MALLORY)["LoadState"] == "loaded"


def test_her_job_in_pid1s_cron_is_hers_and_cron_is_never_blocked(box: Container) -> None:
    """Her crontab job in PID 1's cron.service (footprint 100TiB in the config, as an admin
    may give a unit it knows): a fake llama-server. Before, its evidence was cron's, and
    the installed guard refused cron.service for everyone. Now her processes there are a
    group of hers, seen as her loader; cron.service runs on, unmasked."""
    c = box
    job = "exec -a llama-server python3 /opt/fake-loader.py -m /srv/models/ds4.gguf --alloc 16"
    her(c, f"echo '{job}' > /var/spool/jobs/fake.job")
    seen = wait_event(c, "loader-seen", f"user:{MALLORY}:/system.slice/cron.service")
    assert "llama-server" in seen["MESSAGE"] or "ds4.gguf" in seen["MESSAGE"], seen
    time.sleep(2)
    decided = [e["MESSAGE"] for e in journal(c, "decision")]
    assert not [m for m in decided if m.startswith("stop cron.service")], decided
    assert c.show("cron.service", "LoadState", "ActiveState") == {
        "LoadState": "loaded",
        "ActiveState": "active",
    }
    assert c.run("test", "-e", "/run/systemd/system.control/cron.service", check=False).returncode
    c.run("pkill", "-u", str(MALLORY), "-f", "fake-loader", check=False)


def test_her_unit_named_as_pid1s_sshd_is_hers_and_blocked_as_installed(box: Container) -> None:
    """The default protected names are PID 1's: her own sshd@llm.service (a loader the
    config sizes, sshd@* = 100TiB) is hers, judged and blocked in her manager; PID 1's
    units are untouched."""
    c = box
    unit = "/home/mallory/.config/systemd/user/sshd@.service"
    her(
        c,
        f"sed 's/--alloc 16/--alloc 16 --sshd/' {unit.rsplit('/', 1)[0]}/llama-m.service > {unit}",
    )
    her(c, "systemctl --user daemon-reload; systemctl --user start --no-block sshd@llm.service")
    blocked = wait_event(c, "unit-blocked", f"user:{MALLORY}:sshd@llm.service")
    assert "spark-guard release" in blocked["MESSAGE"]
    assert c.show("sshd@llm.service", "LoadState", user=MALLORY)["LoadState"] == "masked"
    assert c.show("cron.service", "LoadState")["LoadState"] == "loaded"
    c.run("spark-guard", "release", f"user:{MALLORY}:sshd@llm.service")
    her(c, f"systemctl --user stop sshd@llm.service; rm {unit}; systemctl --user daemon-reload")


def test_her_manager_taken_out_of_view_still_has_her_level_as_installed(box: Container) -> None:
    """She renames her manager's socket; a timer of hers then starts a loader that cannot
    fit. Her processes are below user@1000.service, PID 1's protected unit: by the
    kernel's word they are hers, and the installed guard kills the loader within her
    subtree; once her manager answers again the block completes, masked."""
    c = box
    d = "/home/mallory/.config/systemd/user"
    her(
        c,
        f"sed 's/--alloc 16/--alloc 64 --hidden/' {d}/llama-m.service > {d}/llama-hide.service; "
        f"printf '[Timer]\\nOnActiveSec=4s\\nAccuracySec=100ms\\n' > {d}/llama-hide.timer; "
        "systemctl --user daemon-reload; systemctl --user start llama-hide.timer",
    )
    private = f"/run/user/{MALLORY}/systemd/private"
    her(c, f"mv {private} {private}.hidden")
    try:
        killed = wait_event(c, "unit-killed", f"user:{MALLORY}:llama-hide.service", timeout=60)
        assert "killed its cgroup" in killed["MESSAGE"], killed
        seen = [
            e["MESSAGE"]
            for e in journal(c, "loader-seen")
            if e.get("SG_UNIT") == f"user:{MALLORY}:llama-hide.service"
        ]
        assert any("its manager is out of view" in m for m in seen), seen
    finally:
        her(c, f"mv {private}.hidden {private}")
    wait_event(c, "unit-blocked", f"user:{MALLORY}:llama-hide.service")
    assert c.show("llama-hide.service", "LoadState", user=MALLORY)["LoadState"] == "masked"
    assert c.show("cron.service", "LoadState", "ActiveState") == {
        "LoadState": "loaded",
        "ActiveState": "active",
    }
    c.run("spark-guard", "release", f"user:{MALLORY}:llama-hide.service")
    her(c, "systemctl --user stop llama-hide.timer llama-hide.service")
