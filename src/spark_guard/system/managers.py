"""Talking to systemd managers on their private sockets, in-process.

PID 1 listens on /run/systemd/private and each user manager on
/run/user/UID/systemd/private. Both are peer-to-peer D-Bus: no dbus-daemon
in the way, so the guard can run before dbus.service and never waits on the
system bus. PID 1 is asked over one pystemd connection, its D-Bus signatures
named (pystemd would introspect: an lxml parse per object, on every load()).

A user's manager is a peer the guard talks to, never one it waits on (issue 40,
H1, H10): each call is dbuswire.call() on a connection of its own, in plain
Python, so the GIL is free while she is slow, every reply is capped, every call
has a deadline, and no signal of hers is left queued between calls (systemd
sends every client of its private socket UnitNew, JobNew, PropertiesChanged...:
on a connection held open, her churn queued 96,000 of them, 167 MiB, for the
next call to read with the GIL held).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util
import os
import select
import sys
import time
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.argv.environment import needed as needed_environment
from ..core.classify import bounded
from ..core.snapshot import ARGV_MAX_BYTES, SYSTEM, manager_uid, user_manager, valid_unit_name
from . import dbuswire, mounts
from .believing import (
    Identity,
    believed,
    handshake,
    peer_credentials,
    socket_address,
    sole_answerer,
)
from .cgroupfs import paused
from .manager_errors import FreezeLate as FreezeLate
from .manager_errors import ManagerError as ManagerError
from .manager_errors import ManagerNotRunning as ManagerNotRunning
from .manager_errors import ManagerSilent as ManagerSilent
from .manager_errors import ManagerUntrusted as ManagerUntrusted

_DEST = b"org.freedesktop.systemd1"
_PATH = b"/org/freedesktop/systemd1"
_MANAGER = b"org.freedesktop.systemd1.Manager"
_UNIT = b"org.freedesktop.systemd1.Unit"
_SERVICE = b"org.freedesktop.systemd1.Service"
_DRAIN_MAX = 4096  # queued messages dropped after one call, at most (each is one process())
_START_JOBS = ("start", "restart", "try-restart", "reload-or-start")
# What unit_details reads: a service's, then any unit's two timestamps.
_DETAILS = (
    (_SERVICE, b"ExecStart", b"a(sasbttttuii)"),
    (_SERVICE, b"ExecStartPost", b"a(sasbttttuii)"),
    (_SERVICE, b"Environment", b"as"),
    (_SERVICE, b"User", b"s"),
    (_UNIT, b"ActiveEnterTimestampMonotonic", b"t"),
    (_UNIT, b"InactiveExitTimestampMonotonic", b"t"),
)
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


# A manager busy past this answers nothing useful in time: the guard moves on
# (cgroup kill, retry later) instead of sd-bus's default 25 s wait.
os.environ.setdefault("SYSTEMD_BUS_TIMEOUT", "5s")
# After a call times out, calls to that manager fail at once for this long: each
# call would wait the whole bus timeout again, and a pass that asks a silent PID 1
# five things would hold the loop 25 s (seen: a daemon-reload of PID 1 under
# memory pressure, then the watchdog). Two bus timeouts: asked every 10 s at most.
SILENT_FOR = 10.0
# A user's unit property (ExecStart=, Environment=): a real one is a few kB, and comes back
# in milliseconds; 60 Environment= lines of 1 MB took systemd 3.7 s to send.
DETAILS_CAP = 256 * 1024
DETAILS_TIMEOUT = 1.0
# A freeze of a cgroup whose processes all run or sleep takes milliseconds (F4).
FREEZE_TIMEOUT = 1.0
# A user manager's call that is not a read of the pass (a stop, a disable, a reload, a
# command's list of every unit): the bus timeout. Lists: a row is a few hundred bytes,
# 10,000 units about 3 MB.
USER_CALL_TIMEOUT = 5.0
LIST_CAP = 16 * 1024 * 1024
# A pass's reads, parsed on the loop: past about 5,000 jobs of hers, the kernel's view.
PASS_CAP = 1024 * 1024
# What each Manager method returns (its one out-argument; not here: nothing), on the wire.
_RETURNS: dict[bytes, str | None] = {
    b"ListUnitsByNames": "a(ssssssouso)",
    b"ListUnits": "a(ssssssouso)",
    b"ListUnitFiles": "a(ss)",
    b"ListJobs": "a(usssoo)",
    b"GetDefaultTarget": "s",
    b"StopUnit": "o",
    b"GetUnitFileLinks": "as",
    b"DisableUnitFiles": "a(sss)",
}
_PASS_READS = (b"ListUnitsByNames", b"ListJobs")


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
        self._bus: Any = None  # PID 1's pystemd connection
        self._wired = False  # a user manager: connected, each call on a connection of its own
        # Her socket file as it was when it was verified (st_dev, st_ino): one listener
        # for that file's life. Another file there is not asked (H4).
        self.socket_id: Identity | None = None
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
        systemd (believing.py). `system`: PID 1's connected manager, when there is one."""
        with socket_address(self.key, self.socket_path, self.uid, None) as (address, ident):
            try:
                peer = handshake(self.key, self.socket_path, address)
            except ManagerSilent:
                self.silent_until = time.monotonic() + SILENT_FOR
                raise
            self.socket_id = ident
            if self.key == SYSTEM:
                bus = _dbuslib().DBusAddress(f"unix:path={address}".encode(), peer_to_peer=True)
                try:
                    bus.open()
                except Exception as e:
                    raise ManagerError(
                        f"{self.key}: cannot connect to {self.socket_path}: {e}"
                    ) from None
                self._bus = bus
                peer = peer_credentials(bus.get_fd())
        self._wired = self.key != SYSTEM
        try:
            # The peer is checked before the first call: a fake that never answers
            # must not hold the guard for the bus timeout.
            vouch = system.main_pid_and_cgroup if system is not None else None
            self.pid, root = believed(
                self.key, self.socket_path, self.uid, peer, self.proc_root, vouch
            )
            self.root_cgroup = root or self.root_cgroup
            # (A user's: answered on a connection only her manager holds the other end of.)
            cgroup = self._get(_PATH, _MANAGER, b"ControlGroup", b"s", vouch=True)
            claimed = _s(cgroup).rstrip("/") or "/"
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
        self._wired = False
        if self._bus is not None:
            try:
                self._bus.close()
            finally:
                self._bus = None

    def _get(
        self, path: bytes, iface: bytes, prop: bytes, sig: bytes, *, vouch: bool = False
    ) -> Any:
        """One property (_props), or the ManagerError that says why not."""
        (value,) = self._props(path, [(iface, prop, sig)], vouch=vouch)
        if isinstance(value, ManagerError):
            raise value
        return value

    def _props(
        self, path: bytes, wanted: Sequence[tuple[bytes, bytes, bytes]], *, vouch: bool = False
    ) -> list[Any]:
        """Properties of object `path`, each (interface, name, signature), in the order
        asked; one the manager refused (a unit type without it) is a ManagerError in its
        place. A user manager's are read on one connection, bounded: each refused over
        DETAILS_CAP bytes (pystemd would read ExecStart= or Environment= whole, however big,
        with the GIL held). `vouch`: on a connection only her manager answers."""
        what = f"reading {wanted[0][1].decode()}" if len(wanted) == 1 else "reading its properties"
        if self._wired:
            get = b"org.freedesktop.DBus.Properties"
            asks = [
                dbuswire.Request(path, get, b"Get", (i, p), reply=t.decode()) for i, p, t in wanted
            ]
            me = (self.key, self.socket_path, self.uid, self.pid, self.proc_root)
            check = sole_answerer(*me, os.path.dirname(self.root_cgroup)) if vouch else None
            answers = self._wire(what, asks, timeout=DETAILS_TIMEOUT, cap=DETAILS_CAP, vouch=check)
            return [
                v if k == "ok" else ManagerError(f"{self.key}: reading {p.decode()}: {v}")
                for (k, v), (_, p, _) in zip(answers, wanted, strict=True)
            ]
        bus = self._ready(what)
        out: list[Any] = []
        try:
            for iface, prop, sig in wanted:
                try:
                    out.append(bus.get_property(_DEST, path, iface, prop, sig))
                except Exception as e:
                    failed = self._failed(f"reading {prop.decode()}", e)
                    if isinstance(failed, ManagerSilent):
                        raise failed from None
                    out.append(failed)
        finally:
            self._drain()
            self.heartbeat()
        return out

    def _ready(self, what: str) -> Any:
        """The bus to call on, unless not connected or silent since a timeout."""
        if self._bus is None and not self._wired:
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
        if self._bus is not None and _hung_up(self._bus.get_fd()):
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
        if self._wired:
            reads = method in _PASS_READS
            timeout, cap = (DETAILS_TIMEOUT, PASS_CAP) if reads else (USER_CALL_TIMEOUT, LIST_CAP)
            ask = dbuswire.Request(
                _PATH, _MANAGER, method, args, sig.decode(), None, _RETURNS.get(method)
            )
            ((kind, value),) = self._wire(method.decode(), [ask], timeout=timeout, cap=cap)
            if kind == "error":
                raise ManagerError(f"{self.key}: {method.decode()}: {value}")
            return value
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

    def _wire(
        self, what: str, asks: list[dbuswire.Request], *, late: bool = False, **how: Any
    ) -> list[tuple[str, Any]]:
        """dbuswire.calls() on a connection of its own, the GIL free while it waits: each
        answer, ("ok", value) or ("error", what the manager said). No answer, or a list over
        its cap (her 30,000 jobs): silent for SILENT_FOR, so thirty units of hers cost one
        deadline; or FreezeLate (`late`)."""
        self._ready(what)
        try:
            where = (self.key, self.socket_path, self.uid, self.socket_id)
            with socket_address(*where) as (address, _):
                return dbuswire.calls(address, asks, peer_pid=self.pid, **how)
        except dbuswire.WireError as e:
            if late and isinstance(e, dbuswire.NoReply):  # (sent: the manager took it)
                raise FreezeLate(f"{self.key}: {what}: {e}; it may still land") from None
            if dbuswire.timed_out(e) or (isinstance(e, dbuswire.TooBig) and not asks[0].args):
                self.silent_until = time.monotonic() + SILENT_FOR
                raise ManagerSilent(f"{self.key}: {what}: {e}") from None
            raise ManagerError(f"{self.key}: {what}: {e}") from None
        finally:
            self.heartbeat()

    def unit_details(self, name: str) -> UnitDetails:
        """What a service runs and since when. Environment=: only what foresight reads
        (core/argv/environment.py). A user manager's units are read bounded."""
        service = name.endswith(".service")
        values = self._props(self.unit_path(name), _DETAILS if service else _DETAILS[-2:])
        for value in values:
            if isinstance(value, ManagerError):
                raise value
        since_us = int(values[-2]) or int(values[-1])  # 0: activating, since it left inactive
        since = since_us / 1e6 if since_us else None
        if not service:
            return UnitDetails((), since)
        raw, post, assignments, user = values[:4]
        # ExecStartPost= too: a preload there (`curl .../api/generate`) is a load the unit
        # asks of its own server, as one in ExecStart= is.
        exec_start = _bounded_rows(tuple(_s(a) for a in row[1]) for row in [*raw, *post])
        environment = needed_environment((_s(e) for e in assignments), exec_start)
        return UnitDetails(exec_start, since, environment, _s(user))

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
        props: dict[str, Any] = {}
        values = self._props(self.unit_path(name), _AUDIT_PROPS)
        for (_, prop, _), value in zip(_AUDIT_PROPS, values, strict=True):
            if isinstance(value, ManagerError):
                continue  # a unit type without it (or an older systemd); silence raises
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
        ask = dbuswire.Request(_PATH, _MANAGER, b"FreezeUnit", (name,))
        how: dict[str, Any] = {"timeout": FREEZE_TIMEOUT, "cap": 1 << 16, "late": True}
        ((kind, said),) = self._wire("FreezeUnit", [ask], **how)
        if kind == "error":
            raise ManagerError(f"{self.key}: FreezeUnit: {said}")

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

    def main_pid_and_cgroup(self, name: str) -> tuple[int, str]:
        """A service's MainPID and ControlGroup, as this manager says them (PID 1 vouching
        for a user's manager: believing.believed)."""
        unit = self.unit_path(name)
        main = int(self._get(unit, _SERVICE, b"MainPID", b"u"))
        return main, _s(self._get(unit, _SERVICE, b"ControlGroup", b"s"))

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


def cgroup_within(cgroup: str, root: str) -> bool:
    """Whether `cgroup` is `root` or below it."""
    root = root.rstrip("/")
    return bool(cgroup) and (not root or cgroup == root or cgroup.startswith(root + "/"))


def command_manager() -> str:
    """Whose units a bare name means on a command line: root's are PID 1's, a user's their own."""
    return SYSTEM if os.geteuid() == 0 else user_manager(os.geteuid())
