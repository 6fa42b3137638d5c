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
the step changes allowed, the rewinds included (TRANSITIONS, moved,
running_again, mask_gone), a stop's escalation (escalate; container_stuck for a
container's) and what verify reads (verdict). Every change goes through
Blocker._move(); this class does the I/O and writes the records.

Each step is saved before the next, so a crash resumes where it stopped. It
is all D-Bus on the managers' private sockets and syscalls: no fork, no exec,
nothing on the system bus. A manager that does not answer gets its unit's
cgroup killed and the block is retried on a later pass.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core import stops
from ..core.block import (
    CASCADE,
    FILE_WORK,
    MASKED_STEPS,
    RETRY_AFTER,
    Step,
    StepError,
    Stopping,
    Verdict,
    Work,
    container_stuck,
    due,
    mask_gone,
    running_again,
    settled,
    verdict,
    work_for,
)
from ..core.config import Config
from ..core.events import Event, EventKind, Level, tell
from ..core.snapshot import Action, Decision, Memory, MemoryRule, UnitRef, judged
from ..core.stops import Limits
from ..system import cgroupfs
from ..system.engine import Engine, engine_owner
from ..system.managers import ManagerError, UnitState
from ..system.procfs import ProcError, ProcFS
from ..system.unitfiles import (
    Owner,
    UnitFileError,
    lay_mask,
    mask_dir,
    owner,
    present,
    read_link,
    shadowing_file,
)
from . import banner
from . import containers as container_block
from .brake import Brake
from .groups import GroupKill, Groups
from .kernel import Kernel
from .loose import LooseStops
from .ports import EnginePort, ManagerPort
from .records import (
    LinkRecord,
    Record,
    RecordError,
    RecordStore,
    Unlisted,
    boot_id,
    utc_now,
)

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

BLOCK = stops.Kind.BLOCK
POLL = 0.02  # seconds between state reads while a unit stops (one D-Bus round trip each)
# How long a block waits for its stop before it hands the rest to later passes of the loop.
QUICK_SETTLE = 1.0
SWEEP_EVERY = 60.0  # seconds between sweeps of the store (RecordStore.sweep)
# How often a blocked container's restart policy is read back (an engine call, off the loop):
# a policy set back to `always` by hand would start it at the next boot.
CONTAINER_RECHECK = 30.0
# A unit paused while its manager is not connected is looked at for SIGCONT no sooner than
# this after its SIGSTOP (a signal is taken when the process next runs).
PAUSE_SETTLE = 0.5


