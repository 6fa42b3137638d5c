"""The executor of containers' blocks: their engine's stop, off the loop, and its end.

A container's block goes stop -> blocked through its engine (block/containers.py),
each in a thread of its own (the engine's stop waits its timeout). Meanwhile the loop
kills its cgroup from the kernel's side when memory runs short or its engine is silent
(core.block.container_stuck says when), once per run; a blocked container's restart
policy is read back every CONTAINER_RECHECK seconds, and set to `no` again if it was
set back by hand, never under a release (F7).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.block import RETRY_AFTER, Step, Stopping, container_stuck, forward, running_again
from ..core.events import Event, EventKind, tell
from ..system.engine import engine_owner
from . import containers as container_block
from .ledger import Ledger
from .ports import EnginePort
from .records import Record
from .settle import BlockStops

# How often a blocked container's restart policy is read back (an engine call, off the loop):
# a policy set back to `always` by hand would start it at the next boot.
CONTAINER_RECHECK = 30.0


@dataclass
class Boxes:
    """The containers' blocks under way, and the rechecks of those done."""

    ledger: Ledger
    # Blocks' stops: the one kill path, the memory figure, the config and the clock.
    settler: BlockStops
    engine: Callable[[str, float], EnginePort]
    pending: container_block.Pending = field(default_factory=container_block.Pending)
    _killed: set[str] = field(default_factory=set)  # killed from the kernel's side this run
    _silent: dict[str, float] = field(default_factory=dict)  # engine socket -> silent until
    _engine_of: dict[str, str] = field(default_factory=dict)  # container -> its block's engine
    _retry_at: dict[str, float] = field(default_factory=dict)
    _sent: dict[str, Stopping] = field(default_factory=dict)  # when each stop went out

    def __post_init__(self) -> None:
        self.kernel, self.config, self.clock = (
            self.settler.kernel,
            self.settler.config,
            self.settler.clock,
        )
        # Kept at their start-up values across a reload, as the blocker's paths are.
        self.engine_timeout = self.config().engine_timeout
        self.user_runtime = self.config().user_runtime

    def again(self, record: Record, cgroup: str, why: str) -> bool:
        """A decision finds the container running (again): True when its block is still under
        way, this run then killed too if its engine still does not answer; else its block
        begins again from its stop (`why` noted)."""
        key = str(record.ref)
        if key in self.pending:
            # Restarted by its engine's policy while the engine cannot be asked to stop it.
            self._killed.discard(key)
            record.cgroup = cgroup or record.cgroup
            self.stuck(record)
            return True
        record.note(why)
        back = running_again(record.step, True, container=True)
        if back is not None:
            self.ledger.move(record, back)
        return False

    def start(self, record: Record, engine: str) -> None:
        """Stop and block the container through its engine, in a thread of its own."""
        key = str(record.ref)
        path = record.container.engine if record.container else engine
        path = path or self._engine_of.get(key, "")
        if not path:
            self.ledger.problem(record, "stop: no engine known for it")
            return
        if engine_owner(path, self.user_runtime) != record.ref.engine_owner:
            # Hers only through her own engine, root's only through root's (a record's
            # socket is the guard's own writing: this is never expected).
            self.ledger.problem(record, f"stop: {path} is not the engine of {record.ref}")
            return
        self._retry_at[key] = self.clock() + RETRY_AFTER
        self._killed.discard(key)
        self._engine_of[key] = path
        timeout = max(1, round(self.config().stop_timeout))
        engine_api = self.engine(path, self.engine_timeout)
        ledger = self.ledger
        self.pending.start(
            key,
            lambda: container_block.block(
                engine_api,
                record,
                timeout,
                remember=ledger.save,
                answered=lambda: self.pending.mark_answered(key),
                seen_running=True,  # every block is of a container seen running
                hold=lambda r: ledger.store.held(r.ref, key in ledger.on_disk, self.engine_timeout),
            ),
        )
        self._sent[key] = Stopping.at(self.clock())
        if self.clock() < self._silent.get(path, 0.0):
            # Its engine did not answer a moment ago (dockerd at boot restarts containers
            # before its API serves): stopped from the kernel's side now, not in seconds.
            self._kill(record, f"{path} did not answer a moment ago")
        msg = f"stopping {key} through {path} ({record.reason})"
        fields = {"job": None, "how": f"engine {path}", "reason": record.reason, "frozen": False}
        self.ledger.event(EventKind.UNIT_STOP_REQUESTED, record, msg, **fields)

    def advance(self, boxes: list[Record], wait: float = 0.0) -> None:
        """Each container block: finished (blocked, or its problem said), still under way
        (its cgroup killed if memory runs short meanwhile), due again, or checked now and
        then that its policy still reads `no`."""
        now = self.clock()
        changed = False
        ledger = self.ledger
        for record in boxes:
            key = str(record.ref)
            if key not in self.pending and ledger.store.releasing(record.ref):
                continue  # an admin's release puts its policy back now: not renewed under it
            if key not in self.pending and key in ledger.unsaved:
                # Its latest state could not be written (a full disk): tried every pass, as a
                # unit's is, so the disk never says less than the engine was told.
                ledger.save(record)
            if key in self.pending:
                finished, error = self.pending.done(key, wait)
                if not finished:
                    self.stuck(record)
                    continue
                changed = True
                if ledger.released_meanwhile(record) or ledger.store.releasing(record.ref):
                    self._sent.pop(key, None)
                    continue  # its block or recheck stood back (held()): the release stands
                if record.step == Step.BLOCKED:  # a recheck's answer
                    if error:
                        ledger.problem(record, error)
                    continue
                self._done(record, error)
            elif record.step == Step.STOP and now >= self._retry_at.get(key, 0.0):
                if ledger.released_meanwhile(record):
                    continue
                self.start(record, "")  # resumed after a restart, or retried
            elif (
                record.step == Step.BLOCKED
                and record.container is not None
                and now >= self._retry_at.get(key, 0.0)
            ):
                self._retry_at[key] = now + CONTAINER_RECHECK
                engine_api = self.engine(record.container.engine, self.engine_timeout)
                self.pending.start(key, functools.partial(self._renew, engine_api, record))
        if changed:
            ledger.publish()

    def _renew(self, engine: EnginePort, record: Record) -> None:
        """In the block's thread: its policy set back by hand is set to `no` again (the
        next boot would start it); one started by hand is the sensor's to judge. Never
        under a release (F7): what a release put back is its own."""
        changed = container_block.holds(engine, record)
        if "restart policy" in changed:
            with self.ledger.store.held(record.ref, True, self.engine_timeout) as taken:
                if taken:
                    return
                engine.update_restart(record.container.id if record.container else "", "no")
                record.note(f"{changed}: set to no again")
                self.ledger.save(record)
            self.ledger.event(
                EventKind.BLOCK_RENEWED, record, f"{record.ref}: {changed}; set to no again"
            )

    def stuck(self, record: Record) -> None:
        """A container block under way that cannot wait: its engine has not answered within
        its timeout, or MemAvailable is below the reserve. The container's cgroup is killed
        from here, once per run, as a unit's is when its manager does not answer. (A stop
        the engine took marks the container stopped by hand: its policy does not restart
        it; one the engine never saw may be restarted, and is killed again.)"""
        key = str(record.ref)
        if key in self._killed:
            return
        now = self.clock()
        stopping = self._sent.get(key) or Stopping.at(now)
        answered = self.pending.answered(key)
        why = container_stuck(
            stopping, now, answered, self.engine_timeout, self.settler.available()
        )
        if why:
            self._kill(record, why)

    def _kill(self, record: Record, why: str) -> None:
        self._killed.add(str(record.ref))
        if self.kernel.pids(record.cgroup):
            self.settler.kill_cgroup(record, why)  # (a container not running has nothing to kill)

    def _done(self, record: Record, error: str) -> None:
        key = str(record.ref)
        if record.ref.engine_owner and self.kernel.pids(record.cgroup):
            # Her engine is hers to make say anything ("stopped", "gone", an error): whatever
            # it said, her processes left in its scope when her block ends are killed from
            # the kernel's side, as her groups are. (A stop that went through left none.)
            why = f"her engine's block ended ({error or 'done'}), its processes ran on"
            self.settler.kill_cgroup(record, why)
        if error:
            self._failed(record, error)
            return
        stopping = self._sent.pop(key, None)
        waited = self.clock() - (stopping.sent if stopping else self.clock())
        if not self.ledger.move(record, forward(record.step, container=True)):
            return
        self.ledger.solved(record)
        self._retry_at[key] = self.clock() + CONTAINER_RECHECK
        state = record.container
        was = state.policy if state else "?"
        # None: removed (`--rm`) before its engine could be asked: no policy was changed.
        done = f"its restart policy set to no (was {was})" if state else "removed"
        record.note(f"verified: stopped, {'restart policy no' if state else 'removed'}")
        self.ledger.save(record)
        tell(
            self.ledger.log,
            Event.of(
                EventKind.UNIT_BLOCKED,
                "warning",
                unit=key,
                manager=record.manager,
                reason=record.reason,
                engine=state.engine if state else None,
                restart_was=was if state else None,
                seconds=round(waited, 3),
                record=self.ledger.store.path_of(record.ref),
                clients=record.clients or None,
                **record.figures,
                msg=f"{key} is stopped and {done} "
                f"({record.reason}: {record.detail}); undo with: spark-guard release {key}",
            ),
        )

    def _failed(self, record: Record, error: str) -> None:
        key = str(record.ref)
        if "no answer within" in error and key in self._engine_of:
            # Not stopped, and nothing will stop it while its engine is silent: killed
            # from the kernel's side now (and each run its policy starts meanwhile).
            self._silent[self._engine_of[key]] = self.clock() + RETRY_AFTER
            if key not in self._killed:
                self._kill(record, "its engine did not answer")
        elif error == container_block.NO_THREAD:
            self._kill(record, error)
        said = record.problem
        self.ledger.problem(record, f"stop: {error}")
        self._retry_at[key] = self.clock() + RETRY_AFTER
        if record.problem != said:
            self.ledger.save(record)  # a retry that fails the same way writes nothing
