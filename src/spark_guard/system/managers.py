"""Talking to systemd managers on their private sockets, in-process, with pystemd.

PID 1 listens on /run/systemd/private and each user manager on
/run/user/UID/systemd/private. Both are peer-to-peer D-Bus: no dbus-daemon
in the way, so the guard can run before dbus.service and never waits on the
system bus. Calls name their D-Bus signatures explicitly instead of letting
pystemd introspect (an lxml parse per object; pystemd 0.11 repeats it on
every load()).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import importlib.util
import os
import select
import socket
import stat
import struct
import sys
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.argv.environment import needed as needed_environment
from ..core.classify import bounded
from ..core.snapshot import ARGV_MAX_BYTES, SYSTEM, manager_uid, user_manager, valid_unit_name
from . import dbuswire, mounts
from .cgroupfs import paused
from .procfs import ProcFS
from .safefs import Tree, UnsafePath, anchor_stat

_DEST = b"org.freedesktop.systemd1"
_PATH = b"/org/freedesktop/systemd1"
_MANAGER = b"org.freedesktop.systemd1.Manager"
_UNIT = b"org.freedesktop.systemd1.Unit"
_SERVICE = b"org.freedesktop.systemd1.Service"
_DRAIN_MAX = 4096  # queued messages dropped after one call, at most (each is one process())
_START_JOBS = ("start", "restart", "try-restart", "reload-or-start")
_AUDIT_PROPS = (
    (_UNIT, b"FragmentPath", b"s"),
    (_UNIT, b"UnitFileState", b"s"),
    (_UNIT, b"After", b"as"),
    (_UNIT, b"DropInPaths", b"as"),
    (_UNIT, b"StartLimitBurst", b"u"),
    (_UNIT, b"StartLimitIntervalUSec", b"t"),
    (_SERVICE, b"Restart", b"s"),
    (_SERVICE, b"RestartUSec", b"t"),
    (_SERVICE, b"MemoryMax", b"t"),
    (_SERVICE, b"OOMScoreAdjust", b"i"),
    (_SERVICE, b"NRestarts", b"u"),
)


class ManagerError(RuntimeError):
    """A manager could not be reached or refused a call; str() says which and why."""


class ManagerUntrusted(ManagerError):
    """What listens on a user's socket is not that user's systemd (a fake, or a redirect)."""


class ManagerSilent(ManagerError):
    """A call timed out: the manager is busy (a daemon-reload under memory pressure) or
    frozen. It is not asked again until SILENT_FOR has passed."""


class FreezeLate(ManagerError):
    """FreezeUnit sent, not answered within FREEZE_TIMEOUT: the kernel has not frozen the
    cgroup yet (a process in an uninterruptible wait). It may still land; not silent."""


# A manager busy past this answers nothing useful in time: the guard moves on
# (cgroup kill, retry later) instead of sd-bus's default 25 s wait.
os.environ.setdefault("SYSTEMD_BUS_TIMEOUT", "5s")
# After a call times out, calls to that manager fail at once for this long: each
# call would wait the whole bus timeout again, and a pass that asks a silent PID 1
# five things would hold the loop 25 s (seen: a daemon-reload of PID 1 under
# memory pressure, then the watchdog). Two bus timeouts: asked every 10 s at most.
SILENT_FOR = 10.0
# A manager must answer the D-Bus handshake within this before pystemd is let near it.
# pystemd keeps the GIL while sd-bus waits: a call to a silent peer would stop every
# thread of the guard, the loop included, for the whole bus timeout. Python's own
# socket waits let go of it. A live manager answers in microseconds to milliseconds.
HANDSHAKE_TIMEOUT = 1.0
# A user's unit property (ExecStart=, Environment=): a real one is a few kB, and comes back
# in milliseconds; 60 Environment= lines of 1 MB took systemd 3.7 s to send.
DETAILS_CAP = 256 * 1024
DETAILS_TIMEOUT = 1.0
# A freeze of a cgroup whose processes all run or sleep takes milliseconds (F4).
FREEZE_TIMEOUT = 1.0


def _hung_up(fd: int) -> bool:
    """The peer closed its end (or the socket failed): nothing will answer on it again."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    closed = select.POLLRDHUP | select.POLLHUP | select.POLLERR
    return any(ev & closed for _, ev in poller.poll(0))