class Blocker:
    """Act for real: drives each block through the steps in this module's docstring.

    Owns the records (a file per blocked unit, each step saved before the next), the
    escalation of pending stops, the units the brake froze and the login notes
    (banner). act() hands it the stops a pass asked for (block()); the
    Guard calls advance() after each full look, so a block goes on across passes,
    and brake() ahead of one when MemAvailable is about to cross the reserve.
    """

    _memory: Memory | None = None  # the pass's reading of /proc/meminfo (advance())

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
        self.managers = managers
        self.config = config
        self.log = log
        self.clock = clock
        self.sleep = sleep
        # Called while waiting for units to stop (the daemon sends WATCHDOG=1).
        self.tick = tick
        # An engine's API at a socket path, with a timeout: the port a container's block uses
        # (a socket in a user's runtime dir is her rootless engine: its peer must be her).
        self.engine = engine or (
            lambda path, t: Engine(path, timeout=t, user_runtime=self.user_runtime)
        )
        # How long a pass waits for the store's lock (another guard's pass holds it): the
        # daemon goes on after a second; a one-shot rescue waits its turn.
        self.lock_wait = lock_wait
        # Paths keep their start-up values across a reload, like the sensor's.
        self.store = RecordStore(config.state)
        self.motd, self.issue = config.motd, config.issue
        self.user_runtime = config.user_runtime
        self.cgroup_root = cgroupfs.v2_root(config.cgroup)
        self.boot_id = boot_id(config.proc)
        self.records: dict[str, Record] = {}
        self._generation: int | None = None
        self._stopping: dict[str, Stopping] = {}  # the stops this guard sent, and how far
        self.brakes = Brake(managers, self.store, self.boot_id, log, clock)
        if adopt_stops:
            self.brakes.adopt()
        self.proc = ProcFS(config.proc)
        # Which figure the escalation on memory judges: the last decision's.
        self.rule = MemoryRule()
        self._retry_at: dict[str, float] = {}
        # Units whose processes were paused while their manager was not connected: since
        # when, and where (a record released or dropped meanwhile still gets its SIGCONT).
        self._paused: dict[str, tuple[float, str]] = {}
        self._reported: dict[str, str] = {}
        self._banner: str | None = None
        self._on_disk: set[str] = set()  # records this guard has seen on disk
        self._unsaved: set[str] = set()  # records whose latest state could not be written
        self._sweep_at = 0.0  # when the store is next swept of dead writers' leftovers
        # Container blocks in flight (each in its own thread: the engine's stop waits).
        self.pending = container_block.Pending()
        self.engine_timeout = config.engine_timeout
        self._killed: set[str] = set()  # containers whose cgroup this guard killed meanwhile
        self._silent_engines: dict[str, float] = {}  # engine socket -> silent until
        self._engine_of: dict[str, str] = {}  # container -> the socket its block asks
        self.kernel = Kernel(self.cgroup_root, self.proc)
        # Stop-only stops (core/stops.py); the daemon adopts those an earlier guard kept.
        self.loose = LooseStops(managers, self.kernel, self.brakes, self.engine, adopt_stops)
        self.groups = Groups(self.proc, self.cgroup_root, log)  # a user's groups' kills

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
        self._refresh()
        self.rule, self._memory = decision.rule, None  # (its waits read memory afresh)
        cgroups = {ld.ref: ld.seen.cgroup for ld in decision.loaders}
        groups = {ld.ref: ld.seen.group for ld in decision.loaders if ld.seen.group}
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
            if record is not None and self._released_meanwhile(record):
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
                if key in self.pending:
                    # Its block is under way and it runs again (restarted by its engine's
                    # policy while the engine cannot be asked to stop it): this run is
                    # killed too if its engine still does not answer.
                    self._killed.discard(key)
                    if cgroups.get(action.unit):
                        record.cgroup = cgroups[action.unit]
                    self._container_stuck(record)
                    continue
                record.note(f"running again: {action.reason}: {action.detail}")
                if record.step == Step.BLOCKED:
                    self._move(record, Step.STOP)
            else:
                # Blocked before, and running again (it started before its mask was back).
                record.note(f"running again: {action.reason}: {action.detail}")
                back = running_again(
                    record.step, not record.mask_path or self._mask_present(record)
                )
                if back is not None and self._move(record, back) and back == Step.MASK:
                    # Unmasked by hand while no guard watched: the mask goes back first.
                    record.mask_made = True
                    record.note("mask gone: laying it again")
            self.records[key] = record
            if action.unit.is_container:
                if cgroups.get(action.unit):
                    record.cgroup = cgroups[action.unit]  # this run's
                self._start_container_block(record, engines.get(action.unit, ""))
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
            self._advance_containers(boxes, wait=QUICK_SETTLE)

    def advance(self, memory: Memory | None = None, rule: MemoryRule | None = None) -> None:
        """Finish blocks left unfinished, and lay again masks a reboot or restart removed.
        `memory`, `rule`: the pass's reading and the figure it judges (the daemon's: read
        once a pass); /proc/meminfo is read here when not given."""
        self.rule, self._memory = rule or self.rule, memory
        self._refresh()
        now = self.clock()
        if now >= self._sweep_at:
            # What a killed or failed write left in the store (its own files only).
            self._sweep_at = now + SWEEP_EVERY
            self.store.sweep()
            banner.sweep(self.motd, self.issue)
        self.loose.advance(self._available, self._limits)
        for key in list(self._paused):
            record = self.records.get(key)
            if record is None or self.store.releasing(record.ref):
                self._resume(key)  # released meanwhile: it runs on
        todo = []
        boxes = []
        for key, record in list(self.records.items()):
            if record.ref.is_container:
                boxes.append(record)
                continue
            manager = self.managers.get(record.manager)
            if manager is None:
                if key in self._paused or (record.step == Step.STOP and record.cgroup):
                    self._hold(record)
                continue  # its manager is not running: nothing can start the unit
            gone = (
                record.step == Step.BLOCKED
                and bool(record.mask_path)
                and not self._mask_present(record)
            )
            # A mask gone is laid again in _run, once it is sure the unit was not released;
            # a record that could not be written is tried again on every pass.
            if (
                key in self._unsaved
                or key in self._paused  # its manager answers now: the stop goes out at once
                or due(record.step, self._stopping.get(key), self._retry_at.get(key, 0), now, gone)
            ):
                todo.append(record)
        if todo:
            self._run(todo)
        if boxes:
            self._advance_containers(boxes)

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
        return record.ref.is_container or record.manager in self.managers or key in self._paused

    @property
    def settling(self) -> bool:
        """A stop is in progress: the loop comes back within poll.min to look at it."""
        now = self.clock()
        return any(
            (
                r.step == Step.SETTLE
                and str(r.ref) in self._stopping
                and self._stopping[str(r.ref)].due(now)
                and self._live(r)
            )
            or (r.step == Step.STOP and str(r.ref) in self.pending)  # a container's stop
            for r in self.records.values()
        ) or self.loose.settling(now)

    # --- the steps ------------------------------------------------------------

    def _run(self, batch: list[Record], wait: float = 0.0) -> None:
        before = {str(r.ref): (r.step, len(r.history), r.problem) for r in batch}
        with self.store.lock(wait=self.lock_wait) as locked:
            busy = self.store.lock_problem or f"{self.store.root} is locked by another process"
            if locked:
                self._reported.pop("state-busy", None)
            elif self._reported.get("state-busy") != busy:  # said once, until it changes
                self._reported["state-busy"] = busy
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
                if not self._released_meanwhile(r) and not self.store.releasing(r.ref)
            ]
            for record in batch:
                was = record.step
                present = (
                    was not in MASKED_STEPS or not record.mask_path or self._mask_present(record)
                )
                back = mask_gone(was, present)
                if back is not None and self._move(record, back):
                    record.mask_made = True
                    record.note(f"mask gone at {was} (reboot or manager restart): laying it again")
                    if was == Step.BLOCKED:
                        self._stopping.pop(str(record.ref), None)  # that stop was an old run's
                    self._event(
                        EventKind.BLOCK_RENEWED, record, f"laying the mask on {record.ref} again"
                    )
            steps: dict[Work, Callable[[Record], None]] = {
                Work.STOP: self._request_stop,
                Work.PLAN: lambda r: self._guarded(r, self._plan),
                Work.DISABLE: lambda r: self._guarded(r, self._disable),
                Work.MASK: lambda r: self._guarded(r, self._mask),
            }
            for record in batch:
                if record.step != Step.SETTLE:
                    self._retry_at[str(record.ref)] = self.clock() + RETRY_AFTER
                # Up to the mask in one go: each step done lets the next one run now.
                work = work_for(record.step, str(record.ref) in self._stopping)
                while work in CASCADE:
                    unsaved = work in FILE_WORK and str(record.ref) in self._unsaved
                    if unsaved and not self._save(record):
                        break  # what it would change is not on record: it waits
                    step = record.step
                    steps[work](record)
                    if record.step == step:
                        break  # not done (a problem said): the next pass tries again
                    work = work_for(record.step, str(record.ref) in self._stopping)
            settling = [r for r in batch if r.step == Step.SETTLE]
            self._resume_stops(settling)
            deadline = self.clock() + wait
            while settling:
                settling = self._settle(settling)
                if not settling or self.clock() >= deadline:
                    break
                self.tick()
                self.sleep(POLL)
            self._verify([r for r in batch if r.step == Step.VERIFY])
            for record in batch:
                key = str(record.ref)
                now_is = (record.step, len(record.history), record.problem)
                if key not in self._on_disk or key in self._unsaved or now_is != before.get(key):
                    self._save(record)  # a pass that changed nothing writes nothing
        self._publish()

    def _released_meanwhile(self, record: Record) -> bool:
        """A record this guard saved that is no longer on disk: `release` took it (under the
        lock we now hold). Acting on it would undo the admin's release."""
        key = str(record.ref)
        if key not in self._on_disk:
            return False
        try:
            gone = self.store.load(record.ref) is None
        except RecordError:
            gone = False
        if gone:
            self.records.pop(key, None)
            self._on_disk.discard(key)
        return gone

    def _guarded(self, record: Record, step: Callable[[Record, ManagerPort], None]) -> None:
        manager = self.managers.get(record.manager)
        try:
            if manager is None:
                raise ManagerError(f"{record.manager} manager is not connected")
            step(record, manager)
        except (ManagerError, UnitFileError, OSError) as e:
            self._problem(record, f"{record.step}: {e}")
        else:
            self._save(record)

    def _request_stop(self, record: Record) -> None:
        key = str(record.ref)
        manager = self.managers.get(record.manager)
        frozen = False
        try:
            if manager is None:
                raise ManagerError(f"{record.manager} manager is not connected")
            frozen = self._freeze(record, manager)
            job = manager.stop_unit(record.unit)
        except ManagerError as e:
            # Not connected yet (a linger user's manager at boot, starting beside the
            # guard): its processes are paused, not killed, since a kill is what Restart=
            # answers with a new run; the stop goes through the manager once it answers.
            was = key in self._paused
            if manager is not None and was:
                self._paused.pop(key)  # it answers, but not this: killed below
            paused = manager is None and self._pause(record)
            if not (was and paused):  # (said at the pause; once)
                self._stop_failed(record, str(e), paused)
            if not paused:
                # The manager is not answering: kill from the kernel side, block later.
                self._kill_cgroup(record, str(e))
            self._problem(record, f"stop: {e}")
            return
        if key in self._paused:
            self._resume(key)  # its stop's SIGTERM is on its way; each process takes it
        self._stop_sent(record, job, frozen)

    def _stop_failed(self, record: Record, error: str, paused: bool) -> None:
        key = str(record.ref)
        tell(
            self.log,
            Event.of(
                EventKind.UNIT_STOP_FAILED,
                "error",
                unit=key,
                manager=record.manager,
                error=error,
                msg=f"cannot stop {key}: {error}"
                + (
                    f"; its processes are paused (SIGSTOP) until it answers, killed if it"
                    f" does not within {self.config.stop_timeout:g}s"
                    if paused
                    else ""
                ),
            ),
        )

    def _stop_sent(self, record: Record, job: str, frozen: bool) -> None:
        key = str(record.ref)
        self._stopping[key] = Stopping.at(self.clock())
        msg = f"stopping {key} ({record.reason})" + (", frozen first" if frozen else "")
        fields = {"job": job, "reason": record.reason, "frozen": frozen}
        self._event(EventKind.UNIT_STOP_REQUESTED, record, msg, **fields)
        record.note(f"stop requested ({job})")
        if record.step == Step.STOP:
            self._move(record, Step.PLAN)
        if frozen and self.kernel.ignores_sigterm(record.cgroup):
            # SIGTERM would end nothing: the stop would wait out its timeout, thawed and
            # allocating. Killed now, the frozen processes never run another instruction.
            why = "it ignores SIGTERM (seen while frozen)"
            self._carry_out(record, (stops.Kill(record.ref, record.cgroup, why, unit=True),))
            self._stopping[key] = self._stopping[key].killed(self.clock())

    def _pause(self, record: Record) -> bool:
        """SIGSTOP a unit's processes while its manager is not connected: nothing exits, so
        Restart= starts nothing, and nothing allocates. False (kill it instead) for a
        container, past `stop_timeout` of waiting, or once anything paused runs again (she
        sent SIGCONT to her own processes), looked at PAUSE_SETTLE after the SIGSTOP."""
        key, now = str(record.ref), self.clock()
        if key in self._paused:
            since = self._paused[key][0]
            if now - since >= self.config.stop_timeout or (
                now - since >= PAUSE_SETTLE and self.kernel.resumed(record.cgroup)
            ):
                self._paused.pop(key)
                return False
            return True
        if record.ref.is_container or not record.cgroup:
            return False
        try:
            how = self.kernel.send(record.cgroup, signal.SIGSTOP)
        except (OSError, ValueError, RuntimeError):
            return False
        self._paused[key] = (now, record.cgroup)
        record.note(f"paused: {how}")
        return True

    def _resume(self, key: str) -> None:
        """SIGCONT what was paused of `key` (released meanwhile, or its stop sent: systemd
        signals its main process only under KillMode=process), and forget the pause."""
        _, cgroup = self._paused.pop(key)
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            self.kernel.send(cgroup, signal.SIGCONT)

    def _hold(self, record: Record) -> None:
        """A unit whose manager is still not connected, paused (or left at its stop by an
        earlier guard, which may have paused it): paused too long, or running again, it is
        killed."""
        key = str(record.ref)
        if key not in self._paused:
            if not self.kernel.populated(record.cgroup):
                return  # nothing of it runs: nothing to hold
            self._paused[key] = (self.clock(), record.cgroup)
        if not self._pause(record):
            self._kill_cgroup(record, f"{record.manager} manager is not connected")

    def _freeze(self, record: Record, manager: ManagerPort) -> bool:
        """Freeze the unit before its stop: allocation halts at once. False where it cannot."""
        if self.brakes.take(record.ref):
            record.note("frozen (FreezeUnit, by the brake before the decision)")
            return True
        frozen, why = self.brakes.freeze_unit(record.ref, manager)
        if frozen or why:
            record.note("frozen (FreezeUnit)" if frozen else f"not frozen: {why}")
        return frozen

    def _owner(self, record: Record) -> Owner:
        return owner(record.manager, self.user_runtime)

    def _mask_present(self, record: Record) -> bool:
        try:
            return present(record.mask_path, self._owner(record))
        except UnitFileError:
            return False  # not reachable safely: laying it again names the problem

    def _plan(self, record: Record, manager: ManagerPort) -> None:
        # Where the mask goes is ours to say; the manager only has to read it from there.
        control = mask_dir(record.manager, self.user_runtime)
        if control not in {os.path.normpath(d) for d in manager.unit_path_dirs}:
            raise UnitFileError(
                f"{record.manager}: {control} is not in its UnitPath, so a mask there "
                "would not hold"
            )
        who = self._owner(record)
        links = []
        for path in manager.unit_file_links(record.unit):
            try:
                link = read_link(path, who)
            except UnitFileError as e:
                # Not readable as its owner could: not recorded, so never put back.
                record.note(f"plan: {path} left out ({e})")
                continue
            if link is not None:
                links.append(LinkRecord(link.path, link.target, link.uid, link.gid))
        # Another guard (a rescue beside the daemon, or this one before a restart) may have
        # planned and disabled already; its links are gone from the manager's view then.
        # Its record, re-read under the lock, is adopted: a re-plan never records fewer
        # links, nor forgets one was removed, nor takes back a mask it made.
        earlier = self._on_record(record)
        for lr in [*record.links, *(earlier.links if earlier else [])]:
            mine = next((x for x in links if x.path == lr.path), None)
            if mine is None:
                links.append(LinkRecord(lr.path, lr.target, lr.uid, lr.gid, lr.removed))
            elif lr.removed:
                mine.removed = True
        record.links = links
        if not record.cgroup and record.unit.endswith(".service"):
            # Only for the kill of last resort; the snapshot usually had it.
            with contextlib.suppress(ManagerError):
                record.cgroup = manager.unit_control_group(record.unit)
        record.mask_path = os.path.join(control, record.unit)
        # A mask someone else laid stays theirs: release leaves it.
        try:
            made = not present(record.mask_path, who)
        except UnitFileError:
            made = True  # the way there is not theirs: the mask step says so
        laid = earlier is not None and earlier.mask_made and earlier.mask_path == record.mask_path
        record.mask_made = made or laid or record.mask_made
        record.note(f"plan: mask {record.mask_path}; links {[lr.path for lr in links]}")
        self._move(record, Step.DISABLE)

    def _on_record(self, record: Record) -> Record | None:
        """The unit's record as it is on disk now (another guard's, perhaps)."""
        try:
            return self.store.load(record.ref)
        except (RecordError, OSError):
            return None

    def _mask(self, record: Record, _manager: ManagerPort) -> None:  # a _guarded() step
        expected = os.path.join(mask_dir(record.manager, self.user_runtime), record.unit)
        if record.mask_path != expected:  # a record from before the guard chose it itself
            raise UnitFileError(f"{record.mask_path}: not where a mask goes ({expected})")
        lay_mask(record.mask_path, self._owner(record))
        record.note(f"masked: {record.mask_path} -> /dev/null")
        self._move(record, Step.SETTLE)

    def _resume_stops(self, batch: list[Record]) -> None:
        """A record in 'settle' with no stop sent by this guard: resumed after a restart of
        the guard, or a renewed mask. Stop it if it runs; the settle pass says if not."""
        for record in batch:
            if str(record.ref) not in self._stopping and self._running(record):
                self._request_stop(record)

    @property
    def _limits(self) -> Limits:
        return Limits(self.config.stop_timeout, self.config.kill_timeout)

    def _available(self) -> tuple[int, int] | None:
        """(the judged figure: MemAvailable, or the device headroom on unified memory;
        reserve) now; None when /proc cannot say."""
        memory = self._memory
        if memory is None:
            try:
                memory = self.proc.memory()
            except ProcError:
                return None
        return judged(memory, self.rule), self.config.reserve_for(memory.total)

    def _settle(self, batch: list[Record]) -> list[Record]:
        """One look at units being stopped (core.stops.advance, batched per manager): the
        settled go on to 'verify', the others are escalated on time or on memory. Returns
        those still stopping."""
        states: dict[str, UnitState | None] = {}
        silent: set[str] = set()
        for key in sorted({r.manager for r in batch} & set(self.managers)):
            names = [r.unit for r in batch if r.manager == key]
            try:
                read = self.managers[key].unit_states(names)
                states |= {str(UnitRef(key, n)): st for n, st in read.items()}
            except ManagerError:
                silent.add(key)  # not answering: the deadlines still run
        memory = self._available()
        still = []
        for record in batch:
            key, now = str(record.ref), self.clock()
            st = states.get(key)
            active, load = (st.active_state, st.load_state) if st else (None, None)
            answered = record.manager in self.managers and record.manager not in silent
            # Its cgroup is read only once its manager says stopped (not at every poll before).
            left = self.kernel.pids(record.cgroup) if answered and settled(active, load, 0) else []
            seen = stops.Seen(
                frozenset((pid, None) for pid in left),
                answered=answered,
                active_state=active,
                load_state=load,
                memory=memory,
            )
            stopping = self._stopping.get(key)
            clock = stopping or Stopping.at(now)
            stop = stops.Stop(record.ref, record.cgroup, clock, kind=BLOCK, quiet=not stopping)
            after, commands = stops.advance_block(stop, seen, now, self._limits)
            if commands and not (stop.quiet and isinstance(commands[0], stops.Settled)):
                self._stopping[key] = after.stopping
            self._carry_out(record, commands)
            if record.step == Step.SETTLE and after.stopping.due(now):
                still.append(record)
        return still

    def _carry_out(self, record: Record, commands: Sequence[stops.Command]) -> None:
        """What core.stops.advance() said of a block's stop, done."""
        for command in commands:
            if isinstance(command, stops.Say):
                tell(self.log, command.event)
            elif isinstance(command, stops.Settled):
                if not self._move(record, Step.VERIFY):
                    return
                waited = command.waited
                record.note("not running" if waited is None else f"stopped after {waited:.2f}s")
                self._save(record)
            elif isinstance(command, stops.GiveUp):
                self._problem(record, command.why)
            else:
                how, killed = self.kernel.carry_out(command, self.managers.get(record.manager))
                if killed is False:
                    self._problem(record, f"cgroup kill: {how}")
                    continue
                record.note(f"killed: {how} ({command.why})")
                tell(self.log, command.event(how, cgroup=bool(killed)))

    def _running(self, record: Record) -> bool:
        """Whether the unit has anything to stop; True when its manager cannot say (stop it)."""
        manager = self.managers.get(record.manager)
        if manager is None:
            return True
        try:
            state = manager.unit_states([record.unit]).get(record.unit)
        except ManagerError:
            return True
        return not self._done(state, record.cgroup)

    def _done(self, state: UnitState | None, cgroup: str) -> bool:
        """Stopped by its manager's word and nothing left in its cgroup (core.block.settled;
        the cgroup is read only once its manager says stopped)."""
        active, load = (state.active_state, state.load_state) if state else (None, None)
        return settled(active, load, 0) and not self.kernel.pids(cgroup)

    def _kill_cgroup(self, record: Record, why: str) -> None:
        self._carry_out(record, (stops.Kill(record.ref, record.cgroup, why),))

    def _disable(self, record: Record, manager: ManagerPort) -> None:
        if any(not lr.removed for lr in record.links):
            manager.disable_unit_files(record.unit)
        who = self._owner(record)
        left = []
        for lr in record.links:
            if lr.removed:
                continue
            try:
                there = present(lr.path, who)
            except UnitFileError as e:
                # The way to it changed since the plan: not ours to check, nor to put back.
                record.note(f"disable: {lr.path} cannot be checked ({e}); not restored")
                continue
            if there:
                left.append(lr.path)
            else:
                lr.removed = True
                record.note(f"disabled: removed {lr.path} -> {lr.target}")
        if left:
            raise ManagerError(f"{record.manager} left {', '.join(left)} in place")
        self._move(record, Step.MASK)

    def _verify(self, batch: list[Record]) -> None:
        """LoadState must read 'masked'; a unit still loaded needs one daemon-reload."""
        for key in sorted({r.manager for r in batch}):
            records = [r for r in batch if r.manager == key]
            manager = self.managers.get(key)
            if manager is None:
                continue
            try:
                states = manager.unit_states([r.unit for r in records])
                if any(states[r.unit].load_state != "masked" for r in records if r.unit in states):
                    manager.reload()
                    for r in records:
                        r.note("manager reloaded to load the mask")
                    states = manager.unit_states([r.unit for r in records])
            except ManagerError as e:
                for r in records:
                    self._problem(r, f"verify: {e}")
                continue
            for r in records:
                st = states.get(r.unit)
                found = verdict(st.load_state if st else None, st.active_state if st else None)
                if found == Verdict.BLOCKED:
                    self._blocked(r)
                elif found == Verdict.RUNNING and st is not None:
                    # Something started it again before the mask took.
                    if self._move(r, Step.SETTLE):
                        self._problem(r, f"verify: {r.ref} is {st.active_state} again")
                else:
                    try:
                        shadow = shadowing_file(
                            manager.unit_path_dirs,
                            os.path.dirname(r.mask_path),
                            r.unit,
                            self._owner(r),
                        )
                    except UnitFileError:
                        shadow = None
                    why = f"{shadow} outranks the mask" if shadow else "LoadState is not masked"
                    self._problem(
                        r, f"verify: {r.ref}: {why} (LoadState={st.load_state if st else '?'})"
                    )

    def _blocked(self, record: Record) -> None:
        if not self._move(record, Step.BLOCKED):
            return
        record.problem = ""
        self._reported.pop(str(record.ref), None)
        removed = [lr.path for lr in record.links if lr.removed]
        record.note("verified: LoadState=masked")
        tell(
            self.log,
            Event.of(
                EventKind.UNIT_BLOCKED,
                "warning",
                unit=str(record.ref),
                manager=record.manager,
                reason=record.reason,
                mask=record.mask_path,
                links_removed=removed,
                record=self.store.path_of(record.ref),
                clients=record.clients or None,
                **record.figures,
                msg=f"{record.ref} is stopped, masked and disabled ({record.reason}: "
                f"{record.detail}); undo with: spark-guard release {record.ref}",
            ),
        )

    # --- containers (block/containers.py) -----------------------------------------

    def _start_container_block(self, record: Record, engine: str) -> None:
        """Stop and block the container through its engine, in a thread of its own."""
        key = str(record.ref)
        path = record.container.engine if record.container else engine
        path = path or self._engine_of.get(key, "")
        if not path:
            self._problem(record, "stop: no engine known for it")
            return
        if engine_owner(path, self.user_runtime) != record.ref.engine_owner:
            # Hers only through her own engine, root's only through root's (a record's
            # socket is the guard's own writing: this is never expected).
            self._problem(record, f"stop: {path} is not the engine of {record.ref}")
            return
        self._retry_at[key] = self.clock() + RETRY_AFTER
        self._killed.discard(key)
        self._engine_of[key] = path
        timeout = max(1, round(self.config.stop_timeout))
        engine_api = self.engine(path, self.engine_timeout)
        self.pending.start(
            key,
            lambda: container_block.block(
                engine_api,
                record,
                timeout,
                remember=self._save,
                answered=lambda: self.pending.mark_answered(key),
                seen_running=True,  # every block is of a container seen running
                hold=lambda r: self.store.held(r.ref, key in self._on_disk, self.engine_timeout),
            ),
        )
        self._stopping[key] = Stopping.at(self.clock())
        if self.clock() < self._silent_engines.get(path, 0.0):
            # Its engine did not answer a moment ago (dockerd at boot restarts containers
            # before its API serves): stopped from the kernel's side now, not in seconds.
            self._kill_container(record, f"{path} did not answer a moment ago")
        msg = f"stopping {key} through {path} ({record.reason})"
        how, reason = f"engine {path}", record.reason
        self._event(
            EventKind.UNIT_STOP_REQUESTED,
            record,
            msg,
            job=None,
            how=how,
            reason=reason,
            frozen=False,
        )

    def _advance_containers(self, boxes: list[Record], wait: float = 0.0) -> None:
        """Each container block: finished (blocked, or its problem said), still under way
        (its cgroup killed if memory runs short meanwhile), due again, or checked now and
        then that its policy still reads `no`."""
        now = self.clock()
        changed = False
        for record in boxes:
            key = str(record.ref)
            if key not in self.pending and self.store.releasing(record.ref):
                continue  # an admin's release puts its policy back now: not renewed under it
            if key not in self.pending and key in self._unsaved:
                # Its latest state could not be written (a full disk): tried every pass, as a
                # unit's is, so the disk never says less than the engine was told.
                self._save(record)
            if key in self.pending:
                finished, error = self.pending.done(key, wait)
                if not finished:
                    self._container_stuck(record)
                    continue
                changed = True
                if self._released_meanwhile(record) or self.store.releasing(record.ref):
                    self._stopping.pop(key, None)
                    continue  # its block or recheck stood back (held()): the release stands
                if record.step == Step.BLOCKED:  # a recheck's answer
                    if error:
                        self._problem(record, error)
                    continue
                self._container_done(record, error)
            elif record.step == Step.STOP and now >= self._retry_at.get(key, 0.0):
                if self._released_meanwhile(record):
                    continue
                self._start_container_block(record, "")  # resumed after a restart, or retried
            elif (
                record.step == Step.BLOCKED
                and record.container is not None
                and now >= self._retry_at.get(key, 0.0)
            ):
                self._retry_at[key] = now + CONTAINER_RECHECK
                engine_api = self.engine(record.container.engine, self.engine_timeout)
                self.pending.start(key, functools.partial(self._renew, engine_api, record))
        if changed:
            self._publish()

    def _renew(self, engine: EnginePort, record: Record) -> None:
        """In the block's thread: its policy set back by hand is set to `no` again (the
        next boot would start it); one started by hand is the sensor's to judge. Never
        under a release (F7): what a release put back is its own."""
        changed = container_block.holds(engine, record)
        if "restart policy" in changed:
            with self.store.held(record.ref, True, self.engine_timeout) as taken:
                if taken:
                    return
                engine.update_restart(record.container.id if record.container else "", "no")
                record.note(f"{changed}: set to no again")
                self._save(record)
            self._event(
                EventKind.BLOCK_RENEWED, record, f"{record.ref}: {changed}; set to no again"
            )

    def _container_stuck(self, record: Record) -> None:
        """A container block under way that cannot wait: its engine has not answered within
        its timeout, or MemAvailable is below the reserve. The container's cgroup is killed
        from here, once per run, as a unit's is when its manager does not answer. (A stop
        the engine took marks the container stopped by hand: its policy does not restart
        it; one the engine never saw may be restarted, and is killed again.)"""
        key = str(record.ref)
        if key in self._killed:
            return
        now = self.clock()
        stopping = self._stopping.get(key) or Stopping.at(now)
        answered = self.pending.answered(key)
        why = container_stuck(stopping, now, answered, self.engine_timeout, self._available())
        if why:
            self._kill_container(record, why)

    def _kill_container(self, record: Record, why: str) -> None:
        self._killed.add(str(record.ref))
        if self.kernel.pids(record.cgroup):
            self._kill_cgroup(record, why)  # (a container not running has nothing to kill)

    def _container_done(self, record: Record, error: str) -> None:
        key = str(record.ref)
        if record.ref.engine_owner and self.kernel.pids(record.cgroup):
            # Her engine is hers to make say anything ("stopped", "gone", an error): whatever
            # it said, her processes left in its scope when her block ends are killed from
            # the kernel's side, as her groups are. (A stop that went through left none.)
            self._kill_cgroup(
                record, f"her engine's block ended ({error or 'done'}), its processes ran on"
            )
        if error:
            if "no answer within" in error and key in self._engine_of:
                # Not stopped, and nothing will stop it while its engine is silent: killed
                # from the kernel's side now (and each run its policy starts meanwhile).
                self._silent_engines[self._engine_of[key]] = self.clock() + RETRY_AFTER
                if key not in self._killed:
                    self._kill_container(record, "its engine did not answer")
            elif error == container_block.NO_THREAD:
                self._kill_container(record, error)
            said = record.problem
            self._problem(record, f"stop: {error}")
            self._retry_at[key] = self.clock() + RETRY_AFTER
            if record.problem != said:
                self._save(record)  # a retry that fails the same way writes nothing
            return
        stopping = self._stopping.pop(key, None)
        waited = self.clock() - (stopping.sent if stopping else self.clock())
        if not self._move(record, Step.BLOCKED):
            return
        record.problem = ""
        self._reported.pop(key, None)
        self._retry_at[key] = self.clock() + CONTAINER_RECHECK
        state = record.container
        was = state.policy if state else "?"
        # None: removed (`--rm`) before its engine could be asked: no policy was changed.
        done = f"its restart policy set to no (was {was})" if state else "removed"
        record.note(f"verified: stopped, {'restart policy no' if state else 'removed'}")
        self._save(record)
        tell(
            self.log,
            Event.of(
                EventKind.UNIT_BLOCKED,
                "warning",
                unit=key,
                manager=record.manager,
                reason=record.reason,
                engine=state.engine if state else None,
                restart_was=was if state else None,
                seconds=round(waited, 3),
                record=self.store.path_of(record.ref),
                clients=record.clients or None,
                **record.figures,
                msg=f"{key} is stopped and {done} "
                f"({record.reason}: {record.detail}); undo with: spark-guard release {key}",
            ),
        )

    # --- bookkeeping ----------------------------------------------------------

    def _move(self, record: Record, to: Step) -> bool:
        """Every step change goes through here (core.block.TRANSITIONS says which may happen).
        One it does not allow is a bug: reported as block-failed and refused, the record
        staying where it was, rather than raised: an exception would end the guard's loop,
        and the record, resumed after each restart, would end it again."""
        try:
            record.move(to)
        except StepError as e:
            self._problem(record, str(e))
            return False
        return True

    def _problem(self, record: Record, problem: str) -> None:
        record.problem = problem
        key = str(record.ref)
        if self._reported.get(key) != problem:  # say it once, not on every retry
            self._reported[key] = problem
            record.note(f"problem: {problem}")
            self._event(EventKind.BLOCK_FAILED, record, f"{key}: {problem}", error=problem)

    def _event(self, kind: EventKind, record: Record, msg: str, **fields: Any) -> None:
        level: Level = "error" if kind == EventKind.BLOCK_FAILED else "warning"
        tell(
            self.log,
            Event(kind, level, msg, {"unit": str(record.ref), "manager": record.manager, **fields}),
        )

    def _save(self, record: Record) -> bool:
        """Write the record; False (said once) if it cannot be written now. It is then
        kept here, tried again every pass, and nothing that changes a file goes on."""
        key = str(record.ref)
        try:
            aside, why = self.store.save(record)
            if aside:
                tell(
                    self.log,
                    Event.of(
                        EventKind.RECORD_UNREADABLE,
                        "error",
                        error=why,
                        kept=aside,
                        msg=f"{why}; kept as {aside}, and a new record written in its place",
                    ),
                )
            self._on_disk.add(key)
            self._unsaved.discard(key)
            saved = True
        except OSError as e:
            self._unsaved.add(key)
            saved = False
            problem = f"cannot write {self.store.path_of(record.ref)}: {e}"
            if self._reported.get(key) != problem:
                self._reported[key] = problem
                self._event(EventKind.BLOCK_FAILED, record, f"{key}: {problem}", error=problem)
        with contextlib.suppress(OSError):
            self._generation = self.store.generation()
        return saved

    def _refresh(self) -> None:
        """Re-read the records when another process (release) changed them."""
        generation = self.store.generation()
        if generation == self._generation and generation != -1:
            return
        self._generation = generation
        records, errors = self.store.all()
        for e in errors:
            if self._reported.get(str(e)) is None:
                self._reported[str(e)] = str(e)
                tell(
                    self.log,
                    Event.of(EventKind.RECORD_UNREADABLE, "error", error=str(e), msg=str(e)),
                )
        if any(isinstance(e, Unlisted) for e in errors):
            # Not "no records": the ones known are kept and driven, and the store is read
            # again next pass (a failed listing is never taken for a release).
            self._generation = None
            return
        fresh = {str(r.ref): r for r in records}
        for key in fresh:
            if key in self.pending and key in self.records:
                fresh[key] = self.records[key]  # its block's thread holds this one
        for key in list(self._unsaved):
            if key in self.records and (key in fresh or key not in self._on_disk):
                fresh[key] = self.records[key]  # newer than the disk's, or never there
            elif key not in fresh:
                self._unsaved.discard(key)  # on disk once, gone now: released meanwhile
        self.records = fresh
        self._on_disk = {str(r.ref) for r in records}
        self._publish()

    def _publish(self) -> None:
        blocked = list(self.records.values())
        text = banner.render(blocked)
        if text == self._banner:
            return
        try:
            banner.publish(blocked, self.motd, self.issue)
            self._banner = text
        except OSError as e:
            why = f"cannot write the login note: {e}"
            tell(self.log, Event.of(EventKind.BANNER_FAILED, "error", error=str(e), msg=why))
