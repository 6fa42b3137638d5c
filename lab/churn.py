"""User managers that appear and vanish, and loaders that start and stop, around a guard.

For the guard's own budget (tests/test_budget.py, benchmarks/guard_budget.py).
A real `systemd --user` per appearance costs a second or more with its
account; here each "user" is one small process (lab/fake_manager.py's
D-Bus peer) that the guard believes, because it is what the guard checks:
it runs as that uid, in `<...>/user@UID.service/init.scope` of both cgroup
hierarchies, on `<user_runtime>/UID/systemd/private`, and its ControlGroup
is that cgroup (the harness has no PID 1 to ask, as on a machine with
systemd as PID 1 only root's word would be missing). Its socket appears and
vanishes on command ("up"/"down" on its stdin): each time, the guard
connects (peer check, /proc, two property reads), watches it (ListJobs,
ListUnitsByNames each pass), then finds it gone and drops it. That is the
path where a socket, a bus object or a cached unit would leak.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from lab import LAB
from lab.harness import CGROUP_ROOTS, UserManager, _kill_and_remove

SERVER = r"""
import os, socket, sys, threading, time
sys.path.insert(0, sys.argv[1])
from fake_manager import Fake, serve_quietly

path, cgroup = sys.argv[2], sys.argv[3]
pace = {"slow": float(sys.argv[4])}  # ("slow N" on stdin changes it)


class Manager(Fake):
    def answer(self, member, body):
        if member in ("ListJobs", "ListUnitsByNames"):
            time.sleep(pace["slow"])  # each of a pass's questions answered this late
        if member == "ListJobs" and pace["slow"]:  # a start job: its state is asked too
            objects = "/org/freedesktop/systemd1/"
            unit = objects + "unit/wait_2dhere_2eservice"
            job = (1, "wait-here.service", "start", "waiting", objects + "job/1", unit)
            return "a(usssoo)", [[job]]
        if member == "Get" and body[1] == "UnitPath":
            return "v", [("as", [os.path.dirname(path) + "/user.control"])]
        if member == "StopUnit":  # taken, and nothing stops (an ExecStop= that hangs)
            return "o", ["/org/freedesktop/systemd1/job/77"]
        if member == "GetUnitFileLinks":
            return "as", [[]]
        return super().answer(member, body)


class NoLog(list):
    def append(self, item):  # nothing kept per call: the server runs long
        pass


fake = Manager(cgroup, "", [])
fake.calls = NoLog()
srv = None
conns = []


def accept(s):
    while True:
        try:
            c, _ = s.accept()
        except OSError:
            return
        conns.append(c)
        threading.Thread(target=serve_quietly, args=(fake, c), daemon=True).start()


sys.stdout = open(os.devnull, "w")  # Fake.serve prints each call
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "up" and srv is None:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(16)
        threading.Thread(target=accept, args=(srv,), daemon=True).start()
    elif cmd.startswith("slow "):
        pace["slow"] = float(cmd.split()[1])
    elif cmd == "down" and srv is not None:
        os.unlink(path)
        srv.shutdown(socket.SHUT_RDWR)
        srv.close()
        srv = None
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        conns.clear()
    sys.__stdout__.write("ok\n")
    sys.__stdout__.flush()
