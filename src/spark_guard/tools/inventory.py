"""Every service unit on the machine that an admin must know about, on every level.

From each running manager (PID 1 and every user manager) over its private
socket: loaded units and unit files, and for services, the settings an audit
checks. Users with linger whose manager is not running (yet) are read from
their unit files on disk, so a loader that will start at the next boot is
seen today. Those files are the user's: they are listed and read with the
user's own file rights (safefs.as_user), only as regular files and only up
to UNIT_FILE_MAX bytes, so a unit file linked to /dev/zero, a FIFO or a
file that never ends is one error line in the report, not a hang or an
exhausted memory. Containers are read from each container engine's
API socket in the config (`[containers] engines`): every container inspected,
the loaders kept with their evidence (containers.loader_evidence). Sensing
only: the judgement is audit.py's.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..containers import loader_evidence
from ..core.classify import classify
from ..core.config import Config
from ..core.quantities import parse_duration, parse_size
from ..core.snapshot import (
    SYSTEM,
    Loader,
    SeenUnit,
    Snapshot,
    UnitRef,
    manager_uid,
    parse_ref,
    user_manager,
)
from ..core.text import printable
from ..system.connecting import connect_all
from ..system.engine import Container, Engine, EngineError
from ..system.managers import Manager, ManagerError, ManagerSilent, discover
from ..system.safefs import UnsafePath, as_user, read_regular

INFINITY = 2**64 - 1  # systemd's "infinity" for MemoryMax= and friends
USER_UNIT_DIRS = (".config/systemd/user", ".local/share/systemd/user")
UNIT_FILE_MAX = 1 << 20  # a unit file or drop-in: real ones hold a few kB
DIR_ENTRIES_MAX = 4096  # entries read from one of a user's unit directories


@dataclass(frozen=True)
class UnitInfo:
    ref: UnitRef
    user: str  # owner of the manager ("" for the system)
    load_state: str
    active_state: str
    file_state: str  # enabled, disabled, static, masked-runtime, ...
    exec_start: tuple[tuple[str, ...], ...] = ()
    environment: tuple[str, ...] = ()
    memory_max: int = INFINITY
    after: tuple[str, ...] = ()
    restart: str = "no"
    restart_sec: float = 0.1
    start_limit_burst: int = 5
    start_limit_interval: float = 10.0
    n_restarts: int = 0
    fragment: str = ""
    drop_ins: tuple[str, ...] = ()
    from_files: bool = False  # read from disk: its manager is not running
    service_user: str = ""  # User= ("": the manager's own user)


@dataclass(frozen=True)
class Linger:
    user: str
    uid: int
    running: bool  # its manager is up now


@dataclass
class Inventory:
    loaders: list[UnitInfo] = field(default_factory=list)
    failed: list[UnitInfo] = field(default_factory=list)
    lingering: list[Linger] = field(default_factory=list)
    managers: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # names asked for that exist nowhere
    named: list[UnitInfo] = field(default_factory=list)  # units asked for by name
    errors: list[str] = field(default_factory=list)  # managers or files that could not be read
    unreached: list[str] = field(default_factory=list)  # managers not reached or not believed


def _user_of(key: str) -> str:
    if key == SYSTEM:
        return ""
    uid = manager_uid(key)
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _info(manager: Manager, name: str, load: str, active: str, file_state: str) -> UnitInfo:
    details = manager.unit_details(name)
    p: dict[str, Any] = manager.unit_settings(name)
    return UnitInfo(
        ref=UnitRef(manager.key, name),
        user=_user_of(manager.key),
        load_state=load,
        active_state=active,
        file_state=str(p.get("UnitFileState") or file_state),
        exec_start=details.exec_start,
        environment=details.environment,
        memory_max=int(p.get("MemoryMax", INFINITY)),
        after=tuple(p.get("After", ())),
        restart=str(p.get("Restart", "no")),
        restart_sec=int(p.get("RestartUSec", 100_000)) / 1e6,
        start_limit_burst=int(p.get("StartLimitBurst", 5)),
        start_limit_interval=int(p.get("StartLimitIntervalUSec", 10_000_000)) / 1e6,
        n_restarts=int(p.get("NRestarts", 0)),
        fragment=str(p.get("FragmentPath", "")),
        drop_ins=tuple(p.get("DropInPaths", ())),
        service_user=details.user,
    )


def is_loader(info: UnitInfo, config: Config) -> bool:
    seen = SeenUnit(info.ref, info.active_state, exec_start=info.exec_start)
    return classify(seen, config) is not None


UNREAD_MAX = 16  # units of one manager that could not be read before its listing ends
# A user's manager's units are read within this (each unit a dozen calls): past it, she is
# not listed whole, and her running loaders are judged by what the kernel shows (H9:
# thousands of files of hers held rescue back from PID 1's loaders and her running one).
USER_SECONDS = 10.0


def _from_manager(manager: Manager, config: Config, inv: Inventory, wanted: set[str]) -> None:
    """Its units, read into `inv`. One that cannot be read (her Environment= over the
    cap) does not end the listing of the others; the first such error is raised once
    all are read, so the manager does not count as listed whole; so is a user's manager
    whose units are not read within USER_SECONDS."""
    deadline = time.monotonic() + (USER_SECONDS if manager.uid else float("inf"))
    states = {u.name: u for u in manager.list_units()}
    files = manager.list_unit_files()
    names = {n for n in states if n.endswith(".service")}
    names |= {n for n in files if n.endswith(".service") and "@." not in n}
    unread: list[ManagerError] = []

    def first(name: str) -> tuple[bool, bool, str]:
        """Asked for by name, then what runs, then the rest: her padding waits."""
        st = states.get(name)
        return (name not in wanted, st is None or st.active_state == "inactive", name)

    for done, name in enumerate(sorted(names | wanted, key=first)):
        if time.monotonic() > deadline:
            raise ManagerError(
                f"{manager.key}: not listed whole within {USER_SECONDS:g}s "
                f"({done} of {len(names | wanted)} units read)"
            )
        st = states.get(name)
        load = st.load_state if st else ("not-found" if name not in files else "not-loaded")
        active = st.active_state if st else "inactive"
        if name in wanted and load == "not-found":
            # Ask the manager itself: a unit neither loaded nor in a listed file.
            probe = manager.unit_states([name]).get(name)
            load = probe.load_state if probe else "not-found"
            if load == "not-found":
                continue
        try:
            info = _info(manager, name, load, active, files.get(name, ""))
        except ManagerSilent:
            raise  # the manager itself does not answer: no use asking it of the rest
        except ManagerError as e:
            unread.append(e)
            if len(unread) > UNREAD_MAX:
                raise
            continue
        if name in wanted:
            inv.named.append(info)
        if is_loader(info, config):
            inv.loaders.append(info)
        elif active == "failed":
            inv.failed.append(info)
    for st in states.values():
        if not st.name.endswith(".service") and st.active_state == "failed":
            inv.failed.append(
                UnitInfo(
                    UnitRef(manager.key, st.name),
                    _user_of(manager.key),
                    st.load_state,
                    st.active_state,
                    files.get(st.name, ""),
                )
            )
    if unread:
        raise unread[0]


# --- users with linger whose manager is not running: their unit files on disk --------


def parse_unit_file(text: str) -> dict[str, list[str]]:
    """'Section.Key' -> values in order; an empty assignment resets (as systemd reads lists)."""
    out: dict[str, list[str]] = {}
    section = ""
    lines = text.replace("\\\n", " ").splitlines()
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep:
            continue
        k = f"{section}.{key.strip()}"
        value = value.strip()
        if value == "":
            out[k] = []
        else:
            out.setdefault(k, []).append(value)
    return out


def _seconds(value: str, default: float) -> float:
    try:
        return parse_duration(value.replace(" ", ""))
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return default


def _size(value: str) -> int:
    if value in ("", "infinity"):
        return INFINITY
    try:
        return parse_size(value)
    except ValueError:
        return INFINITY


class _UserFiles:
    """A user's unit directories, listed and read with that user's rights, bounded."""

    def __init__(self, user: pwd.struct_passwd, inv: Inventory) -> None:
        self.uid, self.gid = user.pw_uid, user.pw_gid
        self.inv = inv

    def _problem(self, path: str, e: OSError) -> None:
        if isinstance(e, UnsafePath):  # its text names the path already
            self.inv.errors.append(f"{e.strerror} (not read)")
        else:
            self.inv.errors.append(f"{path}: {e.strerror}")

    def listdir(self, path: str, *, quiet: bool = True) -> list[str]:
        """Its entries, sorted; [] when it is not there (said unless `quiet`)."""
        names: list[str] = []
        try:
            with as_user(self.uid, self.gid), os.scandir(path) as it:
                for entry in it:
                    if len(names) >= DIR_ENTRIES_MAX:
                        self.inv.errors.append(
                            f"{path}: more than {DIR_ENTRIES_MAX} entries; the rest not read"
                        )
                        break
                    names.append(entry.name)
        except OSError as e:
            if not quiet or not isinstance(e, (FileNotFoundError, NotADirectoryError)):
                self._problem(path, e)
        return sorted(names)

    def isdir(self, path: str) -> bool:
        with as_user(self.uid, self.gid):
            return os.path.isdir(path)

    def read(self, path: str) -> str | None:
        """A unit file's text; None (and an error line) when it is no regular file of sane size."""
        try:
            with as_user(self.uid, self.gid):
                data = read_regular(path, UNIT_FILE_MAX + 1)
        except OSError as e:
            self._problem(path, e)
            return None
        if len(data) > UNIT_FILE_MAX:
            self.inv.errors.append(f"{path}: larger than {UNIT_FILE_MAX} bytes (not read)")
            return None
        return data.decode("utf-8", errors="replace")


