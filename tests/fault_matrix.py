"""The fault matrix's runner: a block and a release with a fault at every point where the
guard touches the world. test_fault_matrix.py runs it and says what it found.

    unshare --mount --propagation private python -m tests.fault_matrix BASE   (as root)

BASE is a directory this mount namespace may mount on. Prints one JSON object per
case: {"pipeline", "fault", "at", "point", "problems"}; no problems is a pass.

The world is a unit manager in a dict (manager_double.FakeManager) with the
admin's unit file and enablement link as real files on a small tmpfs, "the
disk", which also holds the guard's state directory; the user's runtime
directory (where masks go) is a second tmpfs, as /run is. For a container the
loader is one container ("vllm", restart unless-stopped) of a fake dockerd API
on a unix socket (FakeEngine), served by a thread of the case's own process, so
that what it holds outlives a guard killed in a child, as dockerd does. The
guard is the project's own Blocker, release and engine client, unchanged.

The points are found, not listed: a clean run of each pipeline (block: the
daemon's passes until the unit is blocked; release: `spark-guard release`)
notes every call to the manager, every connection to the engine (named after
the run by what it asked) and every write the process makes to a file (an
audit hook: open for writing, mkdir, symlink, rename, unlink). Then for
each point, in a process of its own:

- full: the disk is filled (blocks and inodes) just before that point;
- read-only: the disk is remounted read-only just before it;
- kill: the process dies there (os._exit, no handler runs), and a new guard,
  with what the old one left on disk, takes over.

A few passes run under the fault; then it heals, the guard goes on until the
unit is blocked, and an admin's release undoes it. What must hold, said as a
problem when it does not:

- no exception leaves a pass (the guard is alive);
- after every pass, every change the guard made (a link gone, a mask laid, a
  restart policy set to no) is in the record on disk;
- the loader is not left running;
- the block completes once the fault is gone;
- after the release, the disk's and the runtime dir's files are byte for byte
  (content, link target, mode, owner) what they were before the block, the
  container's restart policy is its own and it runs, and no record is left in
  blocked/;
- a release a fault stops says why in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spark_guard import log
from spark_guard.block import release as release_mod
from spark_guard.block.blocker import Blocker
from spark_guard.block.records import RecordError, RecordStore
from spark_guard.core.block import Step
from spark_guard.core.config import Config
from spark_guard.core.snapshot import CONTAINER, Action, Decision, Phase, Reason, UnitRef
from spark_guard.system.engine import Engine
from spark_guard.system.unitfiles import mask_dir
from tests.manager_double import Clock, FakeManager, stop_decision

UID = os.geteuid()
KEY = f"user:{UID}"
UNIT = "llama.service"
REF = UnitRef(KEY, UNIT)
FAULTS = ("full", "read-only", "kill")
PIPELINES = ("block", "release", "container-block", "container-release")
BOX = UnitRef(CONTAINER, "vllm")
BOX_ID = "c0ffee" * 10 + "beef"  # 64 hex
BOX_POLICY = ("unless-stopped", 0)
PASSES_UNDER_FAULT = 4  # guard passes with the fault on before it heals
PASSES_TO_FINISH = 12  # passes allowed for the block to complete once it has healed
KILLED = 137

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
MS_RDONLY, MS_REMOUNT, MNT_DETACH = 1, 32, 2
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target}: {os.strerror(e)}")


class Disk:
    """A small tmpfs that can be filled, or made read-only, and healed."""

    OPTIONS = "size=1m,nr_inodes=96,mode=755"

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True)
        _mount("tmpfs", str(path), "tmpfs", 0, self.OPTIONS)
        self.filler = path / ".filler"
        self.filler.mkdir()

    def fill(self) -> None:
        """Every block and every inode taken: nothing can be written or made."""
        chunk = b"\0" * 65536
        try:
            with open(self.filler / "blocks", "wb") as f:
                while True:
                    f.write(chunk)
                    f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        n = 0
        while True:
            try:
                (self.filler / f"i{n}").touch()
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
            n += 1

    def read_only(self) -> None:
        _mount(None, str(self.path), None, MS_REMOUNT | MS_RDONLY, self.OPTIONS)

    def heal(self) -> None:
        _mount(None, str(self.path), None, MS_REMOUNT, self.OPTIONS)
        for f in self.filler.iterdir():
            f.unlink()

    def close(self) -> None:
        _libc.umount2(str(self.path).encode(), MNT_DETACH)


def files(*roots: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[Any, ...]]:
    """Every file, directory and link under `roots`, as what a byte-for-byte check compares."""
    out: dict[str, tuple[Any, ...]] = {}
    for root in roots:
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.join(dirpath, d) not in skip]
            for name in [*dirs, *names]:
                p = os.path.join(dirpath, name)
                if p in skip:
                    continue
                st = os.lstat(p)
                who = (oct(st.st_mode), st.st_uid, st.st_gid)
                if os.path.islink(p):
                    out[p] = ("link", os.readlink(p), *who)
                elif os.path.isdir(p):
                    out[p] = ("dir", *who)
                else:
                    out[p] = ("file", Path(p).read_bytes(), *who)
    return out


def differences(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> list[str]:
    out = [f"{p}: gone" for p in before if p not in after]
    out += [f"{p}: new ({after[p][0]})" for p in after if p not in before]
    changed = [p for p in before if before[p] != after.get(p, before[p])]
    out += [f"{p}: {before[p]} -> {after[p]}" for p in changed]
    return out


@dataclass
class Point:
    """A place where the guard touches the world: a manager call, or a write to a file."""

    kind: str  # "manager" or the audit event's name
    what: str

    def __str__(self) -> str:
        return f"{self.kind} {self.what}"


def _point(event: str, args: tuple[Any, ...]) -> Point | None:
    """The audit event as a point, if it writes; temporary names made stable."""

    def name(p: object) -> str:
        text = os.fsdecode(p) if isinstance(p, (str, bytes)) else str(p)
        return re.sub(r"\.[0-9a-f]{12}\.tmp$", ".TMP", os.path.basename(text))

    if event == "open" and isinstance(args[2], int) and args[2] & _WRITE:
        return Point("open", name(args[0]))
    if event in ("os.mkdir", "os.remove", "os.rmdir"):
        return Point(event, name(args[0]))
    if event in ("os.symlink", "os.rename"):
        return Point(event, f"{name(args[0])} {name(args[1])}")
    if event == "socket.connect" and str(args[1]).endswith("docker.sock"):
        return Point("engine", "call")  # named after the trace by what the engine was asked
    return None


class Tracer:
    """Notes the points as they come; calls `strike` at the chosen one (by index)."""

    def __init__(self) -> None:
        self.points: list[Point] = []
        self.on = False
        self.busy = False
        self.at: int | None = None
        self.strike: Callable[[], None] = lambda: None

    def hit(self, point: Point) -> None:
        if not self.on or self.busy:
            return
        self.busy = True
        try:
            if self.at == len(self.points):
                self.at = None
                self.strike()
            self.points.append(point)
        finally:
            self.busy = False

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.on and not self.busy:
            point = _point(event, args)
            if point is not None:
                self.hit(point)


TRACER = Tracer()


class TracedManager(FakeManager):
    """The manager double, its calls noted as points."""

    def _traced(self, call: str, name: str = "") -> None:
        TRACER.hit(Point("manager", f"{call} {name}".strip()))

    def stop_unit(self, name: str) -> str:
        self._traced("StopUnit", name)
        return super().stop_unit(name)

    def kill_unit(self, name: str, signal: int) -> None:
        self._traced("KillUnit", name)
        super().kill_unit(name, signal)

    def unit_file_links(self, name: str) -> list[str]:
        self._traced("GetUnitFileLinks", name)
        return super().unit_file_links(name)

    def disable_unit_files(self, name: str) -> list[str]:
        self._traced("DisableUnitFiles", name)
        return super().disable_unit_files(name)

    def reload(self) -> None:
        self._traced("Reload")
        super().reload()

    def snapshot(self) -> dict[str, Any]:
        return {"active": self.active, "load": self.load, "links": self.links}

    def restore(self, saved: dict[str, Any]) -> None:
        self.active, self.load, self.links = saved["active"], saved["load"], saved["links"]


class FakeEngine:
    """dockerd's API for one container ("vllm", restart unless-stopped, running), on a
    unix socket, served by a thread of the case's own process: what it holds outlives a
    guard killed in a child process, as dockerd outlives the guard. The guard's own
    engine client (system/engine.py) speaks to it unchanged."""

    def __init__(self, path: Path, threaded: bool = False) -> None:
        self.path = str(path)
        self.owner = os.getpid()  # the process whose thread serves it, and holds its state
        # Each request served by a thread of its own (threaded), and a stop held until
        # this is set (None: at once): an engine whose stop waits, asked meanwhile.
        self.threaded, self.stop_gate = threaded, None if not threaded else threading.Event()
        self.restart, self.retries = BOX_POLICY
        self._running = True
        self.requests: list[tuple[bool, str]] = []  # (traced, "METHOD /path")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def running(self) -> bool:
        return self.state[2]

    @running.setter
    def running(self, value: bool) -> None:
        assert os.getpid() == self.owner
        self._running = value

    @property
    def state(self) -> tuple[str, int, bool]:
        """(restart policy, retries, running): in a guard's child process, asked of the
        engine, since only the serving process holds it (not traced as a point)."""
        if os.getpid() == self.owner:
            return self.restart, self.retries, self._running
        was, TRACER.busy = TRACER.busy, True
        try:
            now = Engine(self.path, timeout=5.0).inspect(BOX_ID)
        finally:
            TRACER.busy = was
        return now.restart, now.max_retries, now.running

    def _inspect(self) -> dict[str, Any]:
        return {
            "Id": BOX_ID,
            "Name": "/vllm",
            "Path": "vllm",
            "Args": ["serve", "/models/big"],
            "Config": {"Image": "vllm/vllm-openai:test", "Labels": {}},
            "State": {"Running": self._running, "Status": "running" if self._running else "exited"},
            "HostConfig": {
                "RestartPolicy": {"Name": self.restart, "MaximumRetryCount": self.retries}
            },
        }

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, object]:
        path = path.split("?")[0]
        if path == "/version":
            return 200, {"Version": "24.0.7", "ApiVersion": "1.43"}
        parts = path.split("/")  # "", "containers", ref, what
        if len(parts) != 4 or parts[1] != "containers" or parts[2] not in (BOX_ID, "vllm"):
            return 404, {"message": "No such container"}
        what = parts[3]
        if method == "GET" and what == "json":
            return 200, self._inspect()
        if method == "POST" and what in ("stop", "start"):
            if what == "stop" and self.stop_gate is not None:
                self.stop_gate.wait(10.0)
            if self._running == (what == "start"):
                return 304, None
            self._running = what == "start"
            return 204, None
        if method == "POST" and what == "update":
            policy = json.loads(body)["RestartPolicy"]
            self.restart, self.retries = policy["Name"], policy["MaximumRetryCount"]
            return 200, {"Warnings": []}
        return 404, {"message": f"no {method} {what}"}

    def _serve(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            if self.threaded:
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
            else:
                self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ValueError):
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    raise ValueError("closed")
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            length = next(
                (int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length")),
                0,
            )
            while len(body) < length:
                body += conn.recv(65536)
            method, path, _ = lines[0].split(" ", 2)
            self.requests.append((TRACER.on, f"{method} {path.split('?')[0]}"))
            status, answer = self._answer(method, path, body)
            out = b"" if answer is None else json.dumps(answer).encode()
            conn.sendall(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(out)}\r\nConnection: close\r\n\r\n".encode()
                + out
            )


@dataclass
class World:
    base: Path
    disk: Disk
    run: Disk
    config: Config
    manager: TracedManager
    clock: Clock
    link: str
    mask: str
    before: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    box: FakeEngine | None = None  # a container world: the loader is this engine's

    @property
    def target(self) -> UnitRef:
        return BOX if self.box else REF

    @property
    def running(self) -> bool:
        if self.box:
            return self.box.running
        return self.manager.active.get(UNIT) == "active"

    @property
    def store(self) -> RecordStore:
        return RecordStore(self.config.state)

    def blocker(self) -> Blocker:
        clock, managers = self.clock, {KEY: self.manager}
        return Blocker(managers, self.config, log.get_logger(), clock=clock, sleep=clock.sleep)

    def admin_files(self) -> dict[str, tuple[Any, ...]]:
        """What a release must leave as it found it: the disk (but the guard's own state
        and the filler) and the runtime dir."""
        skip = (str(self.disk.filler), self.config.state, str(self.run.filler))
        return files(self.disk.path, self.run.path, skip=skip)


def make_world(base: Path, container: bool = False) -> World:
    disk = Disk(base / "disk")
    run = Disk(base / "run")
    home = disk.path / "home" / ".config" / "systemd" / "user"
    (home / "default.target.wants").mkdir(parents=True)
    (disk.path / "etc").mkdir()
    unit = home / UNIT
    unit.write_text("[Service]\nExecStart=/usr/bin/llama-server -m /models/big.gguf\n")
    link = home / "default.target.wants" / UNIT
    link.symlink_to(unit)
    config = Config(
        state=str(disk.path / "state"),
        motd=str(disk.path / "etc" / "motd"),
        issue=str(disk.path / "etc" / "issue"),
        user_runtime=str(run.path),
        cgroup=str(base / "cgroup"),
        proc=str(base / "proc"),
    )
    control = mask_dir(KEY, config.user_runtime)
    os.makedirs(control)  # the manager's, as systemd --user makes it at its start
    manager = TracedManager(KEY, control, {UNIT: [str(link)]})
    manager.start(UNIT)
    world = World(base, disk, run, config, manager, Clock(), str(link), os.path.join(control, UNIT))
    if container:
        manager.stopped(UNIT)  # the unit is not the loader here
        world.box = FakeEngine(base / "docker.sock")
    world.before = world.admin_files()
    return world


def check_recorded(world: World, when: str) -> None:
    """Every change on the machine is in the record on disk."""
    if world.box is not None:
        check_policy_recorded(world, world.box, when)
        return
    gone = not os.path.lexists(world.link)
    masked = os.path.lexists(world.mask)
    if not gone and not masked:
        return
    try:
        record = world.store.load(REF)
    except (RecordError, OSError) as e:
        record, why = None, str(e)
    else:
        why = "no record"
    if record is None:
        world.problems.append(f"{when}: link gone={gone} mask={masked} but {why}")
        return
    if gone and world.link not in [lr.path for lr in record.links]:
        world.problems.append(f"{when}: {world.link} gone, not in the record")
    if masked and not record.mask_made:
        world.problems.append(f"{when}: the mask is laid, the record says it did not make it")


def check_policy_recorded(world: World, box: FakeEngine, when: str) -> None:
    """A container's restart policy is changed only with the old one on record."""
    if (box.restart, box.retries) == BOX_POLICY:
        return
    try:
        record = world.store.load(BOX)
    except (RecordError, OSError) as e:
        world.problems.append(f"{when}: policy {box.restart} but the record: {e}")
        return
    kept = record.container if record else None
    if kept is None or (kept.restart, kept.max_retries) != BOX_POLICY:
        world.problems.append(f"{when}: policy {box.restart}, the old one not on record")


