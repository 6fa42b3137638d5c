"""Which container a cgroup is: asked of the engines off the loop, remembered per id.

The sensor finds a container's id in a process's cgroup (engine.container_id);
who it is (name, image, command, restart policy, mounts) only its engine can
say. The engines are asked from threads of this module (up to ASKERS at once,
so that ids seen together are asked together: eight behind an engine that
takes a second each are not eight seconds), never from the loop: an engine that
is slow or hangs costs the loop nothing (its call still ends at the engine's
deadline), and the loop never waits for an answer. Until the answer
comes the id is pending; a command (dump, rescue) waits for it, up to a
deadline.

An answer is kept while the container is seen, and asked again every REFRESH
seconds (its restart policy can change under it). The engines are asked in
their order in the config; one that says 404 does not have it, and the next is
asked. No engine knows it (no engine running): the id is `UNKNOWN`, and the
process is seen as what its manager says it is.

A container whose scope is below a user's user@UID.service is hers, run by her
own rootless engine: it is asked of her engines only (`user_engines`, in her
runtime dir; the peer must be her uid), never of root's, and hers are never
asked about anyone else's. Her questions have askers of their own, so an engine
of hers that hangs holds up no question about root's containers.

At boot dockerd starts the containers whose policy says so before its API
answers (tens of seconds on a busy boot): the loader runs, and nobody can ask
who it is. So when a Docker engine does not answer, dockerd's own files of
that container are read (`docker_root`/containers/<id>/, root's, bounded,
never through a symlink) and stand until the API answers (asked again every
DISK_REFRESH seconds).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..core.snapshot import valid_id
from .engine import (
    USER_RUNTIME,
    Container,
    Engine,
    EngineError,
    engine_owner,
    inspect_from_disk,
    user_engine_paths,
)
from .safefs import Tree, UnsafePath
from .worker import spawn

REFRESH = 30.0  # seconds before a known container is asked about again
RETRY = 10.0  # seconds before an id no engine could answer for is asked again
DISK_REFRESH = 2.0  # seconds before an answer read from dockerd's files is asked of its API
DOCKER_ROOT = "/var/lib/docker"
DISK_MAX = 4 << 20  # bytes of one of dockerd's container files (the API's body cap)
MAX_IDS = 4096  # ids of root's remembered at once: a churn of short-lived containers stays bounded
USER_MAX_IDS = 128  # ... and of each user's: hers never crowd out root's, nor Bob's
# An engine that let a question run out its timeout is not asked again for this long: the
# other ids behind it are answered at once (from dockerd's files, or unknown), not one
# timeout each (8 ids behind a silent dockerd were judged after 2, 4, ... 16 s).
SILENT_BREAK = 10.0
STALL_SLACK = 1.0  # seconds past the engine timeout after which a question is stuck
ASKERS = 4  # threads asking at once about root's containers; each lives on, idle, once started
USER_ASKERS = 2  # ... and about users' (their engines are theirs: they may hang)


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


class _Pending:
    def __repr__(self) -> str:
        return "PENDING"


UNKNOWN = _Unknown()  # no engine has it (or none answered): not a container the guard can act on
PENDING = _Pending()  # asked, no answer yet
Answer = Container | _Unknown | _Pending
Key = tuple[int, str]  # (whose engines: 0 for root's, a user's uid; the container id)


@dataclass
class _Entry:
    answer: Container | _Unknown | None = None  # None: not answered yet
    engine: str = ""  # the socket that answered
    at: float = 0.0  # monotonic time of the answer
    asked: bool = False  # queued or being asked
    asked_at: float = 0.0  # when the question went out
    from_disk: bool = False  # read from dockerd's files: its API did not answer


def container_cgroup(cgroup: str, cid: str) -> str:
    """The container's own cgroup within a process's (`/system.slice/docker-<id>.scope`
    of `/system.slice/docker-<id>.scope/sub`): what a kill of last resort targets."""
    parts = cgroup.split("/")
    for i, part in enumerate(parts):
        if cid in part:
            return "/".join(parts[: i + 1]) or "/"
    return cgroup


class ContainerWatch:
    """Asks the engines about container ids off the loop; lookup() never waits."""

    def __init__(
        self,
        engines: Iterable[str],
        timeout: float,
        *,
        on_answer: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        docker_root: str = DOCKER_ROOT,
        user_engines: Iterable[str] = (),
        user_runtime: str = USER_RUNTIME,
    ) -> None:
        # Root's engines only: a socket in a user's runtime dir answers for her containers.
        self.engines = tuple(p for p in engines if not engine_owner(p, user_runtime))
        self.user_engines = tuple(user_engines)
        self.user_runtime = user_runtime
        self.docker_root = docker_root
        self.timeout = timeout
        self.on_answer = on_answer
        self.clock = clock
        self._entries: dict[Key, _Entry] = {}
        self._count: dict[int, int] = {}  # entries per owner
        # Questions waiting, and the askers idle, for root's engines (False) and users' (True).
        self._queue: dict[bool, list[Key]] = {False: [], True: []}
        self._idle = {False: 0, True: 0}
        self._threads: dict[bool, list[threading.Thread]] = {False: [], True: []}
        self._lock = threading.Condition()
        self._closed = False
        # Engine errors other than "no such container", the latest per socket: said once.
        self.errors: dict[str, str] = {}
        self._silent_until: dict[str, float] = {}  # engine socket -> not asked until

    def present(self) -> bool:
        """Whether any engine socket of root's exists (else nothing is asked of them)."""
        return any(os.path.exists(p) for p in self.engines)

    def lookup(self, cid: str, owner: int = 0) -> tuple[Answer, str]:
        """(what is known of container `cid`, the engine socket that said it), asked of
        root's engines (`owner` 0) or of user `owner`'s own. PENDING starts a question if
        none is out; a known answer older than REFRESH is asked again while the old one
        stands."""
        now = self.clock()
        key = (owner, cid)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if self._count.get(owner, 0) >= (USER_MAX_IDS if owner else MAX_IDS):
                    return UNKNOWN, ""
                entry = self._entries[key] = _Entry()
                self._count[owner] = self._count.get(owner, 0) + 1
            if entry.from_disk:
                after = DISK_REFRESH
            else:
                after = REFRESH if isinstance(entry.answer, Container) else RETRY
            stale = entry.answer is not None and now - entry.at >= after
            if (entry.answer is None or stale) and not entry.asked:
                entry.asked, entry.asked_at = True, now
                self._queue[bool(owner)].append(key)
                self._lock.notify_all()
            self._start(bool(owner))  # (also where an asker could not start before)
            if entry.answer is None:
                # Every call ends within its timeout; a question out longer is stuck (her
                # runtime dir a FUSE mount of hers that never answers an open): its
                # processes are seen as what their manager says they are meanwhile, never
                # left out.
                if now - entry.asked_at > self.timeout + STALL_SLACK:
                    return UNKNOWN, ""
                return PENDING, ""
            return entry.answer, entry.engine

    def forget(self, keep: Iterable[Key]) -> None:
        """Drop what is known of containers no longer seen."""
        keep = set(keep)
        with self._lock:
            for key in [k for k, e in self._entries.items() if k not in keep and not e.asked]:
                del self._entries[key]
                self._count[key[0]] -= 1

    def wait(self, timeout: float) -> None:
        """Wait until every question out has an answer, or `timeout` seconds (commands)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(e.asked for e in self._entries.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._lock.wait(left)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # --- the thread ---

    def _start(self, users: bool) -> None:
        """One more asker, if more questions wait than askers do (under the lock)."""
        threads = self._threads[users] = [t for t in self._threads[users] if t.is_alive()]
        most = USER_ASKERS if users else ASKERS
        if len(self._queue[users]) > self._idle[users] and len(threads) < most:
            name = "engine-watch-users" if users else "engine-watch"
            self._idle[users] += 1  # counted from now: the next lookup does not start another
            thread = spawn(self._run, name, users)
            if thread is None:  # none now (a pids limit): the next lookup tries again
                self._idle[users] -= 1
                return
            threads.append(thread)

    def _run(self, users: bool) -> None:
        queue = self._queue[users]
        while True:
            with self._lock:
                while not queue and not self._closed:
                    self._lock.wait()
                self._idle[users] -= 1
                if self._closed:
                    return
                key = queue.pop(0)
            answer, engine, disk = self._ask(*key)
            with self._lock:
                self._idle[users] += 1
                entry = self._entries.get(key)
                if entry is not None:
                    # An engine that failed keeps the old answer: a hiccup does not make a
                    # known container a plain scope for REFRESH seconds.
                    if answer is not None or entry.answer is None:
                        entry.answer = answer if answer is not None else UNKNOWN
                        entry.engine = engine
                        entry.from_disk = disk
                    entry.at = self.clock()
                    entry.asked = False
                self._lock.notify_all()
            self.on_answer()

    def _ask(self, owner: int, cid: str) -> tuple[Container | _Unknown | None, str, bool]:
        """(the container, UNKNOWN if every engine there said it has none, None if one that
        might have it did not answer; the socket; whether dockerd's files said it)."""
        silent: list[str] = []
        if owner:
            paths = user_engine_paths(owner, self.user_runtime, self.user_engines)
        else:
            paths = list(self.engines)
        for path in paths:
            # (A user's path is looked at by the walk of Engine, not here: no stat of hers.)
            if not owner and not os.path.exists(path):
                continue
            if self.clock() < self._silent_until.get(path, 0.0):
                silent.append(path)  # it did not answer a moment ago: not waited on again
                continue
            engine = Engine(path, timeout=self.timeout, user_runtime=self.user_runtime)
            try:
                container = engine.inspect(cid)
            except EngineError as e:
                if e.status == 404 or (owner and _absent(e)):
                    continue
                silent.append(path)
                self.errors[path] = str(e)
                if "no answer within" in str(e):
                    self._silent_until[path] = self.clock() + SILENT_BREAK
                continue
            self.errors.pop(path, None)
            self._silent_until.pop(path, None)
            if container.id != cid:
                continue  # an answer about another container is no answer about this one
            return container, path, False
        docker = [p for p in silent if "podman" not in os.path.basename(p)]
        if docker and not owner:
            found = read_docker_disk(self.docker_root, cid)
            if found is not None:
                return found, docker[0], True
        return (None if silent else UNKNOWN), "", False


def _absent(e: EngineError) -> bool:
    """A user's engine that is not there (no such socket or directory, nobody listening):
    she runs none, which is no error to tell."""
    text = str(e)
    return any(
        t in text for t in ("No such file or directory", "no such directory", "Connection refused")
    )


def read_docker_disk(root: str, cid: str) -> Container | None:
    """Container `cid` as dockerd's files under `root` describe it; None if they are not
    there or not what dockerd writes. Read as root from root's directories only (safefs:
    no symlink followed), each file at most DISK_MAX bytes."""
    if not valid_id(cid):
        return None
    where = os.path.join(root, "containers", cid)
    try:
        tree = Tree(root, 0, 0)
        config = tree.read(os.path.join(where, "config.v2.json"), DISK_MAX)
        host = tree.read(os.path.join(where, "hostconfig.json"), DISK_MAX)
        if config is None or host is None:
            return None
        container = Container.from_inspect(inspect_from_disk(json.loads(config), json.loads(host)))
    except (UnsafePath, OSError, ValueError, RecursionError):
        return None
    return container if container.id == cid else None