def _from_files(user: pwd.struct_passwd, config: Config, inv: Inventory) -> None:
    key = user_manager(user.pw_uid)
    files = _UserFiles(user, inv)
    enabled: set[str] = set()
    sources: dict[str, str] = {}
    for rel in USER_UNIT_DIRS:
        d = os.path.join(user.pw_dir, rel)
        for entry in files.listdir(d):
            path = os.path.join(d, entry)
            if entry.endswith((".wants", ".requires")) and files.isdir(path):
                enabled.update(files.listdir(path, quiet=False))
            elif entry.endswith(".service") and "@." not in entry:
                sources.setdefault(entry, path)  # ~/.config outranks ~/.local/share
    for name, path in sorted(sources.items()):
        text = files.read(path)
        if text is None:
            continue
        unit = parse_unit_file(text)
        drop_dir = os.path.join(os.path.dirname(path), f"{name}.d")
        for conf in files.listdir(drop_dir):
            if conf.endswith(".conf"):
                more = files.read(os.path.join(drop_dir, conf))
                for k, v in parse_unit_file(more or "").items():
                    unit[k] = v if v else []

        def last(k: str, default: str = "", unit: dict[str, list[str]] = unit) -> str:
            values = unit.get(k) or [default]
            return values[-1]

        info = UnitInfo(
            ref=UnitRef(key, name),
            user=user.pw_name,
            load_state="not-loaded",
            active_state="inactive",
            file_state="enabled" if name in enabled else "disabled",
            exec_start=tuple(
                tuple(v.lstrip("-@+!:").split()) for v in unit.get("Service.ExecStart", [])
            ),
            environment=tuple(unit.get("Service.Environment", [])),
            memory_max=_size(last("Service.MemoryMax")),
            after=tuple(w for v in unit.get("Unit.After", []) for w in v.split()),
            restart=last("Service.Restart", "no"),
            restart_sec=_seconds(last("Service.RestartSec", "100ms"), 0.1),
            start_limit_burst=int(last("Unit.StartLimitBurst", "5") or 5),
            start_limit_interval=_seconds(last("Unit.StartLimitIntervalSec", "10s"), 10.0),
            fragment=path,
            from_files=True,
            service_user=last("Service.User"),
        )
        if is_loader(info, config):
            inv.loaders.append(info)