def container_decision() -> tuple[list[Action], Decision]:
    action = Action("stop", BOX, Reason.FOOTPRINT, "expects 115GiB", {"mem_available": 1})
    return [action], Decision(Phase.STRICT, 8, (), (action,))


def guard_pass(world: World, blocker: Blocker, when: str, *, decide: bool = True) -> None:
    """One pass of the daemon: a running loader is decided on again (unless `decide` is
    False: the admin released it, and the policy's verdict is not this test's); else the
    blocks advance."""
    try:
        if decide and world.box is not None and world.box.running:
            blocker.block(*container_decision(), engines={BOX: world.box.path})
        elif decide and world.box is None and world.running:
            blocker.block(*stop_decision(REF))
        else:
            blocker.advance()
    except Exception:
        world.problems.append(f"{when}: the pass raised: {traceback.format_exc(limit=4)}")
    # A container's block runs in a thread of its own: the pass is over when it is (the
    # daemon's next pass would take its result; here no thread outlives a pass, so that
    # the processes this test forks never inherit one, or a lock it held).
    if not blocker.pending.join(10.0):
        world.problems.append(f"{when}: a container block still runs after 10 s")
    if world.manager.active.get(UNIT) == "deactivating":
        world.manager.stopped(UNIT)  # the loader exits on its SIGTERM
    world.clock.t += 10.0
    check_recorded(world, when)


