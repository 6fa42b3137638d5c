"""Sense: gather one Snapshot from /proc, NVML and the systemd managers.

Holds what must outlive one reading (connections, per-unit caches); what the
guard remembers for its judgement is step.GuardState, not here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from .containers import image_evidence
from .core import attribution
from .core.argv.engines import COMPOSE_PROJECT_LABEL, project_name
from .core.argv.servers import OLLAMA
from .core.attribution import attribute
from .core.classify import CommandLine, is_protected
from .core.config import Config
from .core.events import Event, EventKind, tell
from .core.room import AS_MADE, RoomView
from .core.snapshot import (
    ARGV_OWNER_BUDGET,
    ARGV_PASS_BUDGET,
    ARGV_UNIT_BUDGET,
    CONTAINER,
    CONTAINER_PREFIX,
    MAPS_MAX_MODELS,
    SYSTEM,
    USER_PREFIX,
    ContainerFacts,
    Foreseen,
    Memory,
    MemoryRule,
    RescueGroup,
    SeenUnit,
    Snapshot,
    UnitRef,
    judged,
    user_manager,
    valid_name,
)
from .foresight.clients import ServerUnit, predict_client
from .foresight.containers import predict_container
from .foresight.predict import Prediction, Predictor, owner_of, parse_environment
from .system.connecting import Connecting
from .system.containerwatch import PENDING, ContainerWatch, container_cgroup
from .system.engine import Container, container_id, scope_container_id
from .system.gpu import GpuWatch, unified_memory
from .system.managers import (
    Manager,
    ManagerError,
    ManagerSilent,
    ManagerUntrusted,
    UnitDetails,
    discover,
)
from .system.procfs import ProcFS

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

MAPS_RECHECK = 5.0  # seconds between re-reads of one process's maps
MAPS_MIN_RSS = 256 * 1024**2  # smaller processes are not worth a maps scan
# A maps scan of 65,000 mappings takes ~26 ms: at most this many a pass, biggest first,
# and at most this many processes' mapped models held per manager (16 paths each).
MAPS_SCANS_PER_PASS = 8
MAPS_HELD_PER_OWNER = 32
# A user's unit details held (ExecStart= within 64 KiB and 16 KiB of Environment= each):
# a real loader's are a few kB; 40 units of hers at the per-unit caps, 3 MiB.
DETAILS_OWNER_BUDGET = 1 << 20
DETAILS_RETRY = 30.0  # seconds before a unit whose details could not be read is asked again
# A process whose argv is still systemd's own, between its fork and the exec of the unit's
# command (its manager's argv, renamed "(llama-server)" before systemd 255; 255's
# systemd-executor): not kept, or its pid would keep it for life.
TRANSIENT_ARGV0 = ("systemd-executor", "systemd", "init")
FORESEE_RETRY = 5.0  # seconds before a footprint found unknown is foreseen again
COMMAND_GPU_DEADLINE = 10.0  # a command waits this long for NVML (an init can take seconds)
UNTRUSTED_RETRY = 10.0  # seconds before a manager that failed verification is tried again
# How long a command (or the daemon's first pass) waits for managers to connect: one
# bus timeout and a little. The daemon's later passes never wait: they adopt what is in.
CONNECT_WAIT = 6.0
# A user manager's cgroup as PID 1 makes it: slices, then user@UID.service.


@dataclass
class _UnitCache:
    details: UnitDetails | None = None
    prediction: Prediction | None = None
    predicted: bool = False
    pids: frozenset[int] = frozenset()
    used: int = 0
    at: float = 0.0
    # ExecStart= read once per run (bounded, split): no pass splits it again.
    commands: tuple[CommandLine, ...] | None = None
    # When this run was first seen (a container's: its engine's StartedAt is wall-clock).
    since: float = 0.0
    details_bytes: int = 0  # what `details` holds of its writer's text
    # Details unreadable, or a footprint found unknown: when they are asked for again.
    retry_at: float = 0.0
    # Its manager was out of view when it was first seen (the normal case at boot: a
    # linger user's manager starts beside the guard): judged on its processes' argv, as
    # a group is, and read afresh from the manager once it answers. Nothing learnt then
    # is final.
    kernel_view: bool = False
    read_at: float = 0.0  # seen by the kernel, its manager failed to answer: asked again then
    # The processes' argv a prediction was made from (a group's, or a unit seen in the
    # kernel's view): a footprint not known from them is foreseen again when they change
    # (a wrapper that execs its server, a second process that names the model).
    foreseen_from: tuple[tuple[str, ...], ...] = ()
    argv: tuple[CommandLine, ...] = ()  # its processes' argv as last read


@dataclass
class _ProcCache:
    cmdline: CommandLine | None = None  # read and split once per process
    argv_bytes: int = 0  # what it holds, or would: 0 until read
    models: tuple[str, ...] = ()
    maps_at: float = -MAPS_RECHECK
    # Its real uid (status): read at first sight; a user's cannot change without root's
    # help, root's can (cron's child turns into her job), so root's is read again once
    # the process is big and whenever its command line is read.
    uid: int | None = None
    # Whose entry this is: a PID reused by another process (a fork storm wraps pid_max
    # within a pass) must not inherit its cmdline, uid or models. A new cgroup resets it,
    # and a big process's start time is checked every pass (_fresh).
    cgroup: str = ""
    start: int | None = None
    reread: bool = False  # its argv was systemd's, before the exec: read again next pass


def _smaller(new: Prediction, old: Prediction | None) -> bool:
    """A new footprint below one known before (or none where one was known)."""
    return old is not None and old.bytes is not None and (new.bytes or 0) < old.bytes


class _PassBudget:
    """What one pass may read and hold of what users control: argv bytes per unit, per
    manager and in all (snapshot.py's ARGV_*_BUDGET), maps scans, and processes whose
    mapped models are held per manager. What is over it is not read, or dropped, and
    asked again next pass, when the unit's biggest processes come first."""

    def __init__(self) -> None:
        self.left = ARGV_PASS_BUDGET
        self.by_owner: dict[str, int] = {}
        # Maps: scans this pass, and processes whose mapped models are held per manager.
        self.maps_scans = MAPS_SCANS_PER_PASS
        self.maps_held: dict[str, int] = {}
        # Unit details (ExecStart=, Environment=) the unit caches hold, per manager.
        self.details_held: dict[str, int] = {}

    def hold_maps(self, owner: str) -> bool:
        held = self.maps_held.get(owner, 0)
        if held >= MAPS_HELD_PER_OWNER:
            return False
        self.maps_held[owner] = held + 1
        return True

    def unit(self, owner: str) -> int:
        return min(ARGV_UNIT_BUDGET, self.left, self.by_owner.get(owner, ARGV_OWNER_BUDGET))

    def spend(self, owner: str, n: int) -> None:
        self.left -= n
        self.by_owner[owner] = self.by_owner.get(owner, ARGV_OWNER_BUDGET) - n


class Sensor:
    """Sense: reads /proc, NVML and the systemd managers into one Snapshot per full look.

    Owns what outlives one reading: the manager connections (made and verified
    off the loop), per-unit and per-process caches (a unit's growth is measured
    against its last reading) and the model-file Predictor. What the guard
    remembers for its judgement (the trend, the boot latch) is step.GuardState.
    The Guard calls snapshot(); the Blocker acts through the same managers.
    """

    def __init__(
        self,
        config: Config,
        log: FilteringBoundLogger,
        clock: Callable[[], float] = time.monotonic,
        *,
        heartbeat: Callable[[], None] | None = None,
        on_answer: Callable[[], None] | None = None,
    ) -> None:
        """`on_answer`: called from a worker thread when a model read, a manager's connection
        or a container engine has answered (the daemon wakes its loop for a full look)."""
        self.config = config
        self.log = log
        self.clock = clock
        self.heartbeat = heartbeat  # given to every Manager: after each call that came back
        self.proc = ProcFS(config.proc)
        self.managers: dict[str, Manager] = {}
        self._untrusted: dict[str, tuple[float, str]] = {}  # key -> (retry at, why)
        # key -> monotonic time: a call to that manager timed out; not reconnected before.
        self._silent: dict[str, float] = {}
        self._connecting: dict[str, Connecting] = {}
        self._found: dict[str, str] = {}  # the last discover(): key -> socket
        # One call may time out per pass (_in_turn): whether one did, and the managers left
        # out of this pass and the last one for it.
        self._timed_out = False
        self._answered: set[str] = set()  # asked in this pass (and answered, or dropped)
        self._left_out: set[str] = set()
        self._left_out_now: set[str] = set()
        self._on_answer = on_answer or (lambda: None)
        # NVML is asked off the loop, within a deadline (gpu.py): a hung GPU cannot hold it.
        self.gpu = GpuWatch(retry=config.gpu_retry, deadline=config.gpu_deadline)
        self.predictor = Predictor(on_ready=on_answer)
        # Container engines are asked off the loop (system/containerwatch.py) what a
        # container's cgroup is; answers wake the loop as a manager's do.
        self.containers = ContainerWatch(
            config.engines if config.containers else (),
            config.engine_timeout,
            on_answer=self._on_answer,
            docker_root=config.docker_root,
            user_engines=config.user_engines if config.containers else (),
            user_runtime=config.user_runtime,
        )
        self._container_of: dict[UnitRef, tuple[Container, str]] = {}
        # The loop never waits on a model read; a command (sense_once) does, up to its deadline.
        self.wait_for_models = False
        self.started = clock()
        self.guard_unit: UnitRef | None = None
        self._units: dict[UnitRef, _UnitCache] = {}
        self._procs: dict[int, _ProcCache] = {}
        self._rescue_since: dict[str, float] = {}
        self.rescue_groups: list[tuple[str, ...]] = []
        self._graphical_checked = False
        self._engine_said: dict[str, str] = {}
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded config; paths (proc, sockets) keep their start-up values."""
        self.config = config
        self.gpu.retry, self.gpu.deadline = config.gpu_retry, config.gpu_deadline
        self.rescue_groups = [tuple(g.split("|")) for g in config.rescue_units]
        self._graphical_checked = False
        self._add_graphical()

    # --- managers -------------------------------------------------------

    def refresh_managers(self, wait: float = CONNECT_WAIT) -> None:
        """Forget managers gone; start connecting those that appeared (boot, linger, login).

        Connections are made off the loop (managers.Connecting); `wait` is how long
        to wait for them here (a command, the first pass), 0 for the daemon's loop,
        which takes them in at its next full look (adopt_managers)."""
        found = discover(self.config.system_manager, self.config.user_runtime)
        self._found = found
        for key in [k for k in self.managers if k not in found]:
            self._drop(key, "socket gone")
        now = self.clock()
        for key, sock in found.items():
            if key in self.managers or key in self._connecting:
                continue
            if now < self._untrusted.get(key, (0.0, ""))[0]:
                continue
            if time.monotonic() < self._silent.get(key, 0.0):
                continue  # it timed out a moment ago: asked again once its silence is over
            system = found.get(SYSTEM) if key != SYSTEM else None
            self._connecting[key] = Connecting(key, sock, self.config.proc, system, self._on_answer)
        if wait > 0:
            deadline = time.monotonic() + wait
            for pending in list(self._connecting.values()):
                pending.wait(deadline - time.monotonic())
        self.adopt_managers()

    def adopt_managers(self) -> None:
        """Take in the connections that have an answer: believed, refused or silent."""
        before = set(self.managers)
        now = self.clock()
        for key, pending in list(self._connecting.items()):
            if not pending.done:
                continue
            del self._connecting[key]
            m, e = pending.manager, pending.error
            if isinstance(e, ManagerUntrusted):
                # Said once per reason, then asked again only now and then.
                if self._untrusted.get(key, (0.0, ""))[1] != str(e):
                    tell(
                        self.log,
                        Event.of(
                            EventKind.MANAGER_UNTRUSTED,
                            "warning",
                            manager=key,
                            error=str(e),
                            msg=f"not believed: {e}",
                        ),
                    )
                self._untrusted[key] = (now + UNTRUSTED_RETRY, str(e))
                continue
            if e is not None:
                self._note_silence(m)
                tell(
                    self.log,
                    Event.of(
                        EventKind.MANAGER_LOST, "debug", manager=key, error=str(e), msg=str(e)
                    ),
                )
                continue
            if key not in self._found:
                m.close()  # gone while it was connected
                continue
            m.heartbeat = self.heartbeat or m.heartbeat
            self._untrusted.pop(key, None)
            self._silent.pop(key, None)
            self.managers[key] = m
            tell(
                self.log,
                Event.of(
                    EventKind.MANAGER_CONNECTED,
                    "info",
                    manager=key,
                    socket=m.socket_path,
                    cgroup=m.root_cgroup,
                    msg=f"watching {key} manager",
                ),
            )
        if set(self.managers) != before or self.guard_unit is None:
            self._find_self()  # our own unit can only change with the set of managers
        self._add_graphical()

    def _note_silence(self, m: Manager) -> None:
        if m.silent_until > time.monotonic():
            self._silent[m.key] = m.silent_until

    def _drop(self, key: str, why: str) -> None:
        m = self.managers.pop(key, None)
        if m is not None:
            self._note_silence(m)
            m.close()
            tell(
                self.log,
                Event.of(
                    EventKind.MANAGER_LOST,
                    "info",
                    manager=key,
                    error=why,
                    msg=f"{key} manager: {why}",
                ),
            )
        # Her units' caches stay: what her manager said of a unit still running holds while
        # it is out of view, and a unit it could not send (a 60 MB Environment=) is asked
        # again at its retry_at, not at every reconnection (each one silenced her manager
        # for SILENT_FOR again: out of view for good). A unit gone goes with its pass.

    def _find_self(self) -> None:
        """The guard's own unit, so it is never acted on and its manager holds the rescue units."""
        own = self.proc.cgroup_of_self()
        best = attribute(own, self._roots()) if own else None
        self.guard_unit = UnitRef(*best) if best else None

    def _rescue_manager(self) -> Manager | None:
        key = self.guard_unit.manager if self.guard_unit else SYSTEM
        return self.managers.get(key) or self.managers.get(SYSTEM)

    def _add_graphical(self) -> None:
        mode = self.config.rescue_graphical
        m = self._rescue_manager()
        if self._graphical_checked or mode == "no" or m is None:
            return
        self._graphical_checked = True
        try:
            graphical = mode == "yes" or m.default_target() == "graphical.target"
        except ManagerError:
            self._graphical_checked = False
            return
        if graphical and ("graphical.target",) not in self.rescue_groups:
            self.rescue_groups.append(("graphical.target",))

    def _container_id(self, cgroup: str, engines: bool) -> tuple[int, str | None]:
        """(whose engine, the container's id) of a process's cgroup: root's engines' below
        any slice but a user's; below her user@UID.service, a scope her rootless engine had
        her manager make (asked of her engines only)."""
        if engines:
            cid = container_id(cgroup)
            if cid is not None:
                return 0, cid
        if not self.containers.user_engines:
            return 0, None
        tree = attribution.user_tree(cgroup)
        if tree is None or tree[1] == 0:
            return 0, None
        base, uid = tree
        return uid, scope_container_id(cgroup[len(base) :])

    def _fresh(self, pid: int, cgroup: str, rss: int) -> None:
        """Forget what was read of `pid` if it is another process now: its cgroup changed,
        or (a big one, whose figures count) its start time did."""
        pc = self._procs.get(pid)
        if pc is not None and pc.cgroup != cgroup:
            pc = None
        if pc is not None and rss >= MAPS_MIN_RSS and self.proc.start_ticks(pid) != pc.start:
            pc = None
        if pc is None:
            # Its start, once: a big process is compared with it every pass.
            self._procs[pid] = _ProcCache(cgroup=cgroup, start=self.proc.start_ticks(pid))

    def _uid(self, pid: int, rss: int, *, again: bool = False) -> int | None:
        """The process's real uid (_ProcCache.uid says when it is read again)."""
        pc = self._procs.setdefault(pid, _ProcCache())
        if pc.uid is None or (pc.uid == 0 and (again or rss >= MAPS_MIN_RSS)):
            pc.uid = self.proc.uid(pid)
        return pc.uid

    def _roots(self) -> dict[str, str]:
        """Each connected manager's root cgroup: who a cgroup path belongs to."""
        return {key: m.root_cgroup for key, m in self.managers.items()}

    # --- GPU ------------------------------------------------------------

    def _gpu_processes(self, now: float) -> dict[int, int | None]:
        if not self.config.gpu:
            return {}
        figures, news = self.gpu.read(now)
        for n in news:
            tell(self.log, n)
        return figures

    # --- the snapshot -----------------------------------------------------

    def snapshot(
        self, *, rescue: bool = True, memory: Memory | None = None, room: RoomView = AS_MADE
    ) -> Snapshot:
        """Everything, read now (`memory`: the pass's, read here when None; `room`: the cache's
        worth; `rescue`: the rescue units too). `history` is this one reading, `boot_over`
        False: what the guard remembers of earlier passes is GuardState's (step())."""
        if self._connecting:
            self.adopt_managers()
        now = self.clock()
        memory = memory or self.proc.memory()
        gpu = self._gpu_processes(now)
        groups: dict[UnitRef, list[tuple[int, int, int | None]]] = {}
        cgroups: dict[UnitRef, str] = {}
        engines = bool(self.containers.engines) and self.containers.present()
        seen_ids: set[tuple[int, str]] = set()
        containers: dict[UnitRef, tuple[Container, str]] = {}
        what: dict[UnitRef, str] = {}  # the groups of users' processes (SeenUnit.group)
        roots = self._roots()
        for pid in self.proc.pids():
            info = self.proc.process(pid)
            if info is None:
                continue  # exited while we looked: normal
            rss = info.rss + (gpu.get(pid) or 0)
            self._fresh(pid, info.cgroup, rss)
            whose, cid = self._container_id(info.cgroup, engines)
            if cid is not None:
                seen_ids.add((whose, cid))
                answer, engine = self.containers.lookup(cid, whose)
                if answer is PENDING and not whose:
                    continue  # its engine answers within a pass: seen then, as a container
                # Root's engine's: container:NAME; her own engine's: hers, at her level (until
                # hers answers, and for a name no container of hers may have, her group).
                ref = UnitRef(CONTAINER, answer.name if isinstance(answer, Container) else "")
                if whose and isinstance(answer, Container):
                    ref = UnitRef(user_manager(whose), CONTAINER_PREFIX + answer.name)
                if isinstance(answer, Container) and ref.is_container and valid_name(answer.name):
                    containers[ref] = (answer, engine)
                    groups.setdefault(ref, []).append((pid, info.rss, gpu.get(pid, 0)))
                    cgroups.setdefault(ref, container_cgroup(info.cgroup, cid))
                    continue
                # No engine has it: whatever its manager says it is (a scope).
            owner = attribution.owner(
                info.cgroup, roots, partial(self._uid, pid, rss), self.guard_unit
            )
            if owner is None:
                continue
            groups.setdefault(owner.ref, []).append((pid, info.rss, gpu.get(pid, 0)))
            cgroups.setdefault(owner.ref, owner.cgroup)
            if owner.group:
                what[owner.ref] = owner.group
        groups, cgroups, jobs = attribution.split_jobs(groups, cgroups, self._uid, self.guard_unit)
        what.update(jobs)
        if engines or self.containers.user_engines:
            self.containers.forget(seen_ids)
            self._report_engines()
        self._container_of = containers

        self._left_out, self._left_out_now, self._timed_out = self._left_out_now, set(), False
        self._answered = set()
        starting = self._start_jobs(groups)
        for ref in starting:
            groups.setdefault(ref, [])
        states, ghosts = self._states({r: p for r, p in groups.items() if r not in what})
        what.update(ghosts)
        # A container or a group has processes: it runs (no manager has its state).
        states.update({ref: "active" for ref in [*containers, *what] if groups.get(ref)})
        unmanaged = {}
        for ref, procs in groups.items():
            if ref not in states and procs and ref.manager.startswith(USER_PREFIX):
                # Her manager did not answer (stopped, frozen, out of view): the kernel
                # shows processes, so the unit runs; judged on that, never skipped.
                states[ref] = "active"
                unmanaged[ref] = (
                    "its manager is out of view"
                    if ref.manager not in self.managers
                    else "its manager is not answering"
                )
        units = []
        budget = self._budget(groups)
        for ref, procs in sorted(groups.items()):
            state = states.get(ref)
            if state is None:
                continue
            seen = self._seen_unit(
                ref, procs, state, gpu, now, cgroups.get(ref, ""), budget, what.get(ref, "")
            )
            if ref in starting:
                seen = replace(seen, starting=True)
            if ref in unmanaged:
                seen = replace(seen, unmanaged=unmanaged[ref])
            units.append(seen)
        units = self._foresee(units, memory.total, now)
        for ref in [r for r in self._units if r not in groups]:
            del self._units[ref]
        live = {pid for procs in groups.values() for pid, _, _ in procs}
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]

        rule = self.memory_rule(room)
        return Snapshot(
            now=now,
            memory=memory,
            history=((now, judged(memory, rule)),),
            units=tuple(units),
            rescue=self._rescue() if rescue else (),
            guard_started=self.started,
            guard_unit=self.guard_unit,
            gpu_accounting=self.gpu.on,
            gpu_stale=self.gpu.stale,
            rule=rule,
            pinned=self.proc.pinned(),
        )

    def _budget(self, groups: dict[UnitRef, Any]) -> _PassBudget:
        """A pass's budget, with what the caches of the units still there hold (a unit gone
        since the last pass holds nothing of her budget)."""
        budget = _PassBudget()
        for r, c in self._units.items():
            if r in groups:
                held = budget.details_held
                held[r.manager] = held.get(r.manager, 0) + c.details_bytes
        return budget

    def memory_rule(self, room: RoomView = AS_MADE) -> MemoryRule:
        """Which figure to judge: unified memory as the config says, or, on "auto", as NVML
        found it (no device memory figure: GB10); room counts where the guard can make it."""
        unified = unified_memory(self.config.unified, self.gpu.unified)
        return MemoryRule(unified, self.config.make_room and room.counts, room.mapped)

    # --- the managers asked in a pass ----------------------------------------
    #
    # A call to a manager that froze since the last pass waits the bus timeout (5 s), with
    # the GIL held (pystemd): three frozen at once were 15 s of one pass, blind to every
    # loader meanwhile. So a pass lets one call time out: after it, the user managers not
    # yet asked are left for the next pass, which asks them after those that answered (a
    # manager that answered is asked every pass, however many froze). PID 1 is always
    # asked, first.

    def _in_turn(self) -> list[tuple[str, Manager]]:
        """The managers to ask now: PID 1, those that answered, those left out last pass."""
        return sorted(
            self.managers.items(),
            key=lambda item: (item[0] != SYSTEM, item[0] in self._left_out),
        )

    def _spent(self, key: str) -> bool:
        """A call timed out in this pass: `key`, a user manager not asked yet in it, waits
        for the next; one that answered a moment ago is asked on."""
        if self._timed_out and key != SYSTEM and key not in self._answered:
            self._left_out_now.add(key)
            return True
        self._answered.add(key)  # (a call that fails now drops it from the managers)
        return False

    def _failed(self, key: str, e: ManagerError) -> None:
        self._timed_out = self._timed_out or isinstance(e, ManagerSilent)
        self._drop(key, str(e))

    def _start_jobs(self, groups: dict[UnitRef, Any]) -> set[UnitRef]:
        """Services with a start job and no process yet: loaders caught before they allocate."""
        found = set()
        for key, m in self._in_turn():
            if self._spent(key):
                continue
            try:
                names = m.start_jobs()
            except ManagerError as e:
                self._failed(key, e)
                continue
            for name in names:
                ref = UnitRef(key, name)
                if (
                    name.endswith(".service")
                    and ref not in groups
                    and not is_protected(ref, self.config, self.guard_unit)
                ):
                    found.add(ref)
        return found

    def _states(self, groups: dict[UnitRef, Any]) -> tuple[dict[UnitRef, str], dict[UnitRef, str]]:
        """ActiveState of every unit with processes: one call per manager. And the units of
        a user manager that it does not run, though processes sit in their cgroup (a cgroup
        of hers named `x.service` in her delegated subtree, or what KillMode=process left
        behind): groups of hers, never its units (what they are, for SeenUnit.group)."""
        out: dict[UnitRef, str] = {}
        ghosts: dict[UnitRef, str] = {}
        for key, m in self._in_turn():
            if self._spent(key):
                continue
            names = [r.name for r in groups if r.manager == key]
            try:
                states = m.unit_states(names)
            except ManagerError as e:
                self._failed(key, e)
                continue
            for name, st in states.items():
                ref = UnitRef(key, name)
                if (
                    key not in attribution.ROOTS
                    and groups.get(ref)  # a start job has no process yet: a unit, starting
                    and (st.load_state == "not-found" or st.active_state in ("inactive", "failed"))
                ):
                    ghosts[ref] = f"processes in {name}, which her manager " + (
                        "does not know" if st.load_state == "not-found" else "does not run"
                    )
                    continue
                out[ref] = st.active_state
        return out, ghosts

    def _seen_unit(
        self,
        ref: UnitRef,
        procs: list[tuple[int, int, int | None]],
        state: str,
        gpu: dict[int, int | None],
        now: float,
        cgroup: str,
        budget: _PassBudget,
        group: str = "",
    ) -> SeenUnit:
        pids = tuple(p for p, _, _ in procs)
        rss = sum(r for _, r, _ in procs)
        gpu_bytes = sum(g or 0 for _, _, g in procs)
        gpu_pids = tuple(p for p in pids if p in gpu)
        cache = self._units.get(ref)
        if cache is None or (pids and cache.pids and not (cache.pids & set(pids))):
            cache = self._units[ref] = _UnitCache()  # new or restarted: read it afresh
        growth = 0.0
        if cache.at and now > cache.at:
            growth = (rss + gpu_bytes - cache.used) / (now - cache.at)
        cache.pids, cache.used, cache.at = frozenset(pids), rss + gpu_bytes, now

        if not cache.since:
            cache.since = now
        interesting = (
            ref.name.endswith(".service") or ref.is_container or group
        ) and not is_protected(ref, self.config, self.guard_unit)
        if not interesting:
            return SeenUnit(
                ref, state, pids, rss, gpu_bytes, gpu_pids, growth=growth, cgroup=cgroup
            )
        facts = None
        if ref in self._container_of:  # (what an engine answered: only containers are)
            container, engine = self._container_of[ref]
            facts = ContainerFacts(
                container.id,
                container.image,
                engine,
                container.restart,
                container.max_retries,
                image_evidence(container.image) or "",
                container.mounts,
                project_name(dict(container.labels).get(COMPOSE_PROJECT_LABEL, "")),
            )
            # Its command as its ExecStart=; it became active when its engine says it
            # started (a guard restarted since must not make it the newer of a duplicate),
            # else when first seen running.
            if cache.details is None:  # once per run: two clocks read each pass would drift
                since = cache.since
                # (Her own engine's word is hers: a StartedAt of 1970 would make her the
                # first to load any model, and another's loader the duplicate stopped.)
                if container.started_at is not None and not ref.engine_owner:
                    since = min(since, now - max(0.0, time.time() - container.started_at))
                cache.details = UnitDetails((container.command,), since)
        elif group:
            # No unit, no ExecStart=: its processes' command lines say what it runs, and
            # it became active when the guard first saw it. Not its oldest process's start:
            # she can move an old process of hers into it, or exec the fake from an old
            # shell, and be "first" to any model another user loads.
            if cache.details is None:
                cache.details = UnitDetails((), cache.since)
        elif (
            cache.details is None
            or (cache.details.unreadable and now >= cache.retry_at)
            or (cache.kernel_view and ref.manager in self.managers and now >= cache.read_at)
        ):
            held = budget.details_held.get(ref.manager, 0)
            was_kernel_view = cache.kernel_view
            try:
                if ref.manager != SYSTEM and held >= DETAILS_OWNER_BUDGET:
                    raise ManagerError(
                        f"{ref.manager}: the command lines and environment of its units"
                        f" held already are over {DETAILS_OWNER_BUDGET >> 10} KiB: not read"
                    )
                if ref.manager in self._left_out_now:
                    # Another manager's call timed out in this pass: this one waits too.
                    raise ManagerError(f"{ref.manager}: not asked in this pass")
                answer = self.managers[ref.manager].unit_details(ref.name)
            except KeyError:
                # Out of view: no ExecStart= to read yet; its processes' argv stand in
                # for it (_foresee) until its manager answers and it is read again. When
                # it became active is not known until its manager says: it comes after
                # every loader whose start is known (admitted last, the duplicate of any).
                cache.details, cache.kernel_view = UnitDetails((), None), True
            except ManagerError as e:
                # Asked again later (its manager paused or slow, her budget spent): a
                # unit read at a bad moment is not left unread for its whole run. One
                # seen by the kernel so far, its footprint known from its argv, stays
                # so: they go on standing in (else, why is what its footprint says).
                cache.retry_at = cache.read_at = now + DETAILS_RETRY
                known = cache.prediction is not None and cache.prediction.bytes is not None
                if not (was_kernel_view and known):
                    cache.details = UnitDetails((), None, unreadable=str(e))
                    cache.kernel_view = False
            else:
                if cache.details is not None:  # read again: foreseen again from it
                    # (what was foreseen stands until then: a loader admitted by its
                    # argv's footprint is never "unknown for now" when its manager answers)
                    cache.commands, cache.predicted, cache.foreseen_from = None, False, ()
                cache.details, cache.kernel_view = answer, False
            d = cache.details
            assert d is not None  # (kept from the kernel's view when the read failed)
            cache.details_bytes = sum(len(a) + 1 for row in d.exec_start for a in row) + sum(
                len(e) for e in d.environment
            )
            budget.details_held[ref.manager] = held + cache.details_bytes
        details = cache.details
        assert details is not None  # (every branch above reads or sets them)
        if cache.commands is None:
            cache.commands = tuple(CommandLine(a) for a in details.exec_start)
        left = budget.unit(ref.manager)
        # Foreseen from argv and no size known: argv read again when it is foreseen again
        # (a wrapper script that exec'd its server keeps its pid and start time).
        foreseen = cache.prediction
        again = bool(
            (group or cache.kernel_view)
            and cache.predicted
            and (foreseen is None or foreseen.bytes is None)
            and now >= cache.retry_at
        )
        # The biggest first: a loader is what grows; a crowd of small processes is not.
        for pid, p_rss, p_gpu in sorted(procs, key=lambda p: -(p[1] + (p[2] or 0))):
            pc = self._procs.setdefault(pid, _ProcCache())
            if pc.reread or again:
                pc.cmdline, pc.reread = None, False  # (its size kept: the budget's memo)
            if (p_rss >= MAPS_MIN_RSS or p_gpu) and budget.hold_maps(ref.manager):
                if now - pc.maps_at >= MAPS_RECHECK and budget.maps_scans > 0:
                    budget.maps_scans -= 1
                    pc.maps_at = now
                    pc.models = self.proc.mapped_models(pid) or ()
            else:
                pc.models = ()  # small, or past its owner's share: not held
            if pc.cmdline is None and left > 0 and pc.argv_bytes <= left:
                # Read whole (a cut one would be kept cut for the process's life); its size
                # is remembered, so one that does not fit is not read again each pass.
                argv = self.proc.cmdline(pid) or ()
                # Still systemd's between fork and exec? Used, and read again next pass
                # (never dropped: her loader run as `exec -a "(x)"` still shows its -m).
                pc.reread = bool(argv) and (
                    argv[0].startswith("(") or os.path.basename(argv[0]) in TRANSIENT_ARGV0
                )
                pc.cmdline = CommandLine(argv)
                pc.argv_bytes = max(1, sum(len(a) + 1 for a in pc.cmdline))
                was = pc.uid
                if was == 0 and self._uid(pid, p_rss, again=True) != was:
                    # Root's a moment ago (cron's child), a user's now that it runs her
                    # command: not this unit's evidence; the next pass counts it as hers.
                    pc.cmdline, pc.argv_bytes = None, 0
                    continue
            if pc.cmdline is not None and pc.argv_bytes > left:
                pc.cmdline = None  # over the budget now: dropped, read again when it fits
            if pc.cmdline is not None:
                left -= pc.argv_bytes
                budget.spend(ref.manager, pc.argv_bytes)
        cmdlines: list[CommandLine] = []
        models: list[str] = []
        for pid, _, _ in procs:
            pc = self._procs[pid]
            if pc.cmdline is not None:
                cmdlines.append(pc.cmdline)
            models.extend(pc.models)
        cache.argv = tuple(cmdlines)
        return SeenUnit(
            ref,
            state,
            pids,
            rss,
            gpu_bytes,
            gpu_pids,
            exec_start=cache.commands,
            cmdlines=tuple(cmdlines),
            mapped_models=tuple(dict.fromkeys(models))[:MAPS_MAX_MODELS],
            active_since=details.active_since,
            growth=growth,
            cgroup=cgroup,
            container=facts,
            group=group,
        )

    def _report_engines(self) -> None:
        """An engine that fails (not a 404) is said once per distinct error."""
        for path, error in list(self.containers.errors.items()):
            if self._engine_said.get(path) != error:
                self._engine_said[path] = error
                tell(
                    self.log,
                    Event.of(
                        EventKind.ENGINE_UNANSWERED, "warning", socket=path, error=error, msg=error
                    ),
                )

    def _ollama_servers(self) -> list[ServerUnit]:
        """The Ollama server units seen: asked only for a unit not yet foreseen (a quiet
        machine's full look, every unit foreseen long ago, never walks the caches for it)."""
        return [
            ServerUnit(
                ref.manager,
                c.argv if c.kernel_view else c.details.exec_start,
                parse_environment(c.details.environment),
                c.details.user,
            )
            for ref, c in self._units.items()
            if c.details is not None
            and any(ln.serves == OLLAMA for ln in (c.argv if c.kernel_view else c.commands or ()))
        ]

    def _foresee(self, units: list[SeenUnit], mem_total: int, now: float) -> list[SeenUnit]:
        """Each loader's footprint before it allocates, once per run of its ExecStart=
        (the command line and the model's header do not change under it); from its
        processes' argv while it has none to read, again whenever they change. Models are
        read off the loop, with the unit owner's rights (foresight/predict.py): while a
        read is on, the prediction is pending (None: the trend guards the unit, and the
        strict phase's `unsized` bound) and the next pass asks again; the loop
        never waits for it. After every unit of the pass is seen: a client's load
        (foresight/clients.py) is looked up in its Ollama server unit's files."""
        out = []
        memo: list[list[ServerUnit]] = []

        def servers() -> list[ServerUnit]:  # asked at most once a pass, and only if needed
            if not memo:
                memo.append(self._ollama_servers())
            return memo[0]

        for seen in units:
            cache = self._units.get(seen.ref)
            if cache is None or cache.details is None:
                out.append(seen)
                continue
            if seen.ref in self._container_of:
                p = cache.prediction
                if p is not None and p.bytes is None and now >= cache.retry_at:
                    cache.predicted = False  # unknown: foreseen again, never for a whole run
                if not cache.predicted:
                    # Its command, with the model found through its bind mounts, as root
                    # reads it (a rootless one's as she does), never through a symlink
                    # (foresight/containers.py).
                    cache.prediction = predict_container(
                        self.predictor,
                        self._container_of[seen.ref][0],
                        mem_total,
                        wait=self.wait_for_models,
                        owner=seen.ref.engine_owner or None,
                    )
                    cache.predicted = cache.prediction is None or not cache.prediction.pending
                    cache.retry_at = now + FORESEE_RETRY
            elif cache.details.unreadable:
                # Said where a loader's footprint is: why its unit gave no command line
                # (read again after DETAILS_RETRY, and foreseen again then).
                cache.prediction = Prediction(None, cache.details.unreadable)
                cache.predicted = True
            else:
                self._foresee_unit(seen, cache, mem_total, now, servers)
            p = cache.prediction
            if p is not None:
                seen = replace(
                    seen,
                    predicted=p.bytes,
                    prediction=p.source,
                    foreseen=(
                        Foreseen.PENDING
                        if p.pending
                        else Foreseen.KNOWN
                        if p.bytes is not None
                        else Foreseen.UNKNOWN
                    ),
                    runs_as=p.runs_as,
                    page_cache=p.page_cache,
                )
            out.append(seen)
        return out

    def _foresee_unit(
        self,
        seen: SeenUnit,
        cache: _UnitCache,
        mem_total: int,
        now: float,
        servers: Callable[[], list[ServerUnit]],
    ) -> None:
        """A unit's or group's footprint from its ExecStart=, or from its processes' argv
        where it has none to read (a group; a unit whose manager is out of view), or where
        its ExecStart= says no size (a wrapper script). No "unknown" is kept for a whole
        run: foreseen again every FORESEE_RETRY (a client's server seen since, a model
        file laid down after its unit started), and, from argv, whenever they change (a
        wrapper exec'd its server; a process added that names a bigger model: the larger
        figure stands)."""
        argv_only = bool(seen.group) or cache.kernel_view
        argv = tuple(sorted(set(seen.cmdlines)))
        old = cache.prediction
        sized = old is not None and old.bytes is not None
        changed = argv != cache.foreseen_from and (argv_only or not sized)
        unknown = old is not None and old.bytes is None and now >= cache.retry_at
        if changed or unknown:
            cache.predicted = False
        if cache.predicted or not (seen.cmdlines or not argv_only):
            return
        details = cache.details
        assert details is not None
        env = parse_environment(details.environment)

        def predict(lines: tuple[tuple[str, ...], ...]) -> Prediction | None:
            return predict_client(
                self.predictor,
                lines,
                env,
                mem_total,
                manager=seen.ref.manager,
                user=details.user,
                servers=servers(),
                wait=self.wait_for_models,
            ) or self.predictor.predict(
                lines,
                env,
                mem_total,
                owner=owner_of(seen.ref.manager),
                wait=self.wait_for_models,
            )

        # A group has no ExecStart=, nor has a unit whose manager is out of view yet:
        # its processes' command lines, as read, with its owner's rights.
        new = predict(seen.cmdlines if argv_only else details.exec_start)
        cache.foreseen_from = argv
        if not argv_only and (new is None or new.bytes is None) and seen.cmdlines:
            by_argv = predict(seen.cmdlines)  # ExecStart= a script: what it exec'd says
            if by_argv is not None and (by_argv.bytes is not None or by_argv.pending):
                new = by_argv
        if new is not None and new.pending and old is not None and old.bytes is not None:
            return  # read again: the footprint known stands meanwhile
        if argv_only and new is not None and _smaller(new, old):
            new = old  # argv changed: never smaller than what one of them named
        cache.prediction = new
        cache.predicted = new is None or not new.pending
        cache.retry_at = now + FORESEE_RETRY

    def _rescue(self) -> tuple[RescueGroup, ...]:
        m = self._rescue_manager()
        if m is None:
            return tuple(RescueGroup(g, False, None) for g in self.rescue_groups)
        names = [n for g in self.rescue_groups for n in g]
        try:
            states = m.unit_states(names)
        except ManagerError as e:
            self._drop(m.key, str(e))
            return tuple(RescueGroup(g, False, None) for g in self.rescue_groups)
        out = []
        for group in self.rescue_groups:
            present = any(states[n].load_state != "not-found" for n in group if n in states)
            since = None
            for name in group:
                st = states.get(name)
                if st is None or st.active_state != "active":
                    self._rescue_since.pop(name, None)
                    continue
                if name not in self._rescue_since:
                    try:
                        t = m.unit_details(name).active_since
                    except ManagerError:
                        t = None
                    self._rescue_since[name] = t if t is not None else self.clock()
                t = self._rescue_since[name]
                since = t if since is None else min(since, t)
            out.append(RescueGroup(group, present, since))
        return tuple(out)

    def close(self) -> None:
        self.proc.close()
        self.predictor.close()
        self.containers.close()
        for key in list(self.managers):
            self.managers.pop(key).close()
        for pending in self._connecting.values():
            if pending.done:
                pending.manager.close()  # one still connecting dies with its daemon thread
        self._connecting.clear()
        self.gpu.close()


def sense_once(
    config: Config, log: FilteringBoundLogger
) -> tuple[Snapshot, UnitRef | None, tuple[str, ...]]:
    """One snapshot for a command (preflight, audit), the unit it runs in, and the
    managers that answered (none: no unit was seen, which is no all-clear)."""
    sensor = Sensor(config, log)
    sensor.wait_for_models = True
    sensor.gpu.deadline = max(sensor.gpu.deadline, COMMAND_GPU_DEADLINE)
    try:
        sensor.refresh_managers()
        if sensor.containers.engines and sensor.containers.present():
            sensor.snapshot()  # asks the engines about the containers it finds
            sensor.containers.wait(CONNECT_WAIT)
        snapshot = sensor.snapshot()
        return snapshot, sensor.guard_unit, tuple(sorted(sensor.managers))
    finally:
        sensor.close()
