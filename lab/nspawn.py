"""systemd as PID 1 in a systemd-nspawn container, booted from a Debian rootfs built here.

The rootfs is built once with mmdebstrap from the package registry and
cached under /var/tmp; each test boots a copy of it. nspawn runs in a private
mount namespace (it leaves /run/systemd/nspawn behind otherwise) and in its
own cgroups in both hierarchies of this hybrid host; everything it started
is killed and its cgroups and files removed on exit. Commands run inside with
nsenter into all of PID 1's namespaces (machinectl does not work here).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from lab.harness import CGROUP_ROOTS, _kill_and_remove

# Debian 12 from the host's own Debian mirror (its apt sources, as mmdebstrap takes them
# when no mirror is named); Ubuntu 24.04 (DGX OS's base) from the mirror debootstrap names
# for it on this machine's architecture (archive.ubuntu.com, or the ports mirror off
# amd64), with its archive key from the ubuntu-keyring package there, checked against this
# digest. The code names no package host.
UBUNTU_KEYRING = (
    "pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb",
    "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8",
)
SUITES = {"bookworm": ("main", False), "noble": ("main,universe", True)}
DEBOOTSTRAP_SCRIPTS = Path("/usr/share/debootstrap/scripts")
# debootstrap's scripts say their mirror with a call to default_mirror; sourced with it
# defined as `echo`, and the rest of its vocabulary as no-ops, one says it and nothing else.
_SAY_MIRROR = (
    'default_mirror() { echo "$1"; }; mirror_style() { :; }; download_style() { :; }; '
    "finddebs_style() { :; }; variants() { :; }; keyring() { :; }; "
    'doing_variant() { false; }; info() { :; }; . "$0"'
)


def ubuntu_mirror(suite: str) -> str:
    """The mirror debootstrap uses for Ubuntu `suite` on this machine's architecture: its
    script for the suite, or, where this debootstrap predates the suite, the script all of
    Ubuntu's suites share (gutsy), as mmdebstrap does."""
    arch = subprocess.run(
        ["dpkg", "--print-architecture"], capture_output=True, text=True, check=True
    ).stdout.strip()
    script = DEBOOTSTRAP_SCRIPTS / suite
    if not script.exists():
        script = DEBOOTSTRAP_SCRIPTS / "gutsy"
    if not script.exists():
        raise RuntimeError(f"{script}: no debootstrap script to name {suite}'s mirror")
    said = subprocess.run(
        ["sh", "-c", _SAY_MIRROR, str(script)],
        env={"ARCH": arch, "SUITE": suite, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    mirror = said.stdout.split()[-1] if said.returncode == 0 and said.stdout.split() else ""
    if not mirror.startswith(("http://", "https://")):
        raise RuntimeError(f"{script}: names no mirror for {suite} on {arch}")
    return mirror


PACKAGES = (
    "apt",  # in Debian's minbase anyway; Ubuntu's leaves it out
    "systemd",
    "systemd-sysv",
    "libpam-systemd",
    "dbus",
    "python3",
    "python3-pystemd",
    "python3-systemd",
    "python3-sdnotify",
    "python3-structlog",
)
CACHE = Path("/var/tmp/spark-guard-tests")


def _ubuntu_keyring(mirror: str) -> Path:
    keyring = CACHE / "ubuntu-archive-keyring.gpg"
    if keyring.exists():
        return keyring
    path, digest = UBUNTU_KEYRING
    url = f"{mirror}/{path}"
    with urllib.request.urlopen(url, timeout=60) as r:
        deb = r.read()
    if hashlib.sha256(deb).hexdigest() != digest:
        raise RuntimeError(f"{url}: sha256 does not match the pinned one")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.deb").write_bytes(deb)
        subprocess.run(["dpkg-deb", "-x", f"{d}/k.deb", f"{d}/x"], check=True)
        shutil.copy(f"{d}/x/usr/share/keyrings/ubuntu-archive-keyring.gpg", keyring)
    return keyring


def rootfs(suite: str = "bookworm", extra: tuple[str, ...] = ()) -> Path:
    """The cached rootfs of `suite` (plus `extra` packages), built on first use (20-50 s)."""
    components, ubuntu = SUITES[suite]
    packages = PACKAGES + extra
    key = hashlib.sha256(f"{suite} {' '.join(packages)}".encode()).hexdigest()[:12]
    image = CACHE / f"{suite}-{key}"
    if (image / "etc" / "os-release").exists():
        return image
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{image.name}.", dir=CACHE))
    mirror = ubuntu_mirror(suite) if ubuntu else None
    keyring = [f"--keyring={_ubuntu_keyring(mirror)}"] if mirror else []
    try:
        subprocess.run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                f"--components={components}",
                f"--include={','.join(packages)}",
                *keyring,
                suite,
                str(partial),
                *([mirror] if mirror else []),
            ],
            check=True,
            capture_output=True,
            timeout=900,
        )
        partial.rename(image)  # atomic: a half-built tree is never taken for a cache
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return image