def blocked(world: World) -> bool:
    try:
        record = world.store.load(world.target)
    except (RecordError, OSError):
        return False
    if record is None or record.step != Step.BLOCKED:
        return False
    if world.box is not None:
        return world.box.state == ("no", 0, False)
    return world.manager.load.get(UNIT) == "masked"


def finish_block(world: World, blocker: Blocker) -> None:
    for i in range(PASSES_TO_FINISH):
        if blocked(world):
            return
        guard_pass(world, blocker, f"healed pass {i}")
    if not blocked(world):
        try:
            record = world.store.load(world.target)
        except (RecordError, OSError) as e:
            record = None
            world.problems.append(str(e))
        step = record.step if record else "no record"
        problem = f" ({record.problem})" if record and record.problem else ""
        problem += f" {[h for _, h in record.history[-6:]]}" if record else ""
        there = (
            f"engine {world.box.state} asked {[r[-12:] for _, r in world.box.requests[-8:]]}"
            if world.box
            else f"LoadState {world.manager.load.get(UNIT)}, {world.manager.active.get(UNIT)}"
        )
        world.problems.append(
            f"not blocked {PASSES_TO_FINISH} passes after healing: record {step}{problem}, " + there
        )
    if world.running:
        world.problems.append("the loader runs")


def release(world: World) -> str:
    """The admin's release; '' or the one line it said."""
    try:
        record = world.store.load(world.target)
        if record is None:
            return "not blocked"
        release_mod.release(record, world.store, "/nonexistent", world.config.user_runtime)
    except release_mod.ReleaseError as e:
        return str(e) or "ReleaseError with no text"
    except Exception:
        world.problems.append(f"release raised: {traceback.format_exc(limit=4)}")
        return "raised"
    return ""


