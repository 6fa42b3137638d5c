"""A real `systemd --user` manager for tests, on a host whose PID 1 is not systemd.

The manager refuses to start without /run/systemd/system/, which must never
appear on the host (apt's scripts would think systemd runs), so it gets a
private mount namespace with an empty directory bound over /run/systemd. It
also gets its own cgroup in both hierarchies of this hybrid host, so its
units have real cgroups the guard can attribute processes to. Everything it
started is killed and its cgroups removed on exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lab.accounts import User

SYSTEMD = next(
    (p for p in ("/lib/systemd/systemd", "/usr/lib/systemd/systemd") if os.path.exists(p)),
    "/lib/systemd/systemd",
)
JOURNALD = next(
    (
        p
        for p in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald")
        if os.path.exists(p)
    ),
    "/lib/systemd/systemd-journald",
)
CGROUP_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")
# The files Delegate= hands to a user along with their cgroup directory (cgroup v2 and v1).
_DELEGATED = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads", "tasks")


def poll(done: Callable[[], bool], timeout: float, step: float = 0.25) -> tuple[bool, float]:
    """Until done() or the deadline, looking every `step` seconds; (done, seconds waited).
    A test waits for the state it needs this way, never for a fixed time."""
    began = time.monotonic()
    while True:
        if done():
            return True, time.monotonic() - began
        if time.monotonic() - began > timeout:
            return False, time.monotonic() - began
        time.sleep(step)


class UserManager:
    """Start with `with UserManager() as um:`; um.systemctl(...) runs inside its namespace."""

    def __init__(
        self,
        uid_dir: str = "0",
        user_runtime: Path | None = None,
        *,
        journald: bool = False,
        user: User | None = None,
        setuid_helpers: bool = False,
    ) -> None:
        # user: the manager runs as that real unprivileged account (tests/users.py), with
        # its passwd home, its own runtime dir and a cgroup delegated to it, named as
        # PID 1 names it (user@UID.service), the way logind and user@.service set it up.
        self.user = user
        # setuid_helpers: her units may run setuid programs (newuidmap, for her rootless
        # Podman's subuids), as a real user@.service's can; else no capability is in reach.
        self.setuid_helpers = setuid_helpers
        if user is not None:
            uid_dir = str(user.uid)
        self.base = Path(tempfile.mkdtemp(prefix="sg-um."))
        os.chmod(self.base, 0o755)
        # journald=True: a systemd-journald of its own in the namespace, units log to it,
        # its files land in self.journal_dir, and records written to the FIFO self.kmsg
        # reach it as kernel messages (it is bound over /dev/kmsg in there).
        self.journald = journald
        self.journal_dir = self.base / "log" / "journal"
        self.kmsg = self.base / "kmsg"
        self.home = user.home if user is not None else self.base / "home"
        # Managers sharing one runtime root look like several users' managers.
        self.user_runtime = user_runtime or self.base / "run-user"
        self.runtime = self.user_runtime / uid_dir
        self.unit_dir = self.home / ".config" / "systemd" / "user"
        self.data_unit_dir = self.home / ".local" / "share" / "systemd" / "user"
        self.log = self.base / "manager.log"
        self.cgroup = f"sg-test-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
        if journald or user is not None:
            # Named as a real user manager's, so journald tags lines with their unit
            # (_SYSTEMD_USER_UNIT), as it does on a real machine.
            self.cgroup += f".slice/user@{uid_dir}.service"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.runtime / "systemd" / "private"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HOME=str(self.home),
            XDG_RUNTIME_DIR=str(self.runtime),
            XDG_CONFIG_HOME=str(self.home / ".config"),
        )
        env.pop("NOTIFY_SOCKET", None)
        return env

    def __enter__(self) -> UserManager:
        for d in (self.unit_dir, self.data_unit_dir, self.base / "runsd" / "system"):
            d.mkdir(parents=True, exist_ok=True)
        self.user_runtime.mkdir(parents=True, exist_ok=True, mode=0o755)
        self.runtime.mkdir(mode=0o700)
        if not self.journald:
            # No journald here: units write to the manager's own stdout, our log file.
            (self.home / ".config" / "systemd" / "user.conf").write_text(
                "[Manager]\nDefaultStandardOutput=inherit\nDefaultStandardError=inherit\n"
            )
        for root in CGROUP_ROOTS:
            os.makedirs(f"{root}/{self.cgroup}")
        if self.user is not None:
            self._hand_over(self.user)
        moves = "; ".join(f"echo $$ > {r}/{self.cgroup}/cgroup.procs" for r in CGROUP_ROOTS)
        # A fresh /run in its namespace: the guard under test falls back to default
        # paths (/run/spark-guard, /run/motd.d) when a test hands it a broken config.
        inner = [
            "set -e",
            "mount -t tmpfs tmpfs /run",
            "mkdir /run/systemd",
            f"mount --bind {self.base}/runsd /run/systemd",
        ]
        if self.journald:
            self.journal_dir.mkdir(parents=True)
            os.mkfifo(self.kmsg)
            inner += [
                "mkdir /run/log",
                f"mount --bind {self.base}/log /run/log",
                # never the host's persistent journal
                "if [ -d /var/log/journal ]; then mount -t tmpfs tmpfs /var/log/journal; fi",
                f"mount --bind {self.kmsg} /dev/kmsg",
                # journald opens /dev/kmsg for writing first: a FIFO needs a reader for that
                "exec 3<>/dev/kmsg",
                f"{JOURNALD} &",
                "for i in $(seq 200); do [ -S /run/systemd/journal/stdout ] && break; "
                "sleep 0.05; done",
                "exec 3>&-",
            ]
            # As user@.service runs it: its own messages go to the journal.
            inner.append("export SYSTEMD_LOG_TARGET=journal")
        drop = ""
        if self.user is not None:
            u = self.user
            bounding = "" if self.setuid_helpers else "--bounding-set=-all "
            drop = (
                f"setpriv --reuid={u.uid} --regid={u.gid} --clear-groups --inh-caps=-all {bounding}"
            )
        inner.append(f"exec {drop}{SYSTEMD} --user")
        (self.base / "start.sh").write_text("\n".join(inner) + "\n")
        script = f"{moves}; exec unshare --mount --propagation private sh {self.base}/start.sh"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["sh", "-c", script],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 15
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = self.log.read_text()[-2000:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"systemd --user did not start: {said}")
            time.sleep(0.02)
        return self

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.proc is not None
        # systemctl finds /run/systemd/system only inside the manager's namespace; a
        # user's manager answers only that user (root gets "Operation not permitted").
        drop = []
        if self.user is not None:
            u = self.user
            drop = ["setpriv", f"--reuid={u.uid}", f"--regid={u.gid}", "--clear-groups"]
        cmd = ["nsenter", "-t", str(self.proc.pid), "-m", *drop, "systemctl", "--user", *args]
        return subprocess.run(
            cmd, env=self.env, text=True, capture_output=True, check=check, timeout=60
        )

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, unit: str, prop: str, value: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        seen = ""
        while time.monotonic() < deadline:
            seen = self.show(unit, prop).get(prop, "")
            if seen == value:
                return seen
            time.sleep(0.05)
        raise AssertionError(
            f"{unit}: {prop}={seen!r}, wanted {value!r}; log:\n{self.log.read_text()[-3000:]}"
        )

    def write_unit(self, name: str, text: str, data_dir: bool = False) -> Path:
        path = (self.data_unit_dir if data_dir else self.unit_dir) / name
        path.write_text(text)
        if self.user is not None:
            os.chown(path, self.user.uid, self.user.gid)
        self.systemctl("daemon-reload")
        return path

    def _hand_over(self, user: User) -> None:
        """What logind and PID 1 give a user: their runtime dir, their config, and the
        delegated cgroup their manager needs to make cgroups for its units."""
        for top in (self.home / ".config", self.home / ".local", self.runtime):
            for d, _dirs, files in os.walk(top):
                for p in [d, *(os.path.join(d, f) for f in files)]:
                    os.chown(p, user.uid, user.gid)
        for root in CGROUP_ROOTS:
            cg = Path(root) / self.cgroup
            for path in [cg, *(cg / name for name in _DELEGATED)]:
                with contextlib.suppress(FileNotFoundError):
                    os.chown(path, user.uid, user.gid)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for root in CGROUP_ROOTS:
            _kill_and_remove(Path(root) / self.cgroup)
            if self.journald or self.user is not None:
                with contextlib.suppress(OSError):
                    (Path(root) / self.cgroup).parent.rmdir()
        shutil.rmtree(self.runtime, ignore_errors=True)
        shutil.rmtree(self.base, ignore_errors=True)


def _kill_and_remove(cg: Path) -> None:
    if not cg.exists():
        return
    for _ in range(50):
        pids = []
        for procs in cg.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in procs.read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for d in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        cg.rmdir()


def file_tree(*roots: Path) -> dict[str, tuple[object, ...]]:
    """Every file, link and directory at or under roots: type, content or target, owner, mode.

    Two equal trees are byte for byte the same: what `release` must leave behind.
    """
    out: dict[str, tuple[object, ...]] = {}
    for root in roots:
        entries = (
            [root]
            if root.is_file()
            else [Path(d) / n for d, ds, fs in os.walk(root) for n in ds + fs]
        )
        for p in entries:
            st = p.lstat()
            if p.is_symlink():
                what: object = ("link", os.readlink(p))
            elif p.is_dir():
                what = ("dir",)
            else:
                what = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            out[str(p)] = (what, st.st_uid, st.st_gid, st.st_mode)
    return out
