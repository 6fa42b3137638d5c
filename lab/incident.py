"""The incident of ../shared/seeds/000_*.txt, replayed against the installed .deb under PID 1.

One machine (a systemd-nspawn container, lab/nspawn.py, Debian 12 or Ubuntu 24.04)
laid out as the report's: `llama-ds4-0731.service` twice, a system unit in
/etc/systemd/system (WantedBy=multi-user.target) and a linger user's in
~/.config/systemd/user with a draft model (WantedBy=default.target), both loading a
115 GB GGUF (a sparse file with DeepSeek's real header shape, lab/synth.py: a few kB on
disk, 107 GiB to anyone who reads it); beside it, one small model loaded twice the same
way (`llama-qwen3.service`, a Qwen3-0.6B GGUF: fits, so only the duplicate rule can
refuse a copy), and in variant A her LM Studio server with the incident's
`lms-load.service` ("Load lms qwen model after boot delay") and her Ollama server with
a preload unit, each asking for the 115 GB model. The user is `xlab` (uid 1000), with
linger, as in the report.

Nothing of the guard is configured: /etc/spark-guard.toml is the package's, untouched
(no [loaders.footprint]: every footprint comes from a GGUF header, through the command
line the guard reads). The machine's MemAvailable is the host's (24 GiB here), so the
115 GB model cannot fit and the 0.6B one can, under the default 8 GiB reserve.

The order of a boot is set by ordering, never by sleeps:
  - her copy second: a drop-in `user@1000.service.d/` with After= the system copy, so her
    manager (and all of her units) starts only once the system copy has;
  - her copy first: the system copy is After= `boot-order-gate.service`, a oneshot of
    hers that ends once her copy has started (or cannot start this boot: masked,
    disabled), asking her manager.
Variant A is ds4 with her copy second and qwen3 with her copy first; variant B the
other way round. Each is replayed in three boots of one tree (replay()):
  1. manager-before: the guard's unit is not enabled for this boot; once her manager
     and every loader are up, it is started: its first look finds her manager answering;
  2. manager-after: the guard enabled (as the package leaves it), a normal boot: the
     guard is up before basic.target, her user@1000.service (linger) starts after it, so
     her units are first seen while her manager does not answer yet (issue 38);
  3. second-boot: the same tree booted again, with what phase 2 blocked.
After phases 1 and 3, `spark-guard release --all`. What an admin would look at is
recorded after each (systemctl show on both levels, the links, the guard's records and
journal, the rescue path); tests/test_incident.py holds it to what it should be.

The programs are stand-ins that show the kernel exactly the command line the real one
has, from the first instruction: `llama-server`, `lms` and `ollama` are symlinks to
python3 in a directory laid out as a virtual environment (pyvenv.cfg), whose
site-packages runs lab/fake_loader.py or lab/fake_model_server.py by the name it was
run as. No shell or interpreter wrapper ever shows in /proc/PID/cmdline (the guard reads
a process's argv once: a wrapper's would stand for the loader's). The loader maps the
model and allocates 64 MiB for real; a server allocates only when a client's load
reaches it. The rootfs has no openssh-server: ssh.service is a stand-in that answers
on port 22 with an SSH banner (the rescue unit the guard's boot phase waits for, and
what the tests connect to).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import LAB
from lab.harness import file_tree, poll
from lab.nspawn import Container
from lab.synth import SPECS, Spec, write

UID = 1000
USER = "xlab"
HOME = f"/home/{USER}"
GUARD = "spark-guard.service"
GUARD_LINK = "/etc/systemd/system/sysinit.target.wants/spark-guard.service"

# DeepSeek's shape (MLA, 256 experts, Q2_K) cut to 31 blocks: 115 GB, the report's model.
DS4 = dataclasses.replace(SPECS["deepseek-v3"], name="DeepSeek-V4-Flash-0731", n_layer=31)
QWEN3_06B = Spec("Qwen3-0.6B", "qwen3", 28, 1024, 16, 8, 128, 128, 40960, 151936, n_ff=3072)
DS4_MODEL = "/srv/models/ds4-0731/model.gguf"
DS4_DRAFT = "/srv/models/ds4-0731/draft.gguf"
QWEN_MODEL = "/srv/models/qwen3-0.6b/model.gguf"
LLAMA_SERVER = "/opt/llama.cpp/build/bin/llama-server"
OLLAMA = "/opt/ollama/bin/ollama"
LMS = f"{HOME}/.lmstudio/bin/lms"
LMS_KEY = "lmstudio-community/DeepSeek-V4-Flash-0731-GGUF"
OLLAMA_MODEL = "ds4-0731"
# What a stand-in loader allocates for real (the header says the rest).
ALLOC = "--alloc 64 --rate 32"
# The incident's client waits after boot before it asks (its unit says so, as the
# report's "Load lms qwen model after boot delay" did); the guard has this long to refuse
# the load on the server before it reaches it.
CLIENT_DELAY = 20


@dataclass(frozen=True)
class Unit:
    name: str
    uid: int | None = None  # None: PID 1's

    @property
    def ref(self) -> str:
        """As the guard names it (records, journal, `spark-guard release`)."""
        return self.name if self.uid is None else f"user:{self.uid}:{self.name}"

    @property
    def file(self) -> str:
        if self.uid is None:
            return f"/etc/systemd/system/{self.name}"
        return f"{HOME}/.config/systemd/user/{self.name}"

    @property
    def link(self) -> str:
        """Its enablement: the wants link `disable` removes and `release` puts back."""
        if self.uid is None:
            return f"/etc/systemd/system/multi-user.target.wants/{self.name}"
        return f"{HOME}/.config/systemd/user/default.target.wants/{self.name}"


SYS_DS4 = Unit("llama-ds4-0731.service")
HER_DS4 = Unit("llama-ds4-0731.service", UID)
SYS_QWEN = Unit("llama-qwen3.service")
HER_QWEN = Unit("llama-qwen3.service", UID)
LMS_SERVER = Unit("lmstudio-server.service", UID)
LMS_LOAD = Unit("lms-load.service", UID)
OLLAMA_SERVER = Unit("ollama.service", UID)
OLLAMA_PRELOAD = Unit("ollama-preload.service", UID)
SSH = Unit("ssh.service")
GATE = Unit("boot-order-gate.service")
PROPS = (
    "LoadState",
    "ActiveState",
    "SubState",
    "UnitFileState",
    "NRestarts",
    "InvocationID",
    "ActiveEnterTimestampMonotonic",
    "ExecMainStartTimestampMonotonic",
)


@dataclass(frozen=True)
class Variant:
    """Which copy of each pair starts first, and whether her servers are there."""

    key: str
    ds4_user_first: bool
    servers: bool

    @property
    def qwen_user_first(self) -> bool:
        return not self.ds4_user_first

    @property
    def blocked(self) -> tuple[Unit, ...]:
        """What the guard must stop, mask and disable in every phase."""
        servers = (LMS_SERVER, OLLAMA_SERVER) if self.servers else ()
        return (SYS_DS4, HER_DS4, HER_QWEN, *servers)

    @property
    def running(self) -> tuple[Unit, ...]:
        """What must keep running: root's copy of the model that fits."""
        return (SYS_QWEN,)

    @property
    def clients(self) -> tuple[Unit, ...]:
        return (LMS_LOAD, OLLAMA_PRELOAD) if self.servers else ()

    @property
    def units(self) -> tuple[Unit, ...]:
        servers = (LMS_SERVER, LMS_LOAD, OLLAMA_SERVER, OLLAMA_PRELOAD) if self.servers else ()
        return (SYS_DS4, HER_DS4, SYS_QWEN, HER_QWEN, *servers)