def check_released(world: World) -> None:
    """The admin releases the unit if it is still blocked; a minute later the guard has
    done a pass (its banner gone, its store swept). Then the files are as before."""
    if os.path.exists(world.store.path_of(world.target)):
        said = release(world)
        if said:
            world.problems.append(f"the final release failed: {said}")
    if world.box is not None and world.box.state != (*BOX_POLICY, True):
        world.problems.append(f"the container after the release: {world.box.state}")
    world.manager.reload()
    for p in world.disk.path.rglob(".*.tmp"):
        os.utime(p, (0, 0))  # a minute later
    guard_pass(world, world.blocker(), "after the release", decide=False)
    world.problems += differences(world.before, world.admin_files())
    left = os.listdir(world.store.blocked) if os.path.isdir(world.store.blocked) else []
    if left:
        world.problems.append(f"left in blocked/: {left}")


def in_child(work: Callable[[], None]) -> int:
    """Run `work` in a child process; its exit status."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work()
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def run_block(world: World, fault: str, at: int | None) -> None:
    """The daemon's passes from a running loader to a blocked unit, `fault` at point `at`."""
    strike = {"full": world.disk.fill, "read-only": world.disk.read_only}
    saved = world.base / "manager.json"
    if fault == "kill":

        def doomed() -> None:
            def die() -> None:
                saved.write_text(json.dumps([world.manager.snapshot(), world.clock.t]))
                os._exit(KILLED)

            TRACER.at, TRACER.strike = at, die
            blocker = world.blocker()
            for i in range(PASSES_TO_FINISH):
                guard_pass(world, blocker, f"pass {i}")
            saved.write_text(json.dumps([world.manager.snapshot(), world.clock.t]))
            if world.problems:
                print("\n".join(world.problems), file=sys.stderr)
                os._exit(1)

        code = in_child(doomed)
        if code not in (KILLED, 0):
            world.problems.append(f"the guard before the kill: exit {code}")
        state, t = json.loads(saved.read_text())
        world.manager.restore(state)
        world.clock.t = t + 60.0
        check_recorded(world, "after the kill")
        if not os.path.exists(world.store.path_of(world.target)) and not world.running:
            # Killed after its stop, before the first record: nothing on disk was changed,
            # and the loader is judged again when it next starts (Restart=, the next boot).
            if world.box is not None:
                world.box.running = True
            else:
                world.manager.start(UNIT)
        finish_block(world, world.blocker())  # a new guard, from what is on disk
        return
    TRACER.at, TRACER.strike = at, strike[fault]
    blocker = world.blocker()
    for i in range(PASSES_UNDER_FAULT):
        guard_pass(world, blocker, f"pass {i}")
    if TRACER.at is None:  # it struck: now it heals
        world.disk.heal()
    if world.running:
        world.problems.append("the loader runs under the fault")
    finish_block(world, blocker)