class Container:
    """`with Container() as c:`, then c.boot(), c.run(...), c.reboot()."""

    def __init__(self, suite: str = "bookworm", extra: tuple[str, ...] = ()) -> None:
        self.suite = suite
        self.extra = extra
        self.base = Path(tempfile.mkdtemp(prefix="sg-ns.", dir="/var/tmp"))
        self.root = self.base / "root"
        self.name = f"sg{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
        self.cgroup = f"sg-ns-{self.name}"
        self.console = self.base / "console.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.leader = 0

    def __enter__(self) -> Container:
        subprocess.run(
            ["cp", "-a", "--reflink=auto", str(rootfs(self.suite, self.extra)), str(self.root)],
            check=True,
        )
        # A machine-id of its own: no first-boot presets rewriting /etc/systemd.
        (self.root / "etc" / "machine-id").write_text(uuid.uuid4().hex + "\n")
        for root in CGROUP_ROOTS:
            os.mkdir(f"{root}/{self.cgroup}")
        return self

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def boot(self, timeout: float = 60) -> None:
        moves = "; ".join(f"echo $$ > {r}/{self.cgroup}/cgroup.procs" for r in CGROUP_ROOTS)
        # nspawn keeps its locks and propagation dirs under /run/systemd/nspawn:
        # a tmpfs in its private mount namespace keeps the host's /run clean. A network
        # namespace of its own: its sshd must not meet the host's on port 22.
        script = (
            f"{moves}; exec unshare --mount --propagation private sh -c '"
            f"mount -t tmpfs tmpfs /run/systemd && exec systemd-nspawn --quiet --register=no "
            f"--keep-unit --console=pipe --private-network -D {self.root} -M {self.name} -b'"
        )
        with open(self.console, "ab") as out:
            self.proc = subprocess.Popen(
                ["sh", "-c", script],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        self.leader = 0
        while not self.leader:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"container did not boot: {self.console_text()[-3000:]}")
            self.leader = _child_named(self.proc.pid, "systemd")
            time.sleep(0.05)
        while True:
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"container is {state!r}: {self.console_text()[-3000:]}")
            time.sleep(0.1)

    def console_text(self) -> str:
        return self.console.read_text(errors="replace")

    def run(
        self, *cmd: str, check: bool = True, user: int | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """A command inside the container, as root or as uid `user` (with its runtime dir)."""
        prefix = ["nsenter", "-t", str(self.leader), "-a"]
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "SYSTEMD_COLORS": "0"}
        if user is not None:
            prefix += [
                "setpriv",
                f"--reuid={user}",
                f"--regid={user}",
                "--init-groups",
                "env",
                f"XDG_RUNTIME_DIR=/run/user/{user}",
            ]
        return subprocess.run(
            [*prefix, *cmd], env=env, text=True, capture_output=True, check=check, timeout=timeout
        )

    def show(self, unit: str, *props: str, user: int | None = None) -> dict[str, str]:
        scope = ("--user",) if user is not None else ()
        out = self.run(
            "systemctl", *scope, "show", unit, *(f"--property={p}" for p in props), user=user
        ).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(
        self, unit: str, prop: str, value: str, *, user: int | None = None, timeout: float = 30
    ) -> None:
        deadline = time.monotonic() + timeout
        seen = ""
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.CalledProcessError):
                seen = self.show(unit, prop, user=user).get(prop, "")
                if seen == value:
                    return
            time.sleep(0.1)
        journal = self.run("journalctl", "--no-pager", "-n", "80", check=False).stdout
        raise AssertionError(f"{unit}: {prop}={seen!r}, wanted {value!r}\n{journal}")

    def poweroff(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.run("systemctl", "poweroff", "--no-block", check=False)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _kill_and_remove_children(self.cgroup)

    def reboot(self) -> None:
        self.poweroff()
        self.boot()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.poweroff(timeout=15)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for root in CGROUP_ROOTS:
            _kill_and_remove(Path(root) / self.cgroup)
        shutil.rmtree(self.base, ignore_errors=True)


def _kill_and_remove_children(cgroup: str) -> None:
    """Leave the test's own cgroup, empty, for the next boot."""
    for root in CGROUP_ROOTS:
        top = Path(root) / cgroup
        for child in [p for p in top.iterdir() if p.is_dir()] if top.exists() else []:
            _kill_and_remove(child)


def _child_named(parent: int, comm: str) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and name == comm:
            return int(entry)
    return 0