VARIANTS = {
    "A": Variant("ds4-user-second+qwen3-user-first+lmstudio+ollama", False, True),
    "B": Variant("ds4-user-first+qwen3-user-second", True, False),
}
PHASES = ("manager-before", "manager-after", "second-boot")


# ---------------------------------------------------------------------------- layout

LLAMA_UNIT = """[Unit]
Description={what}
After=network.target
[Service]
ExecStart={exec_start}
Restart=on-failure
RestartSec=1s
[Install]
WantedBy={target}
"""

# The stand-ins' site-packages: run by python3 at startup (a .pth line), before it would
# read its first argument as a script; exits there.
STANDIN = '''"""Run as the program this interpreter was started as (lab/incident.py)."""
import os
import runpy
import sys

with open("/proc/self/cmdline", "rb") as f:
    argv = [a.decode() for a in f.read().split(b"\\0")[:-1]]
name = os.path.basename(argv[0]) if argv else ""
script = {
    "llama-server": "fake_loader.py",
    "lms": "fake_model_server.py",
    "ollama": "fake_model_server.py",
}.get(name)
if script is not None:
    # One spool per program: her LM Studio's loads are not answered by her Ollama.
    os.environ.setdefault(
        "FAKE_SERVER_SPOOL", os.path.join(os.path.expanduser("~"), f".fake-{name}-spool")
    )
    sys.argv = argv
    code = 0
    try:
        runpy.run_path(os.path.join(os.path.dirname(__file__), script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
'''