def _bounded_rows(rows: Iterable[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
    """ExecStart= lines kept within ARGV_MAX_BYTES in all (a service has one; a oneshot a
    few): each bounded as a command line is, and a line over what is left is dropped."""
    out = []
    left = ARGV_MAX_BYTES
    for row in rows:
        argv = bounded(row)
        size = sum(len(a) + 1 for a in argv)
        if size > left:
            break
        out.append(argv)
        left -= size
    return tuple(out)


def _timed_out(e: BaseException) -> bool:
    """pystemd's errors carry sd-bus's negative errno."""
    code = getattr(e, "errno", None)
    return isinstance(code, int) and abs(code) == errno.ETIMEDOUT


def _dbuslib() -> Any:
    """pystemd's D-Bus extension module, without the rest of pystemd.

    `import pystemd.dbuslib` runs pystemd/__init__, which builds the
    introspecting unit objects and loads lxml: about 6 MB of the guard's RSS
    and 20 ms of its start, for nothing it uses. When pystemd is not imported
    yet, an empty package with pystemd's path stands in for it, so only the
    extension (and the two small modules it needs) load.
    """
    if "pystemd" not in sys.modules:
        spec = importlib.util.find_spec("pystemd")
        if spec is not None and spec.submodule_search_locations:
            package = types.ModuleType("pystemd")
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules["pystemd"] = package
    return importlib.import_module("pystemd.dbuslib")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class UnitState:
    name: str
    load_state: str
    active_state: str
    sub_state: str


@dataclass(frozen=True)
class UnitDetails:
    exec_start: tuple[tuple[str, ...], ...]
    active_since: float | None  # monotonic seconds
    environment: tuple[str, ...] = ()  # Environment= assignments, 'K=V'
    user: str = ""  # User= as the manager reports it ("": the manager's own user)
    unreadable: str = ""  # why they could not be read (then all else is empty)


class Manager:
    """One systemd manager: 'system' or 'user:UID', reached on `socket_path`."""

    def __init__(
        self,
        key: str,
        socket_path: str,
        proc_root: str = "/proc",
        *,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        self.key = key
        self.socket_path = socket_path
        self.proc_root = proc_root
        self._bus: Any = None
        # Called after every call that came back, answered or not: the daemon pings its
        # watchdog there, so calls that each end within the bus timeout never add up to
        # a watchdog kill. A call that never comes back pings nothing.
        self.heartbeat = heartbeat or (lambda: None)
        # Monotonic time before which this manager is not asked (a call timed out).
        self.silent_until = 0.0
        # The manager's own cgroup: for a user manager, what /proc says its process runs
        # in (never what it claims); only units below it are attributed to it.
        self.root_cgroup = "/"
        self.pid = 0
        # The manager's unit search path, highest priority first.
        self.unit_path_dirs: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Manager({self.key}, {self.socket_path})"

    def connect(self, system: Manager | None = None) -> None:
        """Connect, and believe a user manager only once it is shown to be that user's
        systemd: see `_verify`. `system`: PID 1's connected manager, when there is one."""
        with self._socket_dir() as address:
            self._handshake(address)
            bus = _dbuslib().DBusAddress(f"unix:path={address}".encode(), peer_to_peer=True)
            try:
                bus.open()
            except Exception as e:
                raise ManagerError(
                    f"{self.key}: cannot connect to {self.socket_path}: {e}"
                ) from None
        self._bus = bus
        try:
            # The peer is checked before the first call: a fake that never answers
            # must not hold the guard for the bus timeout.
            self._verify(system)
            claimed = _s(self._get(_PATH, _MANAGER, b"ControlGroup", b"s")).rstrip("/") or "/"
            if self.key == SYSTEM:
                self.root_cgroup = claimed
            elif claimed != self.root_cgroup:
                raise ManagerUntrusted(
                    f"{self.key}: claims cgroup {claimed} but runs in {self.root_cgroup}"
                )
            dirs = self._get(_PATH, _MANAGER, b"UnitPath", b"as")
            self.unit_path_dirs = tuple(_s(d) for d in dirs)
        except ManagerError:
            self.close()
            raise

    def _handshake(self, address: str) -> None:
        """The manager answers SASL's AUTH EXTERNAL within HANDSHAKE_TIMEOUT, or is silent.

        A frozen manager, or PID 1 deep in a daemon-reload, answers nothing: that
        is found here, where waiting costs no one else anything."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            sock.connect(address)
            sock.sendall(b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode() + b"\r\n")
            reply = sock.recv(256)
        except TimeoutError:
            self.silent_until = time.monotonic() + SILENT_FOR
            raise ManagerSilent(
                f"{self.key}: no answer to the D-Bus handshake within {HANDSHAKE_TIMEOUT:g}s"
            ) from None
        except OSError as e:
            raise ManagerError(
                f"{self.key}: cannot connect to {self.socket_path}: {e.strerror or e}"
            ) from None
        finally:
            sock.close()
        if not reply.startswith(b"OK "):
            raise ManagerError(f"{self.key}: {self.socket_path} refused the D-Bus handshake")

    @contextlib.contextmanager
    def _socket_dir(self) -> Any:
        """The socket's address, reached without following a user's symlinks. She owns
        /run/user/UID/systemd: it is walked from the root-owned runtime root with
        O_NOFOLLOW, never into FUSE (mounts.py), and the socket pinned, checked, and
        connected to through /proc/self/fd: a symlink, or a mount over it, is refused."""
        if not self.uid:
            yield self.socket_path
            return
        directory, name = os.path.split(self.socket_path)
        # <user_runtime>/UID/systemd/private: the anchor is the root-owned runtime root.
        runtime = os.path.dirname(directory)
        try:
            tree = Tree(os.path.dirname(runtime), self.uid, anchor_stat(runtime).st_gid, True)
            with tree.directory(directory) as fd, mounts.pinned(name, fd) as sock:
                st = os.fstat(sock)
                if not stat.S_ISSOCK(st.st_mode) or st.st_uid != self.uid:
                    raise UnsafePath(errno.EPERM, f"{self.socket_path}: not a socket of hers")
                yield f"/proc/self/fd/{sock}"
        except UnsafePath as e:
            raise ManagerUntrusted(f"{self.key}: {e}") from None
        except OSError as e:  # gone meanwhile (a logout), or her FUSE mount on it (EXDEV)
            why = f"{self.key}: {self.socket_path}: {e.strerror}"
            raise (ManagerUntrusted if e.errno == errno.EXDEV else ManagerError)(why) from None

    def _verify(self, system: Manager | None) -> None:
        """The peer must be uid UID, running as the manager of user@UID.service.

        SO_PEERCRED names the process that listens; /proc/PID/cgroup (the kernel's
        word, not the manager's) must be <...>/user@UID.service/init.scope, where
        systemd --user puts itself; where PID 1 answers, it must also name that
        process as user@UID.service's main process. The manager's root cgroup is
        taken from there, so whatever it reports, it can claim only its own units.
        """
        pid, uid, _gid = peer_credentials(self._bus.get_fd())
        if uid != self.uid:
            raise ManagerUntrusted(
                f"{self.key}: the process on {self.socket_path} is uid {uid}, not {self.uid}"
            )
        self.pid = pid
        if self.key == SYSTEM:
            return
        own = ProcFS(self.proc_root).cgroup(pid) or ""
        root, _, leaf = own.rpartition("/")
        expected = f"user@{self.uid}.service"
        if leaf != "init.scope" or (self.uid and os.path.basename(root) != expected):
            raise ManagerUntrusted(
                f"{self.key}: pid {pid} on {self.socket_path} runs in {own or '?'}, "
                f"not {expected}/init.scope: not this user's systemd"
            )
        self.root_cgroup = root or "/"
        if system is None or not self.uid:
            return
        unit = system.unit_path(expected)
        try:
            main = int(system._get(unit, _SERVICE, b"MainPID", b"u"))
            cgroup = _s(system._get(unit, _SERVICE, b"ControlGroup", b"s"))
        except ManagerSilent:
            raise  # PID 1 busy is no verdict on this manager: asked again next time
        except ManagerError as e:
            raise ManagerUntrusted(f"{self.key}: PID 1 cannot vouch for it: {e}") from None
        if main != pid or cgroup.rstrip("/") != root:
            raise ManagerUntrusted(
                f"{self.key}: pid {pid} in {root} is not {expected} "
                f"(PID 1 says main pid {main}, cgroup {cgroup or '-'})"
            )

    @property
    def persistent_config_dir(self) -> str | None:
        """Where `systemctl edit` puts drop-ins: /etc/systemd/system, ~/.config/systemd/user."""
        for d in self.unit_path_dirs:
            base = os.path.basename(d)
            if base.endswith(".control") or base == "transient" or base.startswith("generator"):
                continue
            return d
        return None

    @property
    def uid(self) -> int:
        return manager_uid(self.key)

    def close(self) -> None:
        if self._bus is not None:
            try:
                self._bus.close()
            finally:
                self._bus = None

    def _get(
        self, path: bytes, iface: bytes, prop: bytes, sig: bytes, bounded: bool = False
    ) -> Any:
        """A property. `bounded`: one a user wrote (ExecStart=, Environment=), refused over
        DETAILS_CAP bytes (pystemd would read it whole, however big, with the GIL held)."""
        if bounded:
            get = (path, b"org.freedesktop.DBus.Properties", b"Get", iface, prop)
            what, reply = f"reading {prop.decode()}", sig.decode()
            return self._wire(what, *get, reply=reply, timeout=DETAILS_TIMEOUT, cap=DETAILS_CAP)
        bus = self._ready(f"reading {prop.decode()}")
        try:
            return bus.get_property(_DEST, path, iface, prop, sig)
        except Exception as e:
            raise self._failed(f"reading {prop.decode()}", e) from None
        finally:
            self._drain()
            self.heartbeat()

    def _ready(self, what: str) -> Any:
        """The bus to call on, unless not connected or silent since a timeout."""
        if self._bus is None:
            raise ManagerError(f"{self.key}: not connected")
        wait = self.silent_until - time.monotonic()
        if wait > 0:
            raise ManagerSilent(
                f"{self.key}: {what}: not asked, a call timed out; asked again in {wait:.0f}s"
            )
        why = paused(self.proc_root, self.pid) if self.key != SYSTEM and self.pid else ""
        if why:
            self.silent_until = time.monotonic() + SILENT_FOR
            raise ManagerSilent(f"{self.key}: {what}: not asked, its manager is {why}")
        if _hung_up(self._bus.get_fd()):
            # Said here, not by a failed call: pystemd 0.11 leaks about 2 kB on every call
            # that fails (measured), and a manager that exits fails the next call of each
            # pass that still holds it: a logout, every time.
            raise ManagerError(f"{self.key}: {what}: the manager closed the connection")
        return self._bus

    def _failed(self, what: str, e: Exception) -> ManagerError:
        if _timed_out(e):
            self.silent_until = time.monotonic() + SILENT_FOR
            return ManagerSilent(f"{self.key}: {what}: no answer within the bus timeout")
        return ManagerError(f"{self.key}: {what}: {e}")

    def _drain(self) -> None:
        """Drop the signals the manager sent meanwhile.

        systemd sends UnitNew/UnitRemoved/JobRemoved... to every client of its
        private socket, subscribed or not (a unit that is not found is loaded and
        dropped again: two signals each time it is asked about). sd-bus keeps
        what a call's wait read past in its queue until someone processes it: at
        one pass every 0.5 s that grew the guard by about 100 MB an hour at boot.
        """
        bus = self._bus
        for _ in range(_DRAIN_MAX):
            try:
                message = bus.process() if bus is not None else None
            except Exception:
                return  # the next call says what is wrong with the connection
            if message is None or message.is_empty():
                return

    def _call(self, method: bytes, sig: bytes, *args: Any) -> Any:
        apply_signature = _dbuslib().apply_signature
        bus = self._ready(method.decode())
        try:
            call_args = apply_signature(sig, list(args)) if sig else []
            # A single out-argument comes back bare, several as a list.
            return bus.call_method(_DEST, _PATH, _MANAGER, method, call_args).body
        except Exception as e:
            raise self._failed(method.decode(), e) from None
        finally:
            self._drain()
            self.heartbeat()

    @staticmethod
    def unit_path(name: str) -> bytes:
        return bytes(_dbuslib().path_encode(b"/org/freedesktop/systemd1/unit", name.encode()))

    def unit_states(self, names: Iterable[str]) -> dict[str, UnitState]:
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return {}
        rows = self._call(b"ListUnitsByNames", b"as", [n.encode() for n in wanted])
        return {
            _s(r[0]): UnitState(_s(r[0]), _s(r[2]), _s(r[3]), _s(r[4]))
            for r in rows
            if _s(r[0]) in wanted
        }

    def _wire(self, what: str, *args: Any, late: bool = False, **how: Any) -> Any:
        """dbuswire.call() on a connection of its own, the GIL free while it waits. No answer:
        silent for SILENT_FOR (30 units of hers cost one deadline), or FreezeLate (`late`)."""
        self._ready(what)
        try:
            with self._socket_dir() as address:
                return dbuswire.call(address, *args, peer_pid=self.pid, **how)
        except dbuswire.WireError as e:
            if late and isinstance(e, dbuswire.NoReply):  # (sent: the manager took it)
                raise FreezeLate(f"{self.key}: {what}: {e}; it may still land") from None
            if dbuswire.timed_out(e):
                self.silent_until = time.monotonic() + SILENT_FOR
                raise ManagerSilent(f"{self.key}: {what}: {e}") from None
            raise ManagerError(f"{self.key}: {what}: {e}") from None
        finally:
            self.heartbeat()

    def unit_details(self, name: str) -> UnitDetails:
        """What a service runs and since when. Environment=: only what foresight reads
        (core/argv/environment.py). A user manager's units are read bounded."""
        path = self.unit_path(name)
        get = functools.partial(self._get, bounded=self.key != SYSTEM)
        exec_start: tuple[tuple[str, ...], ...] = ()
        environment: tuple[str, ...] = ()
        user = ""
        if name.endswith(".service"):
            raw = get(path, _SERVICE, b"ExecStart", b"a(sasbttttuii)")
            # And ExecStartPost=: a preload there (`curl .../api/generate`) is a load the
            # unit asks of its own server, as one in ExecStart= is.
            post = get(path, _SERVICE, b"ExecStartPost", b"a(sasbttttuii)")
            exec_start = _bounded_rows(tuple(_s(a) for a in row[1]) for row in [*raw, *post])
            assignments = (_s(e) for e in get(path, _SERVICE, b"Environment", b"as"))
            environment = needed_environment(assignments, exec_start)
            user = _s(get(path, _SERVICE, b"User", b"s"))
        since_us = int(self._get(path, _UNIT, b"ActiveEnterTimestampMonotonic", b"t"))
        if since_us == 0:  # still activating: it left 'inactive' when the start began
            since_us = int(self._get(path, _UNIT, b"InactiveExitTimestampMonotonic", b"t"))
        return UnitDetails(exec_start, since_us / 1e6 if since_us else None, environment, user)

    def list_units(self) -> list[UnitState]:
        """Every unit loaded in this manager, with its states."""
        rows = self._call(b"ListUnits", b"")
        return [
            UnitState(_s(r[0]), _s(r[2]), _s(r[3]), _s(r[4]))
            for r in rows
            if valid_unit_name(_s(r[0]))
        ]

    def list_unit_files(self) -> dict[str, str]:
        """Unit name -> unit file state (enabled, disabled, static, masked...)."""
        rows = self._call(b"ListUnitFiles", b"")
        names = ((os.path.basename(_s(path)), _s(state)) for path, state in rows)
        return {name: state for name, state in names if valid_unit_name(name)}

    def unit_settings(self, name: str) -> dict[str, Any]:
        """What an audit reads of a service: its limits, ordering and restart policy."""
        path = self.unit_path(name)
        props: dict[str, Any] = {}
        for iface, prop, sig in _AUDIT_PROPS:
            try:
                value = self._get(path, iface, prop, sig)
            except ManagerError:
                continue  # a unit type without it (or an older systemd)
            props[prop.decode()] = (
                [_s(v) for v in value]
                if isinstance(value, list)
                else _s(value)
                if isinstance(value, bytes)
                else value
            )
        return props

    def start_jobs(self) -> list[str]:
        """Units with a start job queued or running: loaders about to start."""
        jobs = ((_s(unit), _s(kind)) for _id, unit, kind, *_ in self._call(b"ListJobs", b""))
        return [unit for unit, kind in jobs if kind in _START_JOBS and valid_unit_name(unit)]

    def default_target(self) -> str:
        return _s(self._call(b"GetDefaultTarget", b""))

    def stop_unit(self, name: str, mode: str = "replace") -> str:
        """Queue a stop job; returns the job's object path."""
        return _s(self._call(b"StopUnit", b"ss", name.encode(), mode.encode()))

    def freeze_unit(self, name: str) -> None:
        """Freeze the unit's cgroup (systemd 246+, cgroup v2 only): the reply comes once the
        kernel has frozen it (FreezeLate past FREEZE_TIMEOUT); a manager without the
        freezer answers with an error."""
        call = (_PATH, _MANAGER, b"FreezeUnit", name.encode())
        self._wire("FreezeUnit", *call, reply=None, timeout=FREEZE_TIMEOUT, cap=1 << 16, late=True)

    def thaw_unit(self, name: str) -> None:
        """Thaw a unit frozen by freeze_unit (the guard's brake, when it did not block it)."""
        self._call(b"ThawUnit", b"s", name.encode())

    def kill_unit(self, name: str, signal: int, whom: str = "all") -> None:
        self._call(b"KillUnit", b"ssi", name.encode(), whom.encode(), signal)

    def reload(self) -> None:
        """daemon-reload: the reply comes once the manager has re-read its units."""
        self._call(b"Reload", b"")

    def unit_file_links(self, name: str) -> list[str]:
        """The symlinks `systemctl disable NAME` would remove, persistent and runtime."""
        links: list[str] = []
        for runtime in (False, True):
            # A transient or generated unit has none: the list is empty.
            found = self._call(b"GetUnitFileLinks", b"sb", name.encode(), runtime)
            links += [_s(p) for p in found]
        return list(dict.fromkeys(links))

    def disable_unit_files(self, name: str) -> list[str]:
        """`systemctl disable NAME` (persistent and runtime links); returns the paths removed."""
        removed: list[str] = []
        for runtime in (False, True):
            changes = self._call(b"DisableUnitFiles", b"asb", [name.encode()], runtime)
            removed += [_s(path) for kind, path, _dest in changes if _s(kind) == "unlink"]
        return removed

    def unit_control_group(self, name: str) -> str:
        """A service's cgroup ('' when it has none, or when it is not below the manager's
        own: a manager can name no one else's processes); the property lives on Service."""
        cgroup = _s(self._get(self.unit_path(name), _SERVICE, b"ControlGroup", b"s"))
        return cgroup if cgroup_within(cgroup, self.root_cgroup) else ""


def discover(system_socket: str, user_runtime: str) -> dict[str, str]:
    """Manager key -> private socket path, for every manager running now."""
    found = {}
    if os.path.exists(system_socket):
        found[SYSTEM] = system_socket
    try:
        uids = sorted(n for n in os.listdir(user_runtime) if n.isascii() and n.isdigit())
    except OSError:
        uids = []
    for uid in uids:  # (never into her FUSE mount over her runtime dir: it may not answer)
        if mounts.present(user_runtime, (uid, "systemd", "private")):
            found[user_manager(int(uid))] = os.path.join(user_runtime, uid, "systemd", "private")
    return found


class ManagerNotRunning(ManagerError):
    """No private socket for that manager: it is not running (a user not logged in)."""


def connect_to(
    key: str, system_socket: str, user_runtime: str, proc_root: str = "/proc"
) -> Manager:
    """A connected, verified Manager for `key` ('system', 'user:UID'); ManagerError if not."""
    found = discover(system_socket, user_runtime)
    path = found.get(key)
    if path is None:
        raise ManagerNotRunning(f"the {key} manager is not running here")
    system = None
    if key != SYSTEM and SYSTEM in found:
        system = Manager(SYSTEM, found[SYSTEM], proc_root)
        with contextlib.suppress(ManagerError):
            system.connect()
    manager = Manager(key, path, proc_root)
    try:
        manager.connect(system if system is not None and system._bus is not None else None)
    finally:
        if system is not None:
            system.close()
    return manager


def peer_credentials(fd: int) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a connected unix socket."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    finally:
        sock.close()
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def cgroup_within(cgroup: str, root: str) -> bool:
    """Whether `cgroup` is `root` or below it."""
    root = root.rstrip("/")
    return bool(cgroup) and (not root or cgroup == root or cgroup.startswith(root + "/"))


def command_manager() -> str:
    """Whose units a bare name means on a command line: root's are PID 1's, a user's their own."""
    return SYSTEM if os.geteuid() == 0 else user_manager(os.geteuid())
