"""A private dockerd for tests: its own socket, data and state under a temporary directory.

Debian's docker.io (20.10) runs here with no network set up (`--bridge=none`, no
iptables), the vfs storage driver (no overlay mounts to leave behind) and the
cgroupfs driver (the host's PID 1 is not systemd): a container's cgroup is
`/docker/<id>`. dockerd starts its own containerd. The host's /run/docker.sock
is never used or touched.

The image is the Debian 12 rootfs the nspawn tests build (lab.nspawn.rootfs),
imported with `docker import` (no registry) once per DockerD, without what python3
and sh do not need (docs, locales, perl, ICU: 290 -> about 120 MB), and tagged as the
tests need (`vllm/vllm-openai:test`).
The `docker` CLI is used here, in the lab only: the guard never forks it.

    with DockerD() as d:
        d.docker("run", "-d", ...)
        d.restart()

On exit every container is removed, dockerd (and its containerd, and their
shims) stopped, anything left under the directory unmounted and the directory
removed.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lab import nspawn
from lab.harness import UserManager
from spark_guard.system.engine import Engine, EngineError

# A loader as the test loaders are: it takes its memory (64 MiB, touched) and holds it. PID 1
# in its namespace: SIGTERM ends it only with a handler (LOADER); FIGHTS ignores it.
_LOADER = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, {handler})\n"
    "held = b'x' * (64 << 20)\n"
    "time.sleep(3600)\n"
)
LOADER = _LOADER.format(handler="lambda *a: sys.exit(0)")
FIGHTS = _LOADER.format(handler="signal.SIG_IGN")

DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
# Debian's docker.io CLI, not whatever else is first on PATH.
DOCKER = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else shutil.which("docker") or ""
IMAGE = "sg-base:test"
# Left out of the image (python3 and sh run without them): vfs copies the whole image for
# each container, so its size is most of a container's start.
_EXCLUDE = (
    "./usr/share",
    "./usr/lib/locale",
    "./usr/lib/systemd",
    "./usr/lib/x86_64-linux-gnu/perl",
    "./usr/lib/x86_64-linux-gnu/perl-base",
    "./usr/lib/x86_64-linux-gnu/libperl*",
    "./usr/lib/x86_64-linux-gnu/gconv",
    "./usr/lib/x86_64-linux-gnu/libicu*",
    "./usr/lib/x86_64-linux-gnu/systemd",
    "./usr/lib/aarch64-linux-gnu/perl",
    "./usr/lib/aarch64-linux-gnu/libicu*",
    "./var/cache",
    "./var/lib",
)


def available() -> str | None:
    """Why a dockerd cannot be run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if not os.path.exists(DOCKERD) or not DOCKER:
        return "dockerd/docker not installed (apt-get install docker.io)"
    return None


