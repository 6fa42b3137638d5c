"""A Debian 12 VM under qemu's software emulation (TCG): the one layer where MemAvailable is real.

The base root filesystem (kernel, initramfs, openssh-server, the guard's
Python dependencies) is built once with mmdebstrap and cached under
/var/tmp; each VM copies it, installs the .deb and whatever the caller lays
out, and becomes a raw ext4 disk with `mkfs.ext4 -d` (no loop device, no
mount). KVM is not used: a guest kernel hangs early with it on these
machines. sshd is forwarded to 127.0.0.1 only. Every process it started is
killed and every file removed on exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CACHE = Path("/var/tmp/spark-guard-tests")
PACKAGES = (
    "linux-image-amd64",
    "initramfs-tools",
    "systemd",
    "systemd-sysv",
    "libpam-systemd",
    "dbus",
    "openssh-server",
    "ifupdown",
    "isc-dhcp-client",
    "procps",
    "python3",
    "python3-pystemd",
    "python3-systemd",
    "python3-sdnotify",
    "python3-structlog",
    # the comparison runs (benchmarks/boot_wedge.py): installed, enabled per run
    "earlyoom",
    "systemd-oomd",
    # loader containers at boot (lab/containers_vm.py): installed, disabled (CUSTOMIZE)
    "docker.io",
)
# Run in the finished tree by mmdebstrap ("$1" is its root). docker.io's maintainer scripts
# enable dockerd: no VM gets one at boot unless it asks (VM.enable_docker).
DOCKER_UNITS = ("docker.service", "docker.socket", "containerd.service")
CUSTOMIZE = (f'chroot "$1" systemctl disable --quiet {" ".join(DOCKER_UNITS)}',)
INTERFACES = "auto lo\niface lo inet loopback\nauto eth0\niface eth0 inet dhcp\n"


def base_rootfs() -> Path:
    """The cached base tree (about 100 s to build, 780 MB)."""
    key = hashlib.sha256("\n".join((" ".join(PACKAGES), *CUSTOMIZE)).encode()).hexdigest()[:12]
    image = CACHE / f"vm-bookworm-{key}"
    if (image / "etc" / "os-release").exists():
        return image
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{image.name}.", dir=CACHE))
    try:
        subprocess.run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                *(f"--customize-hook={hook}" for hook in CUSTOMIZE),
                "bookworm",
                str(partial),
            ],
            check=True,
            capture_output=True,
            timeout=1200,
        )
        partial.rename(image)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return image


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VM:
    """`with VM() as vm:` lay files out under vm.root, vm.install(deb), vm.boot(), vm.ssh(...)."""

    def __init__(self, memory_mib: int = 2048) -> None:
        self.memory_mib = memory_mib
        self.base = Path(tempfile.mkdtemp(prefix="sg-vm.", dir="/var/tmp"))
        self.root = self.base / "root"
        self.disk = self.base / "disk.img"
        self.key = self.base / "key"
        self.console = self.base / "console.log"
        self.probe_log = self.base / "probe.log"  # the guest's /dev/ttyS1
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def __enter__(self) -> VM:
        subprocess.run(
            ["cp", "-a", "--reflink=auto", str(base_rootfs()), str(self.root)], check=True
        )
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True
        )
        ssh_dir = self.root / "root" / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        shutil.copy(f"{self.key}.pub", ssh_dir / "authorized_keys")
        (self.root / "etc" / "hostname").write_text("sg-vm\n")
        (self.root / "etc" / "network" / "interfaces").write_text(INTERFACES)
        (self.root / "etc" / "fstab").write_text("/dev/vda / ext4 rw 0 1\n")
        return self

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def chroot(self, *argv: str) -> None:
        """Run a command of the guest's tree on it (useradd and the like), before boot."""
        subprocess.run(["chroot", str(self.root), *argv], check=True, capture_output=True)

    def enable_docker(self) -> None:
        """dockerd (and its containerd) at boot, as docker.io's install would have it."""
        self.chroot("systemctl", "enable", "--quiet", *DOCKER_UNITS)

    def install(self, deb: Path) -> None:
        """dpkg into the tree: its maintainer scripts run chrooted, systemd is not running."""
        subprocess.run(
            ["dpkg", "--root", str(self.root), "-i", str(deb)],
            check=True,
            capture_output=True,
            timeout=300,
        )

    def boot(self, *, snapshot: bool = True, timeout: float = 300) -> float:
        """Boot; returns the seconds it took until sshd let us in."""
        self.start(snapshot=snapshot)
        return self.wait_for_ssh(timeout)

    def start(self, *, snapshot: bool = True) -> None:
        """Start qemu and return at once; snapshot=False keeps what the guest writes."""
        if not self.disk.exists():
            subprocess.run(
                ["mkfs.ext4", "-q", "-F", "-d", str(self.root), "-L", "root", str(self.disk), "3G"],
                check=True,
            )
        kernel = next(self.root.glob("boot/vmlinuz-*"))
        initrd = next(self.root.glob("boot/initrd.img-*"))
        drive = f"file={self.disk},format=raw,if=virtio" + (",snapshot=on" if snapshot else "")
        argv = [
            "qemu-system-x86_64",
            "-m",
            str(self.memory_mib),
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
            "-display",
            "none",
            "-monitor",
            "none",
            "-kernel",
            str(kernel),
            "-initrd",
            str(initrd),
            "-append",
            "root=/dev/vda rw console=ttyS0 net.ifnames=0 quiet",
            "-drive",
            drive,
            "-netdev",
            f"user,id=n0,hostfwd=tcp:127.0.0.1:{self.port}-:22",
            "-device",
            "virtio-net-pci,netdev=n0",
            "-serial",
            f"file:{self.console}",
            "-serial",
            f"file:{self.probe_log}",
        ]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def wait_for_ssh(self, timeout: float = 300) -> float:
        """Seconds from start() until sshd let us in."""
        assert self.proc is not None, "start() first"
        start = self.started
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qemu exited: {self.console_text()[-2000:]}")
            with contextlib.suppress(subprocess.TimeoutExpired):  # a slow sshd, still booting
                if self.ssh("true", check=False, timeout=10).returncode == 0:
                    return time.monotonic() - start
            time.sleep(2)
        raise RuntimeError(f"no ssh after {timeout:g}s: {self.console_text()[-2000:]}")

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    def ssh(
        self, command: str, *, check: bool = True, timeout: float = 60, connect: int = 5
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "ssh",
                "-q",
                "-o",
                "BatchMode=yes",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                f"ConnectTimeout={connect}",
                "-i",
                str(self.key),
                "-p",
                str(self.port),
                "root@127.0.0.1",
                command,
            ],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def poweroff(self, timeout: float = 180) -> bool:
        """Shut the guest down; True when it did so itself (False: qemu had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            # sync first: a guest that takes too long to stop must not lose what it wrote
            self.ssh("sync; systemctl poweroff", check=False, timeout=30)
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.poweroff(timeout=20)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)