"""


class FakeUser:
    """One uid's manager socket that comes and goes, believed by the guard; `slow`: the
    seconds it takes to answer each of a pass's questions (ListJobs, ListUnitsByNames),
    with a start job waiting (so a pass asks both)."""

    def __init__(self, um: UserManager, uid: int, cgroup: str, slow: float = 0.0) -> None:
        self.uid = uid
        self.key = f"user:{uid}"
        runtime = um.user_runtime / str(uid)
        (runtime / "systemd").mkdir(parents=True)
        for d in (runtime, runtime / "systemd"):
            os.chown(d, uid, uid)
        os.chmod(runtime, 0o700)
        self.cgroup = f"/{cgroup}/user@{uid}.service"
        for root in CGROUP_ROOTS:
            os.makedirs(f"{root}{self.cgroup}/init.scope")
        moves = "; ".join(
            f"echo $$ > {r}{self.cgroup}/init.scope/cgroup.procs" for r in CGROUP_ROOTS
        )
        sock = runtime / "systemd" / "private"
        self.proc = subprocess.Popen(
            [
                "sh",
                "-c",
                f'{moves}; exec setpriv --reuid={uid} --regid={uid} --clear-groups "$@"',
                "sh",
                sys.executable,
                "-c",
                SERVER,
                str(LAB),
                str(sock),
                self.cgroup,
                str(slow),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def slow(self, seconds: float) -> None:
        """From now on, each of a pass's questions answered after `seconds`."""
        self.send(f"slow {seconds:g}")

    def run_in(self, unit: str, *argv: str) -> subprocess.Popen[bytes]:
        """`argv` run as this uid in a cgroup of a unit of hers (app.slice/UNIT): what
        her manager would have started (gone with Churn.close, which kills the slice)."""
        where = f"{self.cgroup}/app.slice/{unit}"
        for root in CGROUP_ROOTS:
            os.makedirs(f"{root}{where}", exist_ok=True)
        moves = "; ".join(f"echo $$ > {r}{where}/cgroup.procs" for r in CGROUP_ROOTS)
        become = f"exec setpriv --reuid={self.uid} --regid={self.uid} --clear-groups"
        return subprocess.Popen(
            ["sh", "-c", f'{moves}; {become} "$@"', "sh", *argv], stdout=subprocess.DEVNULL
        )

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "ok\n"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Churn:
    """`users` fake managers and `loaders` loader units on `um`, cycled together."""

    def __init__(
        self, um: UserManager, users: int, loaders: int, first_uid: int = 61000, slow: float = 0.0
    ) -> None:
        self.um = um
        self.cgroup = f"sg-churn-{os.getpid()}.slice"
        self.users = [FakeUser(um, first_uid + i, self.cgroup, slow) for i in range(users)]
        self.loaders = [f"churn-loader-{i}.service" for i in range(loaders)]
        for name in self.loaders:
            # A loader by its command line; it holds little, so nothing is blocked.
            um.write_unit(
                name,
                f"[Service]\nExecStart={sys.executable} {LAB}/fake_loader.py "
                f"-m {um.base}/models/churn.gguf --alloc 8 --rate 0\n",
            )
        (um.base / "models" / "churn.gguf").write_bytes(b"GGUF" + b"\0" * 4096)
        self.cycles = 0

    def _wait_log(self, pattern: str, count: int, offset: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            text = self.um.log.read_text(errors="replace")[offset:]
            if len(re.findall(pattern, text, re.MULTILINE)) >= count:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} x {pattern!r} not seen:\n{text[-3000:]}")
            time.sleep(0.05)

    def up(self, said: str = "manager-connected: watching user:{uid} manager") -> None:
        """Every user's manager appears; returns once the guard has said `said` of each
        ({uid}: that user's)."""
        offset = len(self.um.log.read_text(errors="replace"))
        for u in self.users:
            u.send("up")
        for u in self.users:
            self._wait_log("^info " + said.format(uid=u.uid), 1, offset)

    def cycle(self) -> None:
        """Every user's manager appears and is watched, loaders start; all vanish and stop."""
        um = self.um
        offset = len(um.log.read_text(errors="replace"))
        for u in self.users:
            u.send("up")
        if self.loaders:
            um.systemctl("start", *self.loaders)
        n = len(self.users)
        self._wait_log(r"^info manager-connected: watching user:6\d+ manager", n, offset)
        time.sleep(0.5)  # a few passes (poll.strict) with the loaders running
        offset = len(um.log.read_text(errors="replace"))
        for u in self.users:
            u.send("down")
        if self.loaders:
            um.systemctl("stop", *self.loaders)
        self._wait_log(r"^info manager-lost: user:6\d+ manager", n, offset)
        self.cycles += 1

    def close(self) -> None:
        for u in self.users:
            u.close()
        for root in CGROUP_ROOTS:
            _kill_and_remove(Path(root) / self.cgroup)


def guard_figures(pid: int) -> dict[str, int]:
    """RSS (kB) and the guard's open fds by kind: sockets, pidfds, PSI, the rest; threads."""
    status = Path(f"/proc/{pid}/status").read_text()
    out = {"rss_kb": int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))}  # type: ignore[union-attr]
    out["threads"] = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    kinds = {"fds": 0, "sockets": 0, "pidfds": 0, "psi": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kinds["fds"] += 1
            if target.startswith("socket:"):
                kinds["sockets"] += 1
            elif target == "anon_inode:[pidfd]":
                kinds["pidfds"] += 1
            elif target.endswith("/pressure/memory"):
                kinds["psi"] += 1
    return out | kinds