SSHD_STANDIN = """import socket

s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 22))
s.listen(16)
while True:
    conn, _ = s.accept()
    try:
        conn.sendall(b"SSH-2.0-OpenSSH_9.6 spark-guard-test-stand-in\\r\\n")
    except OSError:
        pass
    conn.close()
"""

# Ends once her copy has started this boot, or will not start (masked, disabled).
GATE_SCRIPT = """#!/bin/sh
u={unit}
while :; do
  started=$(systemctl --user show -P ExecMainStartTimestampMonotonic "$u" 2>/dev/null)
  [ -n "$started" ] && [ "$started" != 0 ] && exit 0
  state=$(systemctl --user is-enabled "$u" 2>/dev/null)
  [ -n "$state" ] && [ "$state" != enabled ] && exit 0
  sleep 0.1
done
"""


def _python_dirs(c: Container) -> list[str]:
    lib = c.path("/usr/lib")
    return sorted(p.name for p in lib.glob("python3.*") if p.name[len("python3.") :].isdigit())


def standin(c: Container, program: str, owner: int = 0) -> None:
    """`program` (an absolute path ending in bin/NAME), a stand-in for the real one."""
    path = c.path(program)
    venv = path.parent.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/usr/bin/python3")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    for version in _python_dirs(c):
        site = venv / "lib" / version / "site-packages"
        site.mkdir(parents=True, exist_ok=True)
        (site / "standin.pth").write_text("import standin\n")
        (site / "standin.py").write_text(STANDIN)
        shutil.copy(LAB / "fake_loader.py", site / "fake_loader.py")
        shutil.copy(LAB / "fake_model_server.py", site / "fake_model_server.py")
    if owner:
        chown_tree(venv, owner)


def chown_tree(top: Path, uid: int) -> None:
    for dirpath, dirs, files in os.walk(top):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            os.lchown(name, uid, uid)


def model(c: Container, spec: Spec, path: str, owner: int = 0) -> None:
    """A sparse GGUF at `path`, written in place (a copy would fill the hole)."""
    dest = c.path(path)
    scratch = dest.parent / ".synth"
    scratch.mkdir(parents=True)
    write(spec, scratch).rename(dest)
    scratch.rmdir()
    if owner:
        os.chown(dest, owner, owner)


