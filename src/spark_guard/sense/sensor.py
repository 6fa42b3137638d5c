"""Sense: gather one Snapshot from /proc, NVML and the systemd managers.

Holds what must outlive one reading (connections, per-unit caches); what the
guard remembers for its judgement is step.GuardState, not here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from ..core import attribution
from ..core.attribution import ROOTS, attribute
from ..core.classify import is_protected
from ..core.config import Config
from ..core.events import Event, EventKind, tell
from ..core.room import AS_MADE, RoomView
from ..core.snapshot import (
    CONTAINER,
    CONTAINER_PREFIX,
    SYSTEM,
    USER_PREFIX,
    Memory,
    MemoryRule,
    Snapshot,
    UnitRef,
    judged,
    user_manager,
    valid_name,
)
from ..foresight.predict import Predictor
from ..system.containerwatch import PENDING, ContainerWatch, container_cgroup
from ..system.engine import Container, container_id, scope_container_id
from ..system.gpu import GpuWatch, unified_memory
from ..system.managers import Manager, UnitDetails
from ..system.procfs import ProcFS
from .asking import Answer, Question, Turns, ask, ghost
from .foresee import foresee
from .managers import Answering, ManagerWatch
from .rescue import RescueWatch
from .units import PROGRESS_EVERY, UnitReader, out_of_view

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

COMMAND_GPU_DEADLINE = 10.0  # a command waits this long for NVML (an init can take seconds)
# How long a command (or the daemon's first pass) waits for managers to connect: one
# bus timeout and a little. The daemon's later passes never wait: they adopt what is in.
CONNECT_WAIT = 6.0


# A pass's processes by unit (pid, RSS, GPU bytes), the containers an engine answered for,
# and the groups of users' processes (what each is, for SeenUnit.group).
Groups = dict[UnitRef, list[tuple[int, int, int | None]]]
Boxes = dict[UnitRef, tuple[Container, str]]
What = dict[UnitRef, str]


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
        self.proc = ProcFS(config.proc)
        self._on_answer = on_answer or (lambda: None)
        # The managers (sense/managers.py); `managers` is the one dict the blocker shares.
        self.watch = ManagerWatch(config, log, clock, heartbeat, self._on_answer)
        self.managers = self.watch.managers
        self.answering = Answering(self.watch)  # what the daemon's blocker acts through
        self.turns = Turns()  # the users' managers, asked in parallel (sense/asking.py)
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
        # The loop never waits on a model read; a command (sense_once) does, up to its deadline.
        self.wait_for_models = False
        self.started = clock()
        self.guard_unit: UnitRef | None = None
        # What is read of each unit and process, kept between passes (sense/units.py).
        self.progress = heartbeat or (lambda: None)
        self.units = UnitReader(self.proc, self.progress)
        self.rescue = RescueWatch(self.managers, clock)  # the ways in (sense/rescue.py)
        self._engine_said: dict[str, str] = {}
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded config; paths (proc, sockets) keep their start-up values."""
        self.config = config
        self.gpu.retry, self.gpu.deadline = config.gpu_retry, config.gpu_deadline
        self.rescue.reconfigure(config, self.guard_unit)

    # --- managers -------------------------------------------------------

    def refresh_managers(self, wait: float = CONNECT_WAIT) -> None:
        """Forget managers gone; start connecting those that appeared (boot, linger, login).

        Connections are made off the loop (managers.Connecting); `wait` is how long
        to wait for them here (a command, the first pass), 0 for the daemon's loop,
        which takes them in at its next full look (adopt_managers)."""
        self.watch.refresh(wait)
        self.adopt_managers()

    def adopt_managers(self) -> None:
        """Take in the connections that have an answer: believed, refused or silent. Her
        units' caches stay when her manager goes: what it said of a unit still running
        holds while it is out of view, and a unit it could not send is asked again at its
        retry_at, not at every reconnection. A unit gone goes with its pass."""
        before = set(self.managers)
        self.watch.adopt()
        if set(self.managers) != before or self.guard_unit is None:
            self._find_self()  # our own unit can only change with the set of managers
        self.rescue.add_graphical(self.guard_unit)

    def _find_self(self) -> None:
        """The guard's own unit, so it is never acted on and its manager holds the rescue units."""
        own = self.proc.cgroup_of_self()
        best = attribute(own, self._roots()) if own else None
        self.guard_unit = UnitRef(*best) if best else None

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
        if self.watch.connecting:
            self.adopt_managers()
        now = self.clock()
        memory = memory or self.proc.memory()
        gpu = self._gpu_processes(now)
        groups, cgroups, containers, what = self._walk(gpu)
        groups, cgroups, jobs, within = attribution.split_jobs(
            groups, cgroups, self.units.uid, self.guard_unit
        )
        what.update(jobs)

        answers = self._ask_managers(groups, what, now)
        starting = self._start_jobs(answers, groups)
        for ref in starting:
            groups.setdefault(ref, [])
        states, ghosts = self._states(answers, {r: p for r, p in groups.items() if r not in what})
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
        budget = self.units.budget(groups)
        for ref, procs in _in_turn(groups):
            state = states.get(ref)
            if state is None:
                continue
            seen = self.units.seen(
                ref,
                procs,
                state,
                gpu,
                now,
                cgroups.get(ref, ""),
                budget,
                what.get(ref, ""),
                protected=is_protected(ref, self.config, self.guard_unit),
                container=containers.get(ref),
                ask=self._asker(ref.manager, answers),
            )
            if ref in starting or ref in within:
                seen = replace(seen, starting=ref in starting, within=within.get(ref))
            if ref in unmanaged:
                seen = replace(seen, unmanaged=unmanaged[ref])
            units.append(seen)
        units = foresee(
            sorted(units, key=lambda u: u.ref),
            self.units.units,
            containers,
            self.predictor,
            memory.total,
            now,
            wait=self.wait_for_models,
        )
        self.units.forget(groups)

        rule = self.memory_rule(room)
        return Snapshot(
            now=now,
            memory=memory,
            history=((now, judged(memory, rule)),),
            units=tuple(units),
            rescue=self.rescue.read(self.guard_unit, self.watch.drop) if rescue else (),
            guard_started=self.started,
            guard_unit=self.guard_unit,
            gpu_accounting=self.gpu.on,
            gpu_stale=self.gpu.stale,
            rule=rule,
            pinned=self.proc.pinned(),
        )

    def _walk(self, gpu: dict[int, int | None]) -> tuple[Groups, dict[UnitRef, str], Boxes, What]:
        """Every process, by whose it is: (its unit's or group's processes, their cgroups,
        the containers an engine answered for, the groups of users' processes)."""
        groups: dict[UnitRef, list[tuple[int, int, int | None]]] = {}
        cgroups: dict[UnitRef, str] = {}
        engines = bool(self.containers.engines) and self.containers.present()
        seen_ids: set[tuple[int, str]] = set()
        containers: dict[UnitRef, tuple[Container, str]] = {}
        what: dict[UnitRef, str] = {}  # the groups of users' processes (SeenUnit.group)
        roots = self._roots()
        for n, pid in enumerate(self.proc.pids(), 1):
            if not n % PROGRESS_EVERY:
                self.progress()
            info = self.proc.process(pid)
            if info is None:
                continue  # exited while we looked: normal
            rss = info.rss + (gpu.get(pid) or 0)
            self.units.fresh(pid, info.cgroup, rss)
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
                info.cgroup, roots, partial(self.units.uid, pid, rss), self.guard_unit
            )
            if owner is None:
                continue
            groups.setdefault(owner.ref, []).append((pid, info.rss, gpu.get(pid, 0)))
            cgroups.setdefault(owner.ref, owner.cgroup)
            if owner.group:
                what[owner.ref] = owner.group
        if engines or self.containers.user_engines:
            self.containers.forget(seen_ids)
            self._report_engines()
        return groups, cgroups, containers, what

    def _ask_managers(self, groups: Groups, what: What, now: float) -> dict[str, Answer]:
        """What each manager answered in this pass: root's first (PID 1, then root's user
        manager), on the loop and whole; then the users' in parallel, each in its turn
        (sense/asking.py). A manager that failed is dropped; one left pending is said once
        and answers nothing now."""
        answers: dict[str, Answer] = {}
        asks: dict[str, tuple[Manager, Question]] = {}
        ordered = [r for r, _ in _in_turn(groups) if r not in what]
        held = self.units.budget(groups).details_held
        for key, m in sorted(self.managers.items(), key=lambda km: km[0] != SYSTEM):
            known = self.units.known(key, groups, now)

            def wanted(name: str, key: str = key, known: frozenset[str] = known) -> bool:
                ref = UnitRef(key, name)
                return name not in known and not is_protected(ref, self.config, self.guard_unit)

            names = tuple(r.name for r in ordered if r.manager == key)
            q = Question(names, wanted, held.get(key, 0), key != SYSTEM, key not in ROOTS)
            if q.hers:
                asks[key] = (m, q)
                continue
            answer = ask(m, q)
            if answer.error is not None:
                self.watch.failed(key, answer.error)
            else:
                answers[key] = answer
        got, failed, pending = self.turns.ask_all(asks)
        for key, error in failed.items():
            self.watch.failed(key, error)
        self.watch.pending(pending)
        answers.update(got)
        return answers

    def _asker(self, manager: str, answers: dict[str, Answer]) -> Callable[[UnitRef], UnitDetails]:
        """A unit's details as its manager answered in this pass (Later: not in it); its
        manager out of view, or late in this pass: KeyError (foreseen from argv)."""
        if manager not in self.managers:
            return out_of_view
        answer = answers.get(manager)
        if answer is None:
            return out_of_view  # late in this pass: what the kernel shows, as out of view
        return lambda ref: answer.details_of(ref.name)

    def memory_rule(self, room: RoomView = AS_MADE) -> MemoryRule:
        """Which figure to judge: unified memory as the config says, or, on "auto", as NVML
        found it (no device memory figure: GB10); room counts where the guard can make it."""
        unified = unified_memory(self.config.unified, self.gpu.unified)
        return MemoryRule(unified, self.config.make_room and room.counts, room.mapped)

    def _start_jobs(self, answers: dict[str, Answer], groups: Groups) -> set[UnitRef]:
        """Services with a start job and no process yet: loaders caught before they allocate."""
        found = set()
        for key, answer in answers.items():
            for name in answer.jobs:
                ref = UnitRef(key, name)
                if (
                    name.endswith(".service")
                    and ref not in groups
                    and not is_protected(ref, self.config, self.guard_unit)
                ):
                    found.add(ref)
        return found

    def _states(
        self, answers: dict[str, Answer], groups: Groups
    ) -> tuple[dict[UnitRef, str], dict[UnitRef, str]]:
        """ActiveState of every unit with processes, as its manager answered. And the units
        of a user manager that it does not run, though processes sit in their cgroup (a
        cgroup of hers named `x.service` in her delegated subtree, or what KillMode=process
        left behind): groups of hers, never its units (what they are, for SeenUnit.group)."""
        out: dict[UnitRef, str] = {}
        ghosts: dict[UnitRef, str] = {}
        for ref in groups:
            answer = answers.get(ref.manager)
            st = answer.states.get(ref.name) if answer is not None else None
            if st is None:
                continue
            if (
                ref.manager not in attribution.ROOTS
                and groups.get(ref)  # a start job has no process yet: a unit, starting
                and ghost(st)
            ):
                ghosts[ref] = f"processes in {ref.name}, which her manager " + (
                    "does not know" if st.load_state == "not-found" else "does not run"
                )
                continue
            out[ref] = st.active_state
        return out, ghosts

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

    def close(self) -> None:
        self.proc.close()
        self.predictor.close()
        self.containers.close()
        self.turns.close()
        self.watch.close()
        self.gpu.close()


def _in_turn(groups: Groups) -> list[tuple[UnitRef, list[tuple[int, int, int | None]]]]:
    """The units in the order a pass reads them: running ones first, the biggest first.
    What a pass's budgets leave for later (asking.DETAILS_PER_PASS) is a user's queued
    start jobs, never the loader that grows."""

    def used(procs: list[tuple[int, int, int | None]]) -> int:
        return sum(rss + (gpu or 0) for _, rss, gpu in procs)

    return sorted(groups.items(), key=lambda kv: (-used(kv[1]), kv[0]))


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
