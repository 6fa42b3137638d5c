"""A container engine's local API: Docker's Engine API, or Podman's compatible one.

Loader containers come back through their engine's restart policy, not through
systemd: the guard has to ask the engine what a `docker-<id>.scope`
is, and stop and block it there. Docker listens on /run/docker.sock, Podman's
service on /run/podman/podman.sock; Podman's compat API answers the same paths
with the same JSON for everything used here.

Why a client of our own, about 300 lines, and not the `docker` package (docker-py):

- Import cost on the guard's path: docker-py pulls in requests, urllib3, ssl
  and their charset and certificate machinery, paid in start time and in the
  guard's 128 MiB MemoryMax=, for five calls over a unix socket (not measured
  here: docker-py is not installed).
- Everything the engine says is a docker-group user's text: container names,
  images, labels, commands. This client bounds every answer (a 4 MiB cap on a
  body, 64 KiB on the headers, a deadline on the whole call, not only on each
  read) and decodes JSON under those caps; a library's client trusts its engine.
- No fork or exec: never the CLI.

Paths are the unversioned ones (`/containers/json`): every engine serves them
at its own current version, while a pinned `/v1.NN/` is refused by engines newer
than its minimum (Docker raises its minimum API version over time) or older than
the version. The fields read here have not changed since API 1.24.

Every failure is an EngineError whose text is one line naming the socket and the
call. `Container.from_inspect` (pure) reads an inspect answer into plain, capped,
printable data; `container_id` (pure) maps a process's cgroup to a container id.
They live here, beside the client, because block/ needs them and may not import
the spine (docs/architecture.md); classification is `spark_guard.containers`'.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..core.argv import environment
from ..core.snapshot import (
    ARGV_MAX_ARGS,
    ARGV_MAX_BYTES,
    CONTAINER_NAME_MAX,
    valid_id,
    valid_name,
)
from ..core.text import printable
from . import mounts
from .safefs import Tree, UnsafePath, anchor_stat

DOCKER_SOCKET = "/run/docker.sock"
PODMAN_SOCKET = "/run/podman/podman.sock"
USER_RUNTIME = "/run/user"
# A user's own (rootless) engines, in her runtime dir: Podman's podman.socket and rootless
# Docker's dockerd-rootless.
USER_ENGINES = ("podman/podman.sock", "docker.sock")

TIMEOUT = 2.0  # seconds for a call: connect, send, and the whole answer
BODY_MAX = 4 << 20  # bytes of a response body, whatever the call
# JSON costs about 24x its size in Python objects at worst (small objects: 4 MiB parse to
# 97 MiB peak, measured), against the guard's MemoryMax=128M; each call's answer is capped
# at what a real one needs, several times over. An inspect is 5-30 kB (every env entry,
# label and mount of a container): 256 KiB, 6 MiB parsed at worst. A list is ~200 bytes a
# container: 1 MiB holds ~5,000, 24 MiB parsed at worst.
INSPECT_MAX = 256 << 10
LIST_BODY_MAX = 1 << 20
VERSION_MAX = 64 << 10
HEAD_MAX = 64 << 10  # bytes of the status line and headers
CHUNK_LINE_MAX = 1024
ERROR_SHOWN = 200  # characters of an engine's error message quoted in an EngineError

# What of an inspect answer is kept, and how much of each (names and images are a
# docker-group user's text, shown in the journal and the login note).
IMAGE_MAX = 512
STATUS_MAX = 32
LABELS_MAX = 64
LABEL_KEY_MAX = 128
LABEL_VALUE_MAX = 512
MOUNTS_MAX = 64
PATH_MAX = 4096
LIST_MAX = 10_000  # containers listed


class EngineError(RuntimeError):
    """A call the engine did not answer as it should; str() is one line naming the socket
    and the call."""

    def __init__(self, socket_path: str, call: str, problem: str, status: int = 0) -> None:
        self.status = status
        one_line = printable(problem, 2 * ERROR_SHOWN)
        super().__init__(f"{printable(socket_path, 256)}: {call}: {one_line}")


# A container's cgroup: /docker/<id> (cgroupfs driver), .../docker-<id>.scope (systemd
# driver), .../libpod-<id>.scope (Podman; /libpod_parent/libpod-<id> with cgroupfs).
_CGROUP_COMPONENT = re.compile(
    r"(?:docker-|libpod-)([0-9a-f]{64})\.scope|(?:libpod-)?([0-9a-f]{64})"
)
_CGROUPFS_PARENTS = ("docker", "libpod_parent")


def container_id(cgroup: str) -> str | None:
    """The id (64 hex) of the container whose cgroup `cgroup` is, or is below; None if none.

    The outermost container wins (a container inside a container is the inner engine's
    business, not the host's). Nothing under a `user@UID.service` counts: a user names
    the scopes of their own manager (`systemd-run --user --scope --unit docker-<id>`),
    and a rootless engine is that user's own, on a socket the guard does not ask.
    `libpod-conmon-<id>.scope` (Podman's monitor) is not the container.
    """
    parts = [p for p in cgroup.split("/") if p]
    if any(p.startswith("user@") and p.endswith(".service") for p in parts):
        return None
    for i, part in enumerate(parts):
        m = _CGROUP_COMPONENT.fullmatch(part)
        if m is None:
            continue
        if m.group(1):
            return m.group(1)
        # A bare id is a container only right below the cgroupfs driver's parent.
        if i > 0 and parts[i - 1] in _CGROUPFS_PARENTS:
            return m.group(2)
    return None


_SCOPE = re.compile(r"(?:docker-|libpod-)([0-9a-f]{64})\.scope")


def scope_container_id(below: str) -> str | None:
    """The id of the container whose scope `below` (a cgroup path below a user's
    user@UID.service) is, or is below: `user.slice/libpod-<id>.scope`, as her rootless
    Podman has her manager make it, or rootless Docker's `docker-<id>.scope`. The outermost
    wins; a bare id or `libpod-conmon-` is not one."""
    for part in below.split("/"):
        m = _SCOPE.fullmatch(part)
        if m is not None:
            return m.group(1)
    return None


def engine_owner(path: str, user_runtime: str = USER_RUNTIME) -> int:
    """Whose engine listens at `path`: the uid of `<user_runtime>/UID/...` (hers, rootless),
    else root (0). The peer on the socket must then be that uid."""
    base = os.path.normpath(user_runtime).rstrip("/") + "/"
    if not path.startswith(base):
        return 0
    uid = path[len(base) :].split("/", 1)[0]
    return int(uid) if uid.isascii() and uid.isdigit() and len(uid) <= 10 else 0


def user_engine_paths(uid: int, user_runtime: str, relative: tuple[str, ...]) -> list[str]:
    """Her engines' sockets: each of `relative` in her runtime dir."""
    return [os.path.join(user_runtime, str(uid), r) for r in relative]


def _text(value: object, limit: int) -> str:
    return printable(value, limit) if isinstance(value, str) else ""


def _raw(value: object, limit: int) -> str | None:
    """A string kept as it is (a path, a command word: data that is read, not shown), if
    it is one, has no NUL and fits `limit`."""
    if isinstance(value, str) and len(value) <= limit and "\0" not in value:
        return value
    return None


def _int(value: object, low: int, high: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    return 0


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _command(path: object, args: object) -> tuple[str, ...]:
    """Path + Args, bounded as a process's argv is (snapshot.ARGV_MAX_*): an argument that
    is not a string, holds a NUL or passes the byte limit ends it."""
    words = [path] + (args if isinstance(args, list) else [])
    out: list[str] = []
    size = 0
    for word in words[:ARGV_MAX_ARGS]:
        if not isinstance(word, str) or "\0" in word:
            break
        size += len(word) + 1
        if size > ARGV_MAX_BYTES:
            break
        out.append(word)
    return tuple(out) if out and out[0] else tuple(out[1:])


ENV_READ_MAX = 4096  # Config.Env entries looked at: the inspect answer is capped already


def _environment(env: object, command: tuple[str, ...]) -> tuple[str, ...]:
    """The 'K=V' entries of Config.Env that foresight reads (environment.needed), strings
    only, NUL-free."""
    items = [
        e
        for e in (env if isinstance(env, list) else [])[:ENV_READ_MAX]
        if isinstance(e, str) and "\0" not in e
    ]
    return environment.needed(items, [command])


@dataclass(frozen=True)
class Container:
    """One container, as its engine's inspect answer says, bounded.

    `name`, `image`, `status`, `restart` and the labels are printable and capped (they
    are shown as they are). `command` and `mounts` are data read by the guard (a loader's
    flags, a model's path): bounded and NUL-free but not escaped; show them through
    `shown_command` and `printable()`.
    """

    id: str
    name: str
    image: str
    command: tuple[str, ...] = ()
    restart: str = ""  # HostConfig.RestartPolicy.Name: "no" (or ""), always, unless-stopped...
    max_retries: int = 0  # ... and its MaximumRetryCount (on-failure:N)
    running: bool = False
    status: str = ""
    pid: int = 0
    mounts: tuple[tuple[str, str], ...] = ()  # (source on the host, destination inside)
    labels: tuple[tuple[str, str], ...] = field(default=())
    # State.StartedAt, seconds since the epoch (None: never started, or not said): when
    # this run began, by the engine's word, whenever the guard first saw it.
    started_at: float | None = None
    # HostConfig.AutoRemove (`docker run --rm`): removed when it stops, no policy to change.
    auto_remove: bool = False
    # Config.Env, only what foresight reads (core/argv/environment.py: LLAMA_ARG_MODEL and
    # the rest), bounded as a unit's Environment= is: data, never shown unescaped.
    environment: tuple[str, ...] = ()

    @property
    def ref(self) -> str:
        """How the admin names it: `container:NAME` (the id where the name is not one)."""
        return f"container:{self.name if valid_name(self.name) else self.id}"

    @property
    def policy(self) -> str:
        """The restart policy as `docker run --restart` spells it."""
        name = self.restart or "no"
        return f"{name}:{self.max_retries}" if self.max_retries else name

    def shown_command(self, limit: int = 1024) -> str:
        return printable(" ".join(self.command), limit)

    @classmethod
    def from_inspect(cls, data: object) -> Container:
        """ValueError if the answer has no 64-hex Id: without one nothing can be asked again."""
        top = _dict(data)
        cid = top.get("Id")
        if not isinstance(cid, str) or not valid_id(cid):
            raise ValueError("no container id (64 hex) in the answer")
        config = _dict(top.get("Config"))
        state = _dict(top.get("State"))
        host = _dict(top.get("HostConfig"))
        policy = _dict(host.get("RestartPolicy"))
        name = top.get("Name")
        name = name[1:] if isinstance(name, str) and name.startswith("/") else name
        image = config.get("Image") if isinstance(config.get("Image"), str) else top.get("Image")
        mounts: list[tuple[str, str]] = []
        listed = top.get("Mounts")
        for m in listed if isinstance(listed, list) else []:
            source, dest = (
                _raw(_dict(m).get("Source"), PATH_MAX),
                _raw(_dict(m).get("Destination"), PATH_MAX),
            )
            if source is not None and dest is not None:
                mounts.append((source, dest))
            if len(mounts) >= MOUNTS_MAX:
                break
        labels = _dict(config.get("Labels"))
        return cls(
            id=cid,
            name=_text(name, CONTAINER_NAME_MAX),
            image=_text(image, IMAGE_MAX),
            command=_command(top.get("Path"), top.get("Args")),
            restart=_text(policy.get("Name"), STATUS_MAX),
            max_retries=_int(policy.get("MaximumRetryCount"), 0, 1 << 31),
            running=state.get("Running") is True,
            status=_text(state.get("Status"), STATUS_MAX),
            pid=_int(state.get("Pid"), 0, 1 << 22),
            mounts=tuple(mounts),
            started_at=_started(state.get("StartedAt")),
            auto_remove=host.get("AutoRemove") is True,
            environment=_environment(config.get("Env"), _command(top.get("Path"), top.get("Args"))),
            labels=tuple(
                (printable(k, LABEL_KEY_MAX), _text(v, LABEL_VALUE_MAX))
                for k, v in list(labels.items())[:LABELS_MAX]
            ),
        )


def _started(value: object) -> float | None:
    """RFC 3339 with nanoseconds, as Go writes it ("2026-12-03T07:00:00.123456789Z");
    Go's zero time ("0001-01-01T00:00:00Z") is a container never started."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    m = _RFC3339.match(value)
    if m is None:
        return None
    fraction = (m.group(2) or "")[:7]  # ".123456": what datetime takes
    try:
        at = datetime.fromisoformat(m.group(1) + fraction + m.group(3).replace("Z", "+00:00"))
    except ValueError:
        return None
    return at.timestamp() if at.year > 1 else None


_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def inspect_from_disk(config: object, hostconfig: object) -> dict[str, Any]:
    """dockerd's own files of a container (`<data-root>/containers/<id>/config.v2.json`
    and `hostconfig.json`) in the shape of its inspect answer, for Container.from_inspect:
    what the guard reads while dockerd does not answer (at boot it restarts containers
    before its API serves)."""
    top = _dict(config)
    points = _dict(top.get("MountPoints"))
    return {
        "Id": top.get("ID"),
        "Name": top.get("Name"),
        "Config": top.get("Config"),
        "State": top.get("State"),
        "Path": top.get("Path"),
        "Args": top.get("Args"),
        "HostConfig": hostconfig,
        "Mounts": [
            {"Source": _dict(m).get("Source"), "Destination": _dict(m).get("Destination")}
            for m in list(points.values())[:MOUNTS_MAX]
        ],
    }


@dataclass(frozen=True)
class Listed:
    """One line of the engine's container list: enough to pick one and inspect it."""

    id: str
    name: str
    image: str
    state: str


class Engine:
    """One engine's API socket. Each call is its own connection (`Connection: close`),
    bounded by `timeout` seconds as a whole; nothing is kept between calls."""

    def __init__(
        self,
        path: str = DOCKER_SOCKET,
        *,
        timeout: float = TIMEOUT,
        body_max: int = BODY_MAX,
        check_peer: bool = True,
        user_runtime: str = USER_RUNTIME,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.body_max = body_max
        # The peer must be the engine's owner (SO_PEERCRED): root for the engines of root's
        # the guard asks, a socket where a user's process listens being none of them; for
        # a user's own engine in her runtime dir, her uid, never root's or another's.
        self.check_peer = check_peer
        self.user_runtime = user_runtime
        self.owner = engine_owner(path, user_runtime)

    # --- the calls ---

    def version(self) -> dict[str, Any]:
        data = self._json("GET", "/version", "version", VERSION_MAX)
        if not isinstance(data, dict):
            raise EngineError(self.path, "version", "answer is not an object")
        return data

    def containers(self) -> list[Listed]:
        """Every container, running or not (at most LIST_MAX)."""
        call = "list containers"
        data = self._json("GET", "/containers/json?all=1", call, LIST_BODY_MAX)
        if not isinstance(data, list):
            raise EngineError(self.path, call, "answer is not a list")
        out: list[Listed] = []
        for item in data[:LIST_MAX]:
            entry = _dict(item)
            cid = entry.get("Id")
            if not isinstance(cid, str) or not valid_id(cid):
                continue
            names = entry.get("Names")
            name = names[0] if isinstance(names, list) and names else ""
            name = name[1:] if isinstance(name, str) and name.startswith("/") else name
            out.append(
                Listed(
                    cid,
                    _text(name, CONTAINER_NAME_MAX),
                    _text(entry.get("Image"), IMAGE_MAX),
                    _text(entry.get("State"), STATUS_MAX),
                )
            )
        return out

    def inspect(self, ref: str) -> Container:
        """The container named or numbered `ref`; EngineError (status 404) if there is none."""
        call = f"inspect {self._checked(ref, 'inspect')}"
        data = self._json("GET", f"/containers/{ref}/json", call, INSPECT_MAX)
        try:
            return Container.from_inspect(data)
        except ValueError as e:
            raise EngineError(self.path, call, str(e)) from None

    def stop(self, ref: str, t: int = 10) -> bool:
        """Stop it (SIGTERM, SIGKILL after `t` seconds); the call waits for that, so its
        deadline is `timeout` + t. False if it was not running."""
        call = f"stop {self._checked(ref, 'stop')}"
        status = self._call("POST", f"/containers/{ref}/stop?t={int(t)}", call, extra=t)[0]
        return status != 304

    def start(self, ref: str) -> bool:
        """Start it; False if it was running already."""
        call = f"start {self._checked(ref, 'start')}"
        return self._call("POST", f"/containers/{ref}/start", call)[0] != 304

    def update_restart(self, ref: str, name: str, max_retries: int = 0) -> None:
        """Set its restart policy (`docker update --restart NAME[:N]`)."""
        call = f"update {self._checked(ref, 'update')} restart={printable(name, STATUS_MAX)}"
        policy = {"Name": name, "MaximumRetryCount": int(max_retries)}
        body = json.dumps({"RestartPolicy": policy}).encode()
        self._call("POST", f"/containers/{ref}/update", call, body=body)

    # --- HTTP/1.1 over the unix socket ---

    def _checked(self, ref: str, call: str) -> str:
        if not valid_name(ref):
            raise EngineError(self.path, call, "not a container name or id")
        return ref

    def _connect(self, sock: socket.socket, call: str) -> None:
        """Root's engine: its path. Hers: her runtime dir walked from the root-owned
        runtime root with O_NOFOLLOW, with her file rights (a symlink of hers to root's
        docker.sock, or to another user's socket, is refused or cannot be opened by her),
        and connected to through /proc/self/fd."""
        if not self.owner:
            sock.connect(self.path)
            return
        directory, name = os.path.split(self.path)
        runtime = os.path.join(self.user_runtime, str(self.owner))
        try:
            tree = Tree(self.user_runtime, self.owner, anchor_stat(runtime).st_gid, no_fuse=True)
            with tree.directory(directory) as fd:
                # The socket pinned (O_PATH, not followed), checked, connected to by its fd.
                pinned = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    st = None if mounts.on_fuse(pinned) else os.fstat(pinned)  # (F12)
                    if st is None or not stat.S_ISSOCK(st.st_mode) or st.st_uid != self.owner:
                        raise EngineError(self.path, call, f"not a socket of uid {self.owner}")
                    sock.connect(f"/proc/self/fd/{pinned}")
                finally:
                    os.close(pinned)
        except UnsafePath as e:
            raise EngineError(self.path, call, str(e)) from None

    def _json(self, method: str, path: str, call: str, limit: int) -> Any:
        body = self._call(method, path, call, limit=limit)[1]
        try:
            return json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise EngineError(self.path, call, f"answer is not JSON: {e}") from None

    def _call(
        self,
        method: str,
        path: str,
        call: str,
        *,
        body: bytes | None = None,
        extra: float = 0,
        limit: int | None = None,
    ) -> tuple[int, bytes]:
        """(status, body) of a 2xx or 304 answer; EngineError for anything else."""
        deadline = time.monotonic() + self.timeout + max(0.0, extra)
        head = [
            f"{method} {urllib.parse.quote(path, safe='/?=&')} HTTP/1.1",
            "Host: engine",
            "User-Agent: spark-guard",
            "Accept: application/json",
            "Connection: close",
        ]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
                s.settimeout(self.timeout)
                self._connect(s, call)
                if self.check_peer:
                    creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                    uid = struct.unpack("3i", creds)[1]
                    if uid != self.owner:
                        who = f"uid {self.owner}" if self.owner else "root"
                        raise EngineError(self.path, call, f"peer is uid {uid}, not {who}")
                _Reader(s, deadline).send(request)
                cap = self.body_max if limit is None else min(limit, self.body_max)
                status, data = _Reader(s, deadline, cap).response()
        except TimeoutError:
            waited = self.timeout + max(0.0, extra)
            raise EngineError(self.path, call, f"no answer within {waited:g} s") from None
        except _Bad as e:
            raise EngineError(self.path, call, str(e)) from None
        except OSError as e:
            raise EngineError(
                self.path, call, os.strerror(e.errno) if e.errno else str(e)
            ) from None
        if 200 <= status < 300 or status == 304:
            return status, data
        raise EngineError(self.path, call, f"HTTP {status}: {_message(data)}", status)


def _message(body: bytes) -> str:
    """The engine's own error text ({"message": ...}), capped."""
    try:
        data = json.loads(body[: 64 << 10].decode("utf-8"))
        text = data.get("message") if isinstance(data, dict) else None
    except (ValueError, RecursionError):
        text = None
    return printable(
        text if isinstance(text, str) else body[:ERROR_SHOWN].decode("utf-8", "replace"),
        ERROR_SHOWN,
    )


class _Bad(Exception):
    """A response that is not HTTP as this client reads it."""


class _Reader:
    """Reads one response from `sock`, every recv bounded by what is left of `deadline`."""

    def __init__(self, sock: socket.socket, deadline: float, body_max: int = BODY_MAX) -> None:
        self.sock = sock
        self.deadline = deadline
        self.body_max = body_max
        self.buf = bytearray()
        self.eof = False

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            self.sock.settimeout(self._left())
            view = view[self.sock.send(view) :]

    def _more(self, want: int = 65536) -> None:
        self.sock.settimeout(self._left())
        got = self.sock.recv(want)
        if not got:
            self.eof = True
        self.buf += got

    def _until(self, marker: bytes, limit: int, what: str) -> bytes:
        """Bytes up to `marker` (consumed, not returned), within `limit` bytes."""
        while True:
            at = self.buf.find(marker)
            if at >= 0:
                out = bytes(self.buf[:at])
                del self.buf[: at + len(marker)]
                return out
            if len(self.buf) > limit:
                raise _Bad(f"{what} longer than {limit} bytes")
            if self.eof:
                raise _Bad(f"connection closed in the {what}")
            self._more()

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if self.eof:
                raise _Bad("connection closed in the body")
            self._more(min(n - len(self.buf), 1 << 20))
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def response(self) -> tuple[int, bytes]:
        head = self._until(b"\r\n\r\n", HEAD_MAX, "header")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _Bad(f"not an HTTP answer: {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        if status in (204, 304) or 100 <= status < 200:
            return status, b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return status, self._chunked()
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or len(length) > 12:
                raise _Bad(f"bad Content-Length {length[:20]!r}")
            if int(length) > self.body_max:
                raise _Bad(f"answer of {int(length)} bytes, over the cap of {self.body_max}")
            return status, self._exactly(int(length))
        while not self.eof:  # no length: the body runs to the end of the connection
            if len(self.buf) > self.body_max:
                raise _Bad(f"answer over the cap of {self.body_max} bytes")
            self._more()
        return status, bytes(self.buf)

    def _chunked(self) -> bytes:
        body = bytearray()
        while True:
            line = self._until(b"\r\n", CHUNK_LINE_MAX, "chunk header")
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _Bad(f"bad chunk size {size_text[:20]!r}") from None
            if size < 0:
                raise _Bad("bad chunk size")
            if size == 0:
                return bytes(body)  # trailers, if any, are not read: the connection closes
            if len(body) + size > self.body_max:
                raise _Bad(f"answer over the cap of {self.body_max} bytes")
            body += self._exactly(size)
            if self._exactly(2) != b"\r\n":
                raise _Bad("chunk not followed by CRLF")