def unit_file(c: Container, unit: Unit, text: str) -> None:
    path = c.path(unit.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def enable(c: Container, unit: Unit) -> None:
    link = c.path(unit.link)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(unit.file)


def drop_in(c: Container, unit: str, text: str) -> None:
    d = c.path(f"/etc/systemd/system/{unit}.d")
    d.mkdir(parents=True, exist_ok=True)
    (d / "incident-order.conf").write_text(text)


def lay_out(c: Container, variant: Variant) -> None:
    """The report's machine, before its first boot."""
    for name, line in (
        ("passwd", f"{USER}:x:{UID}:{UID}:xLab:{HOME}:/bin/sh"),
        ("group", f"{USER}:x:{UID}:"),
        ("shadow", f"{USER}:!:20000:0:99999:7:::"),
    ):
        with open(c.path(f"/etc/{name}"), "a") as f:
            f.write(line + "\n")
    c.path("/var/lib/systemd/linger").mkdir(parents=True, exist_ok=True)
    c.path(f"/var/lib/systemd/linger/{USER}").touch()

    model(c, DS4, DS4_MODEL)
    model(c, QWEN3_06B, DS4_DRAFT)  # her speculative decoding's draft: small
    model(c, QWEN3_06B, QWEN_MODEL)
    standin(c, LLAMA_SERVER)

    base = f"{LLAMA_SERVER} -m {DS4_MODEL} -ngl 999 -fa on --jinja -c 131072 -np 1 --host 0.0.0.0"
    unit_file(
        c,
        SYS_DS4,
        LLAMA_UNIT.format(
            what="DeepSeek V4 Flash 0731 via llama.cpp",
            exec_start=f"{base} --port 8000 {ALLOC}",
            target="multi-user.target",
        ),
    )
    unit_file(
        c,
        HER_DS4,
        LLAMA_UNIT.format(
            what="DeepSeek V4 Flash 0731 via llama.cpp, speculative decoding",
            exec_start=f"{base} --port 8001 --model-draft {DS4_DRAFT} {ALLOC}",
            target="default.target",
        ),
    )
    qwen = f"{LLAMA_SERVER} -m {QWEN_MODEL} -c 4096"
    unit_file(
        c,
        SYS_QWEN,
        LLAMA_UNIT.format(
            what="Qwen3-0.6B via llama.cpp",
            exec_start=f"{qwen} --port 8010 {ALLOC}",
            target="multi-user.target",
        ),
    )
    unit_file(
        c,
        HER_QWEN,
        LLAMA_UNIT.format(
            what="Qwen3-0.6B via llama.cpp",
            exec_start=f"{qwen} --port 8011 {ALLOC}",
            target="default.target",
        ),
    )
    for unit in (SYS_DS4, HER_DS4, SYS_QWEN, HER_QWEN):
        enable(c, unit)

    # The boot's order, pair by pair.
    first, second = (SYS_QWEN, SYS_DS4) if variant.ds4_user_first else (SYS_DS4, SYS_QWEN)
    # `second`'s pair: her copy first, by the gate; `first`'s: her copy second, her whole
    # manager after the system copy.
    drop_in(c, f"user@{UID}.service", f"[Unit]\nAfter={first.name}\n")
    drop_in(c, second.name, f"[Unit]\nWants={GATE.name}\nAfter={GATE.name}\n")
    gate = c.path("/usr/local/libexec/boot-order-gate")
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.write_text(GATE_SCRIPT.format(unit=second.name))
    gate.chmod(0o755)
    unit_file(
        c,
        GATE,
        f"[Unit]\nDescription=Boot order: after {USER}'s copy of {second.name}\n"
        f"After=user@{UID}.service\n[Service]\nType=oneshot\nUser={USER}\n"
        f"Environment=XDG_RUNTIME_DIR=/run/user/{UID}\nTimeoutStartSec=45\n"
        "ExecStart=/usr/local/libexec/boot-order-gate\n",
    )

    if variant.servers:
        lay_out_servers(c)

    sshd = c.path("/usr/local/sbin/sshd-standin")
    sshd.parent.mkdir(parents=True, exist_ok=True)
    sshd.write_text(SSHD_STANDIN)
    unit_file(
        c,
        SSH,
        "[Unit]\nDescription=OpenBSD Secure Shell server (stand-in: answers with a banner)\n"
        "[Service]\nExecStart=/usr/bin/python3 /usr/local/sbin/sshd-standin\n"
        "[Install]\nWantedBy=multi-user.target\n",
    )
    enable(c, SSH)
    chown_tree(c.path(HOME), UID)


def lay_out_servers(c: Container) -> None:
    """Her LM Studio server and Ollama server, each with a unit of hers that asks it for
    the 115 GB model after a boot delay."""
    folder = f"{HOME}/.lmstudio/models/{LMS_KEY}"
    model(c, DS4, f"{folder}/DeepSeek-V4-Flash-0731-Q2_K.gguf", UID)
    standin(c, LMS, UID)
    unit_file(
        c,
        LMS_SERVER,
        "[Unit]\nDescription=LM Studio server\n[Service]\n"
        "ExecStart=%h/.lmstudio/bin/lms server start\nRestart=on-failure\nRestartSec=1s\n"
        "[Install]\nWantedBy=default.target\n",
    )
    unit_file(
        c,
        LMS_LOAD,
        "[Unit]\nDescription=Load lms qwen model after boot delay\n"
        f"After={LMS_SERVER.name}\n[Service]\n"
        f'ExecStart=/bin/sh -c "sleep {CLIENT_DELAY}; '
        f'exec %h/.lmstudio/bin/lms load {LMS_KEY} -y"\n'
        "[Install]\nWantedBy=default.target\n",
    )
    models = f"{HOME}/.ollama/models"
    digest = "7c3a1f4d0b9e8a2c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c"
    model(c, DS4, f"{models}/blobs/sha256-{digest}", UID)
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
    path = c.path(f"{models}/manifests/registry.ollama.ai/library/{OLLAMA_MODEL}/latest")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    standin(c, OLLAMA)
    unit_file(
        c,
        OLLAMA_SERVER,
        f"[Unit]\nDescription=Ollama Service\n[Service]\nExecStart={OLLAMA} serve\n"
        "Restart=on-failure\nRestartSec=1s\n[Install]\nWantedBy=default.target\n",
    )
    unit_file(
        c,
        OLLAMA_PRELOAD,
        f"[Unit]\nDescription=Preload {OLLAMA_MODEL} into Ollama\n"
        f"After={OLLAMA_SERVER.name}\n[Service]\n"
        f'ExecStart=/bin/sh -c "sleep {CLIENT_DELAY}; exec {OLLAMA} run {OLLAMA_MODEL}"\n'
        "[Install]\nWantedBy=default.target\n",
    )
    for unit in (LMS_SERVER, LMS_LOAD, OLLAMA_SERVER, OLLAMA_PRELOAD):
        enable(c, unit)


def install(c: Container, deb: Path) -> None:
    """The .deb, with dpkg and its maintainer scripts, before the first boot (as demo/
    does); /etc/spark-guard.toml stays the package's."""
    out = subprocess.run(
        ["dpkg", "--root", str(c.root), "-i", str(deb)], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"dpkg -i: {out.stdout[-2000:]}{out.stderr[-2000:]}")
    if not os.path.lexists(c.path(GUARD_LINK)):
        raise RuntimeError(f"the package did not enable the guard: no {GUARD_LINK}")


# ------------------------------------------------------------------------ observing


@dataclass
class UnitSeen:
    props: dict[str, str]
    linked: bool
    record: dict[str, Any] | None


@dataclass
class Released:
    rc: int
    output: str
    units: dict[str, dict[str, str]]
    tree: dict[str, tuple[object, ...]]


@dataclass
class Phase:
    name: str
    settled: bool
    waited: float
    # Each unit's props when the phase settled (or its deadline passed), and at its end.
    at_settle: dict[str, dict[str, str]]
    units: dict[str, UnitSeen]
    # Each loader's ExecMainStartTimestampMonotonic once all were up, before the guard
    # was started (manager-before only): the order the boot gave them.
    started: dict[str, int]
    tree: dict[str, tuple[object, ...]]
    ssh: str
    guard: dict[str, str]
    loads: list[str]  # her servers' answered loads (*.loaded in their spools)
    journal: str
    # Each loader's runs this boot (its manager's "Started" entries), its restarts (its
    # manager's "Scheduled restart job" entries: NRestarts reads 0 again once a unit is
    # reset), and the lines its manager logged about it.
    runs: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    unit_log: str = ""
    released: Released | None = None


@dataclass
class Replay:
    suite: str
    variant: Variant
    before: dict[str, tuple[object, ...]] = field(default_factory=dict)
    phases: dict[str, Phase] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0


def show(c: Container, unit: Unit, *props: str) -> dict[str, str]:
    try:
        return c.show(unit.name, *props, user=unit.uid)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return {}  # her manager not answering (yet): nothing to show


def record(c: Container, unit: Unit) -> dict[str, Any] | None:
    path = c.path(f"/var/lib/spark-guard/blocked/{unit.ref}.json")
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def unit_tree(c: Container) -> dict[str, tuple[object, ...]]:
    """/etc/systemd/system and her ~/.config/systemd, keyed by their paths in the machine;
    the guard's own enablement link aside (this replay enables it between boots)."""
    roots = (c.path("/etc/systemd/system"), c.path(f"{HOME}/.config/systemd"))
    tree = {k[len(str(c.root)) :]: v for k, v in file_tree(*roots).items()}
    tree.pop(GUARD_LINK, None)
    return tree


def ssh_banner(c: Container, timeout: float = 15) -> str:
    probe = (
        "import socket; s = socket.create_connection(('127.0.0.1', 22), timeout=5); "
        "print(s.recv(128).decode(errors='replace').strip())"
    )
    deadline = time.monotonic() + timeout
    said = ""
    while time.monotonic() < deadline:
        out = c.run("python3", "-c", probe, check=False, timeout=20)
        said = out.stdout.strip() or out.stderr.strip()[-300:]
        if out.returncode == 0 and said.startswith("SSH-2.0-"):
            return said
        time.sleep(0.2)
    return f"no answer on port 22: {said}"


def journal(c: Container) -> str:
    return c.run(
        "journalctl", "-b", "-u", GUARD, "--no-pager", "-o", "short-monotonic", check=False
    ).stdout


# systemd's catalog: "Started UNIT" (a start job done), "Scheduled restart job" (Restart=).
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
UNIT_RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"


def manager_log(c: Container, unit: Unit) -> tuple[int, int, list[str]]:
    """How often its manager started it this boot, and restarted it (Restart=); and what
    its manager said about it."""
    match = (
        ["_PID=1", f"UNIT={unit.name}"]
        if unit.uid is None
        else [
            f"_UID={unit.uid}",
            f"USER_UNIT={unit.name}",
        ]
    )
    out = c.run("journalctl", "-b", "-o", "json", "--no-pager", *match, check=False).stdout
    runs, restarts, lines = 0, 0, []
    for line in out.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        runs += entry.get("MESSAGE_ID") == UNIT_STARTED
        restarts += entry.get("MESSAGE_ID") == UNIT_RESTART_SCHEDULED
        at = int(entry.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
        lines.append(f"[{at:12.6f}] {unit.ref}: {entry.get('MESSAGE', '')}")
    return runs, restarts, lines


def loads(c: Container) -> list[str]:
    return sorted(str(p)[len(str(c.root)) :] for p in c.path(HOME).glob(".fake-*-spool/*.loaded"))


def is_blocked(c: Container, unit: Unit) -> bool:
    r = record(c, unit)
    if r is None or r.get("step") != "blocked":
        return False
    p = show(c, unit, "LoadState", "ActiveState")
    return p.get("LoadState") == "masked" and p.get("ActiveState") in ("inactive", "failed")


def is_active(c: Container, unit: Unit) -> bool:
    return show(c, unit, "ActiveState").get("ActiveState") == "active"


def observe(
    c: Container,
    name: str,
    variant: Variant,
    settled: bool,
    waited: float,
    at_settle: dict[str, dict[str, str]],
    started: dict[str, int] | None = None,
) -> Phase:
    units = {
        u.ref: UnitSeen(show(c, u, *PROPS), os.path.lexists(c.path(u.link)), record(c, u))
        for u in variant.units
    }
    runs: dict[str, int] = {}
    restarts: dict[str, int] = {}
    log: list[str] = []
    for u in variant.units:
        runs[u.ref], restarts[u.ref], lines = manager_log(c, u)
        log += lines
    return Phase(
        name,
        settled,
        waited,
        at_settle,
        units,
        started or {},
        unit_tree(c),
        ssh_banner(c),
        show(c, Unit(GUARD), "ActiveState", "NRestarts", "StatusText"),
        loads(c),
        journal(c),
        runs,
        restarts,
        "\n".join(sorted(log)),
    )


def release_all(c: Container, variant: Variant) -> Released:
    """`spark-guard release --all`, as the admin would run it once nothing asks for the
    model any more: her clients still waiting out their boot delay are stopped first
    (released while one still asks, the guard refuses that load again, rightly)."""
    if variant.servers:
        clients = (LMS_LOAD.name, OLLAMA_PRELOAD.name)
        c.run("systemctl", "--user", "stop", *clients, user=UID, check=False)
    out = c.run("spark-guard", "release", "--all", check=False, timeout=120)
    units = {u.ref: show(c, u, "LoadState", "UnitFileState") for u in variant.units}
    return Released(out.returncode, out.stdout + out.stderr, units, unit_tree(c))


def settle(c: Container, variant: Variant, timeout: float) -> tuple[bool, float]:
    """Until every unit to block is blocked, root's copy that fits runs, and no block is
    half done (a client refused once its server was blocked: its own block, finished)."""
    return poll(
        lambda: (
            all(is_blocked(c, u) for u in variant.blocked)
            and all(is_active(c, u) for u in variant.running)
            and not any(in_progress(c, u) for u in variant.units)
            # A client still asking once its server is blocked is refused on its own
            # footprint: settled when it is blocked too, or asks no more.
            and all(is_blocked(c, u) or not is_active(c, u) for u in variant.clients)
        ),
        timeout,
    )


def in_progress(c: Container, unit: Unit) -> bool:
    """A block of the unit recorded and not yet finished."""
    r = record(c, unit)
    return r is not None and r.get("step") != "blocked"


def start_time(c: Container, unit: Unit) -> int:
    """When its main process last started (CLOCK_MONOTONIC, one clock for both levels)."""
    key = "ExecMainStartTimestampMonotonic"
    value = show(c, unit, key).get(key, "0")
    return int(value) if value.isdigit() else 0


def snapshot(c: Container, units: Iterable[Unit]) -> dict[str, dict[str, str]]:
    return {u.ref: show(c, u, *PROPS) for u in units}


def replay(suite: str, variant: Variant, deb: Path, settle_timeout: float = 45) -> Replay:
    """The three boots of one tree, observed; never raises (an error is recorded)."""
    began = time.monotonic()
    out = Replay(suite, variant)
    try:
        with Container(suite) as c:
            lay_out(c, variant)
            install(c, deb)
            out.before = unit_tree(c)

            # 1. Her manager and every loader up before the guard's first look.
            os.unlink(c.path(GUARD_LINK))
            c.boot()
            up: tuple[Unit, ...] = (
                SYS_DS4,
                HER_DS4,
                SYS_QWEN,
                HER_QWEN,
                Unit(f"user@{UID}.service"),
            )
            if variant.servers:
                up += (LMS_SERVER, LMS_LOAD, OLLAMA_SERVER, OLLAMA_PRELOAD)
            poll(lambda: all(is_active(c, u) for u in up), 60)
            started = {u.ref: start_time(c, u) for u in variant.units}
            c.run("systemctl", "start", GUARD)
            ok, waited = settle(c, variant, settle_timeout)
            phase = observe(c, PHASES[0], variant, ok, waited, snapshot(c, variant.units), started)
            phase.released = release_all(c, variant)
            out.phases[phase.name] = phase

            # 2. A normal boot: the guard before basic.target, her manager after it.
            c.run("systemctl", "enable", GUARD)
            c.reboot()
            ok, waited = settle(c, variant, settle_timeout)
            at = snapshot(c, variant.units)
            out.phases[PHASES[1]] = observe(c, PHASES[1], variant, ok, waited, at)

            # 3. The same tree again.
            c.reboot()
            ok, waited = poll(
                lambda: (
                    is_active(c, Unit(GUARD))
                    and is_active(c, Unit(f"user@{UID}.service"))
                    and is_active(c, Unit("default.target", UID))
                    and is_active(c, Unit("multi-user.target"))
                    and all(is_active(c, u) for u in variant.running)
                    and all(
                        show(c, u, "LoadState").get("LoadState") == "masked"
                        for u in variant.blocked
                    )
                ),
                settle_timeout,
            )
            phase = observe(c, PHASES[2], variant, ok, waited, snapshot(c, variant.units))
            phase.released = release_all(c, variant)
            out.phases[phase.name] = phase
    except Exception:
        out.error = traceback.format_exc()
    out.seconds = time.monotonic() - began
    return out