def lingering(linger_dir: str, running: Iterable[str]) -> list[Linger]:
    out: list[Linger] = []
    keys = set(running)
    try:
        names = sorted(os.listdir(linger_dir))
    except OSError:
        return out
    for name in names:
        try:
            uid = pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
        out.append(Linger(name, uid, user_manager(uid) in keys))
    return out


def unlisted(snapshot: Snapshot, config: Config, reached: Collection[str]) -> tuple[Loader, ...]:
    """The loaders the kernel shows and no manager reached lists (issue 40, H5): a user's
    processes that are no unit (SeenUnit.group), and the units of a user whose manager is
    out of view or not answering, judged as the daemon judges them, by what the kernel
    shows. Root's tools name them, and never give an all-clear past them."""
    return tuple(
        loader
        for seen in snapshot.units
        if (seen.group or seen.ref.manager not in (*reached, SYSTEM))
        and not seen.ref.is_container
        and (loader := classify(seen, config, snapshot.guard_unit)) is not None
    )


def collect(config: Config, names: Iterable[str] = ()) -> Inventory:
    inv = Inventory()
    wanted_refs = [parse_ref(n, "") for n in names]  # "": on whichever manager has it
    managers, inv.unreached = connect_all(discover(config.system_manager, config.user_runtime))
    inv.errors += inv.unreached
    for key, manager in managers.items():
        try:
            wanted = {r.name for r in wanted_refs if r.manager in (key, "")}
            _from_manager(manager, config, inv, wanted)
            inv.managers.append(key)
        except ManagerError as e:
            inv.errors.append(str(e))
            inv.unreached.append(str(e))
        finally:
            manager.close()
    inv.lingering = lingering(config.linger, inv.managers)
    for linger in inv.lingering:
        if not linger.running:
            _from_files(pwd.getpwnam(linger.user), config, inv)
    found = {str(u.ref) for u in inv.named} | {u.ref.name for u in inv.named}
    inv.missing = [
        n
        for n, r in zip(names, wanted_refs, strict=True)
        if str(r) not in found and (r.manager or r.name not in found)
    ]
    return inv