def run_release(world: World, fault: str, at: int | None) -> None:
    """An admin's release of a blocked unit, `fault` at point `at`; then the guard's passes,
    and a release again if the first did not finish."""
    blocker = world.blocker()
    finish_block(world, blocker)
    TRACER.on = True
    if fault == "kill":

        def doomed() -> None:
            TRACER.at, TRACER.strike = at, lambda: os._exit(KILLED)
            said = release(world)
            if said:
                print(said, file=sys.stderr)
            os._exit(0 if not said else 1)

        code = in_child(doomed)
        if code not in (KILLED, 0):
            world.problems.append(f"the release before the kill: exit {code}")
    else:
        TRACER.at = at
        TRACER.strike = {"full": world.disk.fill, "read-only": world.disk.read_only}[fault]
        said = release(world)
        if TRACER.at is None:
            world.disk.heal()
        if said and ("\n" in said or not said.strip()):
            world.problems.append(f"a release under the fault said more than one line: {said!r}")
    TRACER.on = False
    # The daemon meanwhile: a release that did not finish leaves the unit blocked (its mask
    # laid again if it went); one that finished leaves it alone.
    blocker = world.blocker()
    for i in range(2):
        guard_pass(world, blocker, f"after the release, pass {i}")
    if os.path.exists(world.store.path_of(world.target)):
        # Not done. The mark of a release that died is held by no process: the guard
        # guards the unit again, and then the admin runs the release again.
        for i in range(3):
            guard_pass(world, blocker, f"after a stale mark, pass {i}")


