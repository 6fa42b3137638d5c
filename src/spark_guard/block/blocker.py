"""Act for real: stop a loader unit, block it, disable it, verify, and record every step.

The order follows what matters while memory goes:

  stop     StopUnit through the unit's own manager, before anything is written
  plan     record the links a disable removes (with their targets and owners),
           and where the mask goes
  disable  DisableUnitFiles through the same manager: it removes what `plan`
           recorded, as the manager's own user (it refuses once masked, so
           this comes first)
  mask     a /dev/null link in the manager's runtime *control* directory, the
           one runtime directory that outranks /etc/systemd/system and
           ~/.config/systemd/user (a plain runtime mask loses against both)
  settle   a state, not a wait: each pass of the loop reads the unit's state and
           escalates, to KillUnit SIGKILL then the cgroup's kill, on time
           (guard.stop_timeout, guard.kill_timeout) or at once when MemAvailable
           falls below the reserve while the stop is pending
  verify   read LoadState back (a daemon-reload if the unit is still loaded)
  blocked  done; the mask is laid again if a reboot or manager restart took it

The stop itself: the unit is frozen first (FreezeUnit, the cgroup v2 freezer:
allocation halts within milliseconds), then StopUnit, which thaws it so its
SIGTERM handler can run (systemd thaws a frozen unit on stop). A unit frozen
with a process that ignores SIGTERM is sent SIGKILL at once: the stop could
only end at the stop timeout, and the thaw would give it those seconds to
allocate. Where there is no freezer (cgroup v1 or hybrid hosts) the stop goes
out alone and the escalation on time and memory does the rest.

Only the first look at a stop waits (QUICK_SETTLE: a loader that honours
SIGTERM is gone in tens of milliseconds, and the block completes in the same
call); after that the loop goes on sensing and calls advance() every pass.

This class is the executor of the block machine in core/block.py, which says
what follows: the work each step does (work_for, up to the mask in one pass),
the step changes allowed, the rewinds included (TRANSITIONS, forward,
running_again, mask_gone) and what verify reads (verdict); core/stops.py says
how a stop is escalated. Beside it: the ledger (ledger.py: the records, every
step change, each problem said once), the file steps (files.py), the pauses
(pauses.py), containers' blocks (boxes.py), stop-only stops (loose.py) and the
kernel's side (kernel.py).

Each step is saved before the next, so a crash resumes where it stopped. It
is all D-Bus on the managers' private sockets and syscalls: no fork, no exec,
nothing on the system bus. A manager that does not answer gets its unit's
cgroup killed and the block is retried on a later pass.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..core import stops
from ..core.block import (
    CASCADE,
    FILE_WORK,
    MASKED_STEPS,
    RETRY_AFTER,
    Step,
    Work,
    due,
    forward,
    mask_gone,
    running_again,
    work_for,
)
from ..core.config import Config
from ..core.events import Event, EventKind, tell
from ..core.snapshot import Action, Decision, Memory, MemoryRule, UnitRef
from ..system import cgroupfs
from ..system.engine import Engine
from ..system.managers import ManagerError
from ..system.procfs import ProcFS
from ..system.unitfiles import UnitFileError
from . import banner, files
from .boxes import Boxes
from .brake import Brake
from .groups import GroupKill, Groups
from .kernel import Kernel
from .ledger import Ledger
from .loose import LooseStops
from .pauses import Pauses
from .ports import EnginePort, ManagerPort
from .records import Record, RecordStore, boot_id, utc_now
from .settle import BlockStops

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

POLL = 0.02  # seconds between state reads while a unit stops (one D-Bus round trip each)
# How long a block waits for its stop before it hands the rest to later passes of the loop.
QUICK_SETTLE = 1.0
SWEEP_EVERY = 60.0  # seconds between sweeps of the store (RecordStore.sweep)


class Blocker:
    """Act for real: drives each block through the steps in this module's docstring.

    act() hands it the stops a pass asked for (block()); the Guard calls advance() after
    each full look, so a block goes on across passes, and brake() ahead of one when
    MemAvailable is about to cross the reserve. Its executors are named in __init__.
    """

    def __init__(
        self,
        managers: Mapping[str, ManagerPort],
        config: Config,
        log: FilteringBoundLogger,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        tick: Callable[[], None] = lambda: None,
        engine: Callable[[str, float], EnginePort] | None = None,
        lock_wait: float = 1.0,
        adopt_stops: bool = False,
    ) -> None:
        self.managers, self.config, self.log = managers, config, log
        self.clock, self.sleep = clock, sleep
        # Called while waiting for units to stop (the daemon sends WATCHDOG=1).
        self.tick = tick
        # Paths keep their start-up values across a reload, like the sensor's.
        self.user_runtime = config.user_runtime
        # An engine's API at a socket path, with a timeout: the port a container's block uses
        # (a socket in a user's runtime dir is her rootless engine: its peer must be her).
        engine = engine or (lambda path, t: Engine(path, timeout=t, user_runtime=self.user_runtime))
        # How long a pass waits for the store's lock (another guard's pass holds it): the
        # daemon goes on after a second; a one-shot rescue waits its turn.
        self.lock_wait = lock_wait
        self.store = RecordStore(config.state)
        self.ledger = Ledger(
            self.store, log, config.motd, config.issue, held=lambda key: key in self.pending
        )
        self.boot_id = boot_id(config.proc)
        self.brakes = Brake(managers, self.store, self.boot_id, log, clock)
        if adopt_stops:
            self.brakes.adopt()
        self.proc = ProcFS(config.proc)
        self._retry_at: dict[str, float] = {}
        self._sweep_at = 0.0  # when the store is next swept of dead writers' leftovers
        self.kernel = Kernel(cgroupfs.v2_root(config.cgroup), self.proc)
        self.pauses = Pauses(self.kernel, clock)
        # Blocks' stops, each on its clock (core/stops.py); the pass's reading of memory.
        self.settler = BlockStops(
            managers, self.ledger, self.kernel, self.proc, lambda: self.config, clock, self.boot_id
        )
        # Container blocks, each in its own thread while its engine's stop waits.
        self.boxes = Boxes(self.ledger, self.settler, engine)
        self.pending = self.boxes.pending
        # Stop-only stops (core/stops.py); the daemon adopts those an earlier guard kept.
        self.loose = LooseStops(managers, self.kernel, self.brakes, engine, adopt_stops)
        self.groups = Groups(self.proc, self.kernel.root, log)  # a user's groups' kills

    @property
    def records(self) -> dict[str, Record]:
        """The blocks this guard knows of, by unit (the ledger's)."""
        return self.ledger.records

    # --- entry points ---------------------------------------------------------

    def block(
        self,
        actions: Sequence[Action],
        decision: Decision,
        engines: Mapping[UnitRef, str] | None = None,
    ) -> None:
        """Stop, block and disable the unit of each action; a container's is stopped and its
        restart policy set to no through its engine (the decision's loaders say which one,
        or `engines`, for a command that has no decision of its own)."""
        # The store first: a unit blocked before (by a guard since restarted, or by rescue)
        # keeps its record, the only account of the links its release must put back.
        self.ledger.refresh()
        self.settler.reading(None, decision.rule)  # (its waits read memory afresh)
        cgroups = {ld.ref: ld.seen.cgroup for ld in decision.loaders}
        groups = {ld.ref: ld.seen.group or ld.seen.unmanaged for ld in decision.loaders}
        engines = dict(engines or {}) | {
            ld.ref: ld.seen.container.engine for ld in decision.loaders if ld.seen.container
        }
        seen_pids = {ld.ref: ld.seen.pids for ld in decision.loaders}
        batch, boxes, kills = [], [], []
        for action in actions:
            key = str(action.unit)
            if action.how == "kill":
                kills.append(action)  # after the stops: those are one call each
                continue
            if action.how == "stop-only":
                unit = action.unit
                self.loose.start(action, cgroups.get(unit, ""), engines.get(unit, ""), self.config)
                continue
            if self.store.releasing(action.unit):
                continue  # an admin's release is under way: judged again once it is done
            record = self.records.get(key)
            if record is not None and self.ledger.released_meanwhile(record):
                record = None  # released, and now a threat again: a new block
            if record is None:
                record = Record(
                    unit=action.unit.name,
                    manager=action.unit.manager,
                    reason=action.reason,
                    detail=action.detail,
                    phase=decision.phase,
                    figures=dict(action.figures),
                    at=utc_now(),
                    boot_id=self.boot_id,
                    cgroup=cgroups.get(action.unit, ""),
                    clients=[str(c) for c in action.clients],
                )
            elif action.unit.is_container:
                # Under way still (its engine silent, a run its policy started): killed too.
                why = f"running again: {action.reason}: {action.detail}"
                if self.boxes.again(record, cgroups.get(action.unit, ""), why):
                    continue
            else:
                # Blocked before, and running again (it started before its mask was back).
                record.note(f"running again: {action.reason}: {action.detail}")
                back = running_again(record.step, files.mask_present(record, self.user_runtime))
                if back is not None and self.ledger.move(record, back) and back == Step.MASK:
                    # Unmasked by hand while no guard watched: the mask goes back first.
                    record.mask_made = True
                    record.note("mask gone: laying it again")
            self.records[key] = record
            if action.unit.is_container:
                record.cgroup = cgroups.get(action.unit) or record.cgroup  # this run's
                self.boxes.start(record, engines.get(action.unit, ""))
                boxes.append(record)
                continue
            # The stop goes out first: everything else can wait a few milliseconds.
            self._request_stop(record)
            batch.append(record)
        # Groups: no unit, so nothing to mask, record or undo (block/groups.py).
        self.groups.kill(
            [
                GroupKill(a, cgroups.get(a.unit, ""), groups.get(a.unit), seen_pids.get(a.unit, ()))
                for a in kills
            ],
            self.config.kill_timeout,
        )
        if batch:
            self._run(batch, wait=QUICK_SETTLE)
        if boxes:
            self.boxes.advance(boxes, wait=QUICK_SETTLE)

    def advance(self, memory: Memory | None = None, rule: MemoryRule | None = None) -> None:
        """Finish blocks left unfinished, and lay again masks a reboot or restart removed.
        `memory`, `rule`: the pass's reading and the figure it judges (the daemon's: read
        once a pass); /proc/meminfo is read here when not given."""
        self.settler.reading(memory, rule)
        self.ledger.refresh()
        now = self.clock()
        if now >= self._sweep_at:
            # What a killed or failed write left in the store (its own files only).
            self._sweep_at = now + SWEEP_EVERY
            self.store.sweep()
            banner.sweep(self.ledger.motd, self.ledger.issue)
        self.loose.advance(self.settler.available, self.settler.limits())
        for key in list(self.pauses):
            record = self.records.get(key)
            if record is None or self.store.releasing(record.ref):
                self.pauses.resume(key)  # released meanwhile: it runs on
        todo = []
        boxes = []
        for key, record in list(self.records.items()):
            if record.ref.is_container:
                boxes.append(record)
                continue
            manager = self.managers.get(record.manager)
            if manager is None:
                held = key in self.pauses or (record.step != Step.BLOCKED and record.cgroup)
                if held and not self.pauses.hold(record, self.config.stop_timeout):
                    self.settler.kill_cgroup(record, f"{record.manager} manager is not answering")
                continue  # gone, or late (sense/managers.Answering): held from the kernel's side
            gone = (
                record.step == Step.BLOCKED
                and bool(record.mask_path)
                and not files.mask_present(record, self.user_runtime)
            )
            # A mask gone is laid again in _run, once it is sure the unit was not released;
            # a record that could not be written is tried again on every pass.
            clock, retry = self.settler.clock_of(record), self._retry_at.get(key, 0)
            if (
                key in self.ledger.unsaved
                or key in self.pauses  # its manager answers now: the stop goes out at once
                or due(record.step, clock, retry, now, gone)
            ):
                todo.append(record)
        if todo:
            self._run(todo)
        if boxes:
            self.boxes.advance(boxes)

    def brake(self, refs: Sequence[UnitRef], why: str, **figures: float) -> list[UnitRef]:
        """Freeze these units now, before the full look that decides on them (brake.py);
        release_brakes() thaws the ones the decision does not stop."""
        return self.brakes.freeze(refs, why, self.records, **figures)

    @property
    def braked(self) -> bool:
        return bool(self.brakes.frozen)

    def release_brakes(self) -> None:
        self.brakes.release(owned=self.records)

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded config (timeouts); its paths keep their start-up values."""
        self.config = config

    def finish(self, timeout: float) -> None:
        """For one-shot commands (rescue): drive the stops until they settle or time is up."""
        deadline = self.clock() + timeout
        while (self.settling or self.groups.pending) and self.clock() < deadline:
            self.tick()
            self.sleep(POLL)
            self.advance()
            # A group has no stop to settle: it is killed again until a kill finds nothing
            # new of hers (a fork storm outlasts one kill's budget).
            self.groups.again(self.config.kill_timeout)

    @property
    def busy(self) -> bool:
        """A block is unfinished and can go on: the guard keeps taking full looks until it
        is done. One whose manager is gone (and nothing of it paused), or a kept stop whose
        manager cannot say which run it sees, waits for a manager's return instead, which
        the periodic full look notices: not a full look every pass for the whole boot."""
        return self.loose.busy or any(
            r.step != Step.BLOCKED and self._live(r) for r in self.records.values()
        )

    def _live(self, record: Record) -> bool:
        """Whether anything can move a record on now: its manager answers (an engine's
        thread for a container), or its processes are paused and wait on the clock."""
        key = str(record.ref)
        return record.ref.is_container or record.manager in self.managers or key in self.pauses

    @property
    def stopping(self) -> frozenset[UnitRef]:
        """The units of the stops under way: blocks' (this guard's or a rescue's), stop-only.
        The store first: a restarted guard's first look must not judge its own stop."""
        self.ledger.refresh()
        blocks = {r.ref for r in self.records.values() if r.step in (Step.STOP, Step.SETTLE)}
        return frozenset(blocks) | self.loose.under_way()

    @property
    def settling(self) -> bool:
        """A stop is in progress: the loop comes back within poll.min to look at it."""
        now = self.clock()
        return any(
            (
                r.step == Step.SETTLE
                and (clock := self.settler.clock_of(r)) is not None
                and clock.due(now)
                and self._live(r)
            )
            or (r.step == Step.STOP and str(r.ref) in self.pending)  # a container's stop
            for r in self.records.values()
        ) or self.loose.settling(now)

    # --- the steps ------------------------------------------------------------

    def _run(self, batch: list[Record], wait: float = 0.0) -> None:
        before = {str(r.ref): (r.step, len(r.history), r.problem, r.stopping) for r in batch}
        with self.store.lock(wait=self.lock_wait) as locked:
            busy = self.store.lock_problem or f"{self.store.root} is locked by another process"
            if locked:
                self.ledger.reported.pop("state-busy", None)
            elif self.ledger.once("state-busy", busy):  # said once, until it changes
                tell(
                    self.log,
                    Event.of(
                        EventKind.STATE_BUSY,
                        "warning",
                        state=self.store.root,
                        msg=busy + "; going on",
                    ),
                )
            # Released meanwhile, or being released now by an admin (a release marks it):
            # left alone, or the mask being taken off would be laid again.
            batch = [
                r
                for r in batch
                if not self.ledger.released_meanwhile(r) and not self.store.releasing(r.ref)
            ]
            for record in batch:
                was = record.step
                present = was not in MASKED_STEPS or files.mask_present(record, self.user_runtime)
                back = mask_gone(was, present)
                if back is not None and self.ledger.move(record, back):
                    record.mask_made = True
                    record.note(f"mask gone at {was} (reboot or manager restart): laying it again")
                    if was == Step.BLOCKED:
                        record.stopping = None  # that stop was an old run's
                    self.ledger.event(
                        EventKind.BLOCK_RENEWED, record, f"laying the mask on {record.ref} again"
                    )
            for record in batch:
                if record.step != Step.SETTLE:
                    self._retry_at[str(record.ref)] = self.clock() + RETRY_AFTER
                # Up to the mask in one go: each step done lets the next one run now.
                work = work_for(record.step, self.settler.clock_of(record) is not None)
                while work in CASCADE:
                    unsaved = work in FILE_WORK and str(record.ref) in self.ledger.unsaved
                    if unsaved and not self.ledger.save(record):
                        break  # what it would change is not on record: it waits
                    step = record.step
                    if work == Work.STOP:
                        self._request_stop(record)
                    else:
                        self._guarded(record, work)
                    if record.step == step:
                        break  # not done (a problem said): the next pass tries again
                    work = work_for(record.step, self.settler.clock_of(record) is not None)
            settling = [r for r in batch if r.step == Step.SETTLE]
            self._resume_stops(settling)
            deadline = self.clock() + wait
            while settling:
                settling = self.settler.settle(settling)
                if not settling or self.clock() >= deadline:
                    break
                self.tick()
                self.sleep(POLL)
            verifying = [r for r in batch if r.step == Step.VERIFY]
            files.verify(verifying, self.managers, self.ledger, self.user_runtime)
            for record in batch:
                key = str(record.ref)
                now_is = (record.step, len(record.history), record.problem, record.stopping)
                fresh = key not in self.ledger.on_disk or key in self.ledger.unsaved
                if fresh or now_is != before.get(key):
                    self.ledger.save(record)  # a pass that changed nothing writes nothing
        self.ledger.publish()

    def _guarded(self, record: Record, work: Work) -> None:
        """The work of a step that changes files (plan, disable, mask), through its manager;
        done, the record moves on and is saved, else its problem is said."""
        manager = self.managers.get(record.manager)
        try:
            if manager is None:
                raise ManagerError(f"{record.manager} manager is not connected")
            if work == Work.PLAN:
                on_disk = functools.partial(self.ledger.on_record, record)
                files.plan(record, manager, self.user_runtime, on_disk)
            elif work == Work.DISABLE:
                files.disable(record, manager, self.user_runtime)
            else:
                files.mask(record, self.user_runtime)
        except (ManagerError, UnitFileError, OSError) as e:
            self.ledger.problem(record, f"{record.step}: {e}")
        else:
            self.ledger.move(record, forward(record.step))
            self.ledger.save(record)

    def _request_stop(self, record: Record) -> None:
        key = str(record.ref)
        manager = self.managers.get(record.manager)
        frozen = False
        try:
            if manager is None:
                raise ManagerError(f"{record.manager} manager is not connected")
            frozen, said = self.brakes.for_stop(record.ref, manager)
            if said:
                record.note(said)
            job = manager.stop_unit(record.unit)
        except ManagerError as e:
            # Not connected yet (a linger user's manager at boot, starting beside the
            # guard): its processes are paused, not killed, since a kill is what Restart=
            # answers with a new run; the stop goes through the manager once it answers.
            was = key in self.pauses
            if manager is not None and was:
                self.pauses.forget(key)  # it answers, but not this: killed below
            paused = manager is None and self.pauses.pause(record, self.config.stop_timeout)
            if not (was and paused):  # (said at the pause; once)
                limit = self.config.stop_timeout if paused else None
                tell(self.log, stops.cannot_stop(record.ref, str(e), limit))
            if not paused:
                # The manager is not answering: kill from the kernel side, block later.
                self.settler.kill_cgroup(record, str(e))
            self.ledger.problem(record, f"stop: {e}")
            return
        if key in self.pauses:
            self.pauses.resume(key)  # its stop's SIGTERM is on its way; each process takes it
        self._stop_sent(record, job, frozen)

    def _stop_sent(self, record: Record, job: str, frozen: bool) -> None:
        key = str(record.ref)
        msg = f"stopping {key} ({record.reason})" + (", frozen first" if frozen else "")
        fields = {"job": job, "reason": record.reason, "frozen": frozen}
        self.ledger.event(EventKind.UNIT_STOP_REQUESTED, record, msg, **fields)
        record.note(f"stop requested ({job})")
        if record.step == Step.STOP:
            self.ledger.move(record, forward(record.step))
        self.settler.sent(record, frozen)

    def _resume_stops(self, batch: list[Record]) -> None:
        """A record in 'settle' with no stop sent by this guard: resumed after a restart of
        the guard, or a renewed mask. Stop it if it runs; the settle pass says if not."""
        for record in batch:
            if self.settler.clock_of(record) is None and self.settler.running(record):
                self._request_stop(record)