# --- containers: each engine's loader containers ------------------------------------------


@dataclass(frozen=True)
class ContainerInfo:
    """A loader container, as its engine's inspect answer says, and why it is one."""

    engine: str  # the engine's API socket it was read from
    container: Container
    evidence: tuple[str, ...]  # containers.loader_evidence: never empty here


@dataclass(frozen=True)
class EngineProblem:
    """An engine socket that is there but did not answer as it should."""

    socket: str
    reason: str  # the EngineError's text without the socket's name: "CALL: reason"


@dataclass
class ContainerInventory:
    loaders: list[ContainerInfo] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)  # sockets whose every answer was read
    errors: list[EngineProblem] = field(default_factory=list)


def _reason(e: EngineError, socket: str) -> str:
    text = str(e)
    head = f"{printable(socket, 256)}: "
    return text[len(head) :] if text.startswith(head) else text


def collect_containers(config: Config) -> ContainerInventory:
    """The loader containers of every engine in `config.engines`, each call bounded by
    `config.engine_timeout`. A socket that is not there is no engine on this machine and is
    passed over; one that fails is one EngineProblem, with the loaders read before it failed.
    A container gone between the list and its inspection is passed over too."""
    out = ContainerInventory()
    if not config.containers:
        return out
    for path in dict.fromkeys(config.engines):
        if not os.path.exists(path):
            continue
        engine = Engine(path, timeout=config.engine_timeout)
        loaders: list[ContainerInfo] = []
        try:
            for listed in engine.containers():
                try:
                    container = engine.inspect(listed.id)
                except EngineError as e:
                    if e.status == 404:
                        continue
                    raise
                evidence = loader_evidence(container, config.loader_binaries)
                if evidence:
                    loaders.append(ContainerInfo(path, container, evidence))
        except EngineError as e:
            out.errors.append(EngineProblem(path, _reason(e, path)))
        else:
            out.engines.append(path)
        out.loaders += sorted(loaders, key=lambda i: i.container.ref)
    return out


# --- each loader's footprint, foreseen as the guard foresees it -----------------------------


def foresee(inv: Inventory, mem_total: int, predictor: Any = None) -> dict[UnitRef, Any]:
    """Each loader's Prediction (None: no rule reads its command line), as the sensor makes
    it: a client's (`lms load`, `ollama run`, a curl preload) where its load lands, with the
    Ollama server units of the inventory; anything else by its command line. Models are read
    off this thread with the unit owner's file rights, bounded, as the guard reads them."""
    from ..core.argv.servers import OLLAMA
    from ..core.classify import command_line
    from ..foresight.clients import ServerUnit, predict_client
    from ..foresight.predict import Predictor, owner_of, parse_environment

    predictor = predictor or Predictor()
    servers = [
        ServerUnit(u.ref.manager, u.exec_start, parse_environment(u.environment), u.service_user)
        for u in inv.loaders
        if any(command_line(c).serves == OLLAMA for c in u.exec_start)
    ]
    out: dict[UnitRef, Any] = {}
    for u in inv.loaders:
        env = parse_environment(u.environment)
        out[u.ref] = predict_client(
            predictor,
            u.exec_start,
            env,
            mem_total,
            manager=u.ref.manager,
            user=u.service_user,
            servers=servers,
            wait=True,
        ) or predictor.predict(u.exec_start, env, mem_total, owner=owner_of(u.ref.manager))
    return out