class DockerD:
    def __init__(self) -> None:
        # Short: the socket's path must fit sun_path (108 bytes).
        self.base = Path(tempfile.mkdtemp(prefix="sg-dk.", dir="/var/tmp"))
        self.socket = str(self.base / "docker.sock")
        self.log = self.base / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def engine(self, timeout: float = 5.0) -> Engine:
        return Engine(self.socket, timeout=timeout)

    def __enter__(self) -> DockerD:
        try:
            self.start()
            self._import()
        except BaseException:
            self.__exit__()
            raise
        return self

    def start(self, timeout: float = 30) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    DOCKERD,
                    "--bridge=none",
                    "--iptables=false",
                    "--ip6tables=false",
                    "--storage-driver=vfs",
                    "--exec-opt=native.cgroupdriver=cgroupfs",
                    "--shutdown-timeout=2",
                    f"--data-root={self.base}/data",
                    f"--exec-root={self.base}/exec",
                    f"--pidfile={self.base}/dockerd.pid",
                    f"--host=unix://{self.socket}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.engine(1.0).version()
                return
            except EngineError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"dockerd did not start:\n{self.tail()}") from None
                time.sleep(0.1)

    def stop(self, timeout: float = 30) -> None:
        """dockerd ends as it does at shutdown (SIGTERM): it stops running containers and its
        containerd."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        self._wait_for_children(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def docker(self, *args: str, stdin: bytes | None = None, timeout: float = 60) -> str:
        out = subprocess.run(
            [DOCKER, "-H", f"unix://{self.socket}", *args],
            input=stdin,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise subprocess.CalledProcessError(
                out.returncode, ["docker", *args], out.stdout, out.stderr
            )
        return out.stdout.decode().strip()

    def docker_fails(self, *args: str) -> str:
        """The error text of a docker command that must fail (AssertionError if it works)."""
        try:
            self.docker(*args)
        except subprocess.CalledProcessError as e:
            return (e.stderr or b"").decode(errors="replace")
        raise AssertionError(f"docker {' '.join(args)} worked")

    def _import(self) -> None:
        root = nspawn.rootfs("bookworm")
        excludes = [f"--exclude={p}" for p in _EXCLUDE]
        tar = subprocess.run(
            ["tar", "-C", str(root), *excludes, "-c", "."], capture_output=True, check=True
        )
        self.docker("import", "-", IMAGE, stdin=tar.stdout, timeout=120)

    def tag(self, name: str) -> str:
        self.docker("tag", IMAGE, name)
        return name

    def _ours(self) -> list[int]:
        """Processes whose command line names this dockerd's directory (its containerd and
        shims), by pid."""
        mine = str(self.base).encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                if mine in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
        return found

    def _wait_for_children(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._ours() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self._ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _mounts(self) -> list[str]:
        prefix = str(self.base)
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        return [p for p in points if p == prefix or p.startswith(prefix + "/")]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                ids = self.docker("ps", "-aq", timeout=30).split()
                if ids:
                    self.docker("rm", "-f", *ids, timeout=60)
        self.stop()
        for point in reversed(self._mounts()):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)


PODMAN = shutil.which("podman") or "/usr/bin/podman"


def _wait_answering(
    engine: Callable[[float], Engine], gone: Callable[[], bool], why: Callable[[], str]
) -> None:
    """Until the engine's API answers (30 s at most); RuntimeError with `why()` if it never
    does, or once `gone()` says its server has exited."""
    deadline = time.monotonic() + 30
    while True:
        try:
            engine(1.0).version()
            return
        except EngineError:
            if gone() or time.monotonic() > deadline:
                raise RuntimeError(f"the Podman API did not answer: {why()}") from None
            time.sleep(0.1)


class PodmanService:
    """A private Podman API service (`podman system service`) on its own socket, with its
    own storage and the same imported image, for what Podman's compat API does (Debian's
    podman 4.3). `podman` here is the CLI, in the lab only."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="sg-pm.", dir="/var/tmp"))
        self.socket = str(self.base / "podman.sock")
        self.conf = self.base / "containers.conf"
        # The sandbox's hard rlimits are under Podman's defaults, which runc then fails to set.
        self.conf.write_text("[containers]\ndefault_ulimits = []\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def engine(self, timeout: float = 5.0) -> Engine:
        return Engine(self.socket, timeout=timeout)

    def podman(self, *args: str, stdin: bytes | None = None, timeout: float = 60) -> str:
        argv = [PODMAN, *self._globals(), *args]
        env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}
        done = subprocess.run(
            argv, input=stdin, capture_output=True, check=True, timeout=timeout, env=env
        )
        return done.stdout.decode().strip()

    def __enter__(self) -> PodmanService:
        try:
            root = nspawn.rootfs("bookworm")
            excludes = [f"--exclude={p}" for p in _EXCLUDE]
            tar = subprocess.run(
                ["tar", "-C", str(root), *excludes, "-c", "."], capture_output=True, check=True
            )
            self.podman("import", "-", IMAGE, stdin=tar.stdout, timeout=120)
            env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}
            argv = [PODMAN, *self._globals(), "system", "service", "--time=0"]
            self.proc = subprocess.Popen(
                [*argv, f"unix://{self.socket}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
            proc = self.proc
            _wait_answering(self.engine, lambda: proc.poll() is not None, lambda: "did not start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _globals(self) -> list[str]:
        return [
            f"--root={self.base}/root",
            f"--runroot={self.base}/run",
            f"--tmpdir={self.base}/tmp",
            "--storage-driver=vfs",
            "--cgroup-manager=cgroupfs",
            "--events-backend=file",
        ]

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.podman("rm", "-af", "-t", "0", timeout=60)
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.podman("system", "reset", "-f", timeout=60)
        prefix = str(self.base)
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        for point in reversed([p for p in points if p.startswith(prefix)]):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)


# A loader of a user's rootless container: `llama-server` by name, holding no memory to
# speak of (what counts here is whose engine it is); SIGTERM ends it. In a tiny image of
# sh, sleep and libc: vfs copies an image for each container, and hers is built as her.
TINY_IMAGE = "sg-tiny:test"
TINY_LOADER = "/usr/local/bin/llama-server"
TINY_FIGHTER = "/usr/local/sbin/llama-server"  # ignores SIGTERM: a stop waits its timeout
_TINY_SCRIPTS = {
    TINY_LOADER: b"#!/bin/sh\ntrap 'exit 0' TERM\nsleep 3600 &\nwait\n",
    TINY_FIGHTER: b"#!/bin/sh\ntrap '' TERM\nsleep 3600 &\nwait\n",
}


def tiny_image_tar() -> bytes:
    """A tar of /bin/sh, /bin/sleep, the libraries they link, TINY_LOADER and TINY_FIGHTER."""
    files = ["/bin/sh", "/bin/sleep"]
    for binary in ("/bin/sh", "/bin/sleep"):
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        files += [w for line in out.splitlines() for w in line.split() if w.startswith("/")]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in dict.fromkeys(files):
            tar.add(os.path.realpath(path), arcname=path.lstrip("/"))
        for name, script in _TINY_SCRIPTS.items():
            info = tarfile.TarInfo(name.lstrip("/"))
            info.size, info.mode = len(script), 0o755
            tar.addfile(info, io.BytesIO(script))
    return buf.getvalue()


class RootlessPodman:
    """A user's own Podman API service, as Debian's podman.socket gives her one: a unit of
    her manager (`podman system service` on $XDG_RUNTIME_DIR/podman/podman.sock, her uid,
    her subuids through newuidmap), her storage in her home, and the tiny image, made
    through her socket (`podman --remote`) as her. `um` must run setuid helpers."""

    UNIT = "podman-api.service"

    def __init__(self, um: UserManager) -> None:
        assert um.user is not None and um.setuid_helpers
        self.um = um
        self.user = um.user
        self.socket = um.runtime / "podman" / "podman.sock"

    def engine(self, timeout: float = 5.0) -> Engine:
        return Engine(str(self.socket), timeout=timeout, user_runtime=str(self.um.user_runtime))

    def podman(self, *args: str, stdin: bytes | None = None, timeout: float = 60) -> str:
        """Her podman CLI, on her socket, as her (the setuid helpers in reach, as in her
        shell)."""
        u = self.user
        argv = ["setpriv", f"--reuid={u.uid}", f"--regid={u.gid}", "--clear-groups"]
        argv += [PODMAN, "--remote", f"--url=unix://{self.socket}", *args]
        env = {
            "HOME": str(u.home),
            "XDG_RUNTIME_DIR": str(self.um.runtime),
            "PATH": "/usr/bin:/bin",
        }
        done = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, env=env)
        if done.returncode:
            raise RuntimeError(f"podman {' '.join(args)}: {done.stderr.decode()[-2000:]}")
        return done.stdout.decode().strip()

    def __enter__(self) -> RootlessPodman:
        conf = self.user.home / ".config" / "containers"
        conf.mkdir(parents=True, exist_ok=True)
        # The sandbox's hard rlimits are under Podman's defaults, which runc then fails to set.
        (conf / "containers.conf").write_text("[containers]\ndefault_ulimits = []\n")
        for d in (conf.parent, conf, conf / "containers.conf"):
            os.chown(d, self.user.uid, self.user.gid)
        # As Debian's podman.socket and podman.service: her manager listens, Podman serves.
        self.um.write_unit(
            self.UNIT.replace(".service", ".socket"),
            "[Socket]\nListenStream=%t/podman/podman.sock\nSocketMode=0660\n",
        )
        self.um.write_unit(
            self.UNIT,
            "[Service]\nExecStart=/usr/bin/podman --storage-driver=vfs --cgroup-manager=cgroupfs"
            " --events-backend=file system service --time=0\n",
        )
        try:
            self.um.systemctl("start", self.UNIT.replace(".service", ".socket"))
            _wait_answering(self.engine, lambda: False, lambda: self.um.log.read_text()[-2000:])
            self.podman("import", "-", TINY_IMAGE, stdin=tiny_image_tar(), timeout=120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # (Bounded: a test that put a fake engine at her socket leaves nothing to answer it,
        # and the service's kill below takes her containers with it.)
        with contextlib.suppress(RuntimeError, subprocess.SubprocessError, OSError):
            self.podman("rm", "-af", "-t", "0", timeout=10)
        # Podman's pause process (her user namespace's holder) outlives a SIGTERM of the
        # service: the unit is killed, not waited on for its stop timeout.
        self.um.systemctl(
            "stop", "--no-block", self.UNIT.replace(".service", ".socket"), check=False
        )
        self.um.systemctl("kill", "--signal=SIGKILL", self.UNIT, check=False)
        self.um.systemctl("stop", "--no-block", self.UNIT, check=False)