def trace(pipeline: str, base: Path) -> list[Point]:
    """The points of a clean run of `pipeline`, traced in a process of its own (the driver
    forks every case: it must hold no thread of a guard or an engine)."""
    out = base.with_suffix(".json")

    def clean() -> None:
        out.write_text(json.dumps([[p.kind, p.what] for p in _trace(pipeline, base)]))

    code = in_child(clean)
    if code != 0:
        raise AssertionError(f"the clean {pipeline} ended with {code}")
    return [Point(kind, what) for kind, what in json.loads(out.read_text())]


def _trace(pipeline: str, base: Path) -> list[Point]:
    """The points of a clean run of `pipeline`; an engine call is named by what it asked."""
    world = make_world(base, container=pipeline.startswith("container-"))
    try:
        if pipeline.endswith("block"):
            TRACER.on = True
            finish_block(world, world.blocker())
            TRACER.on = False
        else:
            run_release(world, "full", None)
        if world.problems:
            raise AssertionError(f"the clean {pipeline} has problems: {world.problems}")
        asked = iter([r for on, r in world.box.requests if on] if world.box else [])
        return [Point(p.kind, next(asked, "?")) if p.kind == "engine" else p for p in TRACER.points]
    finally:
        TRACER.on, TRACER.points = False, []
        world.disk.close()
        world.run.close()


def case(pipeline: str, fault: str, at: int, point: Point, base: Path) -> dict[str, Any]:
    world = make_world(base, container=pipeline.startswith("container-"))
    try:
        if pipeline.endswith("block"):
            TRACER.on = True
            run_block(world, fault, at)
            TRACER.on = False
        else:
            run_release(world, fault, at)
        check_released(world)
    except Exception:
        world.problems.append(traceback.format_exc(limit=6))
    finally:
        TRACER.on = False
        world.disk.close()
        world.run.close()
    return {
        "pipeline": pipeline,
        "fault": fault,
        "at": at,
        "point": str(point),
        "problems": world.problems,
    }


def isolated(pipeline: str, fault: str, at: int, point: Point, base: Path) -> str:
    """One case in a process of its own (nothing of one case's guard lives on into the
    next): its result as a JSON line."""
    out = base / f"{pipeline}-{fault}-{at}.json"

    def one() -> None:
        with open(base / f"{pipeline}-{fault}-{at}.log", "w") as said:
            os.dup2(said.fileno(), 2)  # the guard's own log lines, for a case that fails
        result = case(pipeline, fault, at, point, base / f"{pipeline}-{fault}-{at}")
        out.write_text(json.dumps(result))

    code = in_child(one)
    if out.exists():
        return out.read_text()
    ended = f"the case's process ended with {code}"
    return json.dumps(
        {"pipeline": pipeline, "fault": fault, "at": at, "point": str(point), "problems": [ended]}
    )


def main(argv: list[str]) -> int:
    base = Path(argv[1])
    log.configure("console")
    sys.addaudithook(TRACER.audit)
    for pipeline in PIPELINES:
        points = trace(pipeline, base / f"{pipeline}-clean")
        print(json.dumps({"pipeline": pipeline, "points": [str(p) for p in points]}), flush=True)
        for fault in FAULTS:
            for at, point in enumerate(points):
                print(isolated(pipeline, fault, at, point, base), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
