"""The executor of blocks' stops: reads what core/stops.py needs, does what it says.

A unit's block sends its stop (blocker.py), lays its files, and then settles: each pass
reads the units at `settle` (batched per manager; each cgroup only once its manager
says stopped), hands core.stops.advance_block() a Seen, and carries out its commands:
a kill (through the manager, else the cgroup from the kernel's side), a give-up (the
record's problem), or settled (the record goes on to verify). Each stop's clock is kept
in its record (Record.stopping), so a guard restarted while it settles goes on from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..core import stops
from ..core.block import Stopping, forward, settled
from ..core.config import Config
from ..core.events import tell
from ..core.snapshot import Memory, MemoryRule, UnitRef, judged
from ..system.managers import ManagerError, UnitState
from ..system.procfs import ProcError, ProcFS
from .kernel import Kernel
from .ledger import Ledger
from .ports import ManagerPort
from .records import Record

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import


class BlockStops:
    """The stops this guard sent for blocks, each by its clock (core.block.Stopping)."""

    def __init__(
        self,
        managers: Mapping[str, ManagerPort],
        ledger: Ledger,
        kernel: Kernel,
        proc: ProcFS,
        config: Callable[[], Config],
        clock: Callable[[], float],
        boot: str,
    ) -> None:
        self.managers, self.ledger, self.kernel, self.proc = managers, ledger, kernel, proc
        self.config, self.clock, self.boot = config, clock, boot
        self.log: FilteringBoundLogger = ledger.log
        # The pass's reading of /proc/meminfo and which figure of it is judged: the last
        # decision's (reading()).
        self._memory: Memory | None = None
        self._rule = MemoryRule()

    def reading(self, memory: Memory | None, rule: MemoryRule | None) -> None:
        """The pass's reading of memory (None: read afresh when asked) and, where given, the
        figure the decision judged."""
        self._memory, self._rule = memory, rule or self._rule

    def available(self) -> tuple[int, int] | None:
        """(the judged figure: MemAvailable, or the device headroom on unified memory;
        reserve) now; None when /proc cannot say."""
        memory = self._memory
        if memory is None:
            try:
                memory = self.proc.memory()
            except ProcError:
                return None
        return judged(memory, self._rule), self.config().reserve_for(memory.total)

    def limits(self) -> stops.Limits:
        config = self.config()
        return stops.Limits(config.stop_timeout, config.kill_timeout)

    def clock_of(self, record: Record) -> Stopping | None:
        """Its stop's clock: None when none was sent in this boot (a stop a guard sent
        before a reboot stopped nothing that runs now)."""
        return record.stopping if record.stopping_boot == self.boot else None

    def _keep(self, record: Record, stopping: Stopping | None) -> None:
        record.stopping, record.stopping_boot = stopping, self.boot if stopping else ""

    def sent(self, record: Record, frozen: bool) -> None:
        """Its stop went out now: its clock starts. A frozen unit with a process that ignores
        SIGTERM is killed at once: the stop would wait out its timeout, thawed and
        allocating; killed now, the frozen processes never run another instruction."""
        self._keep(record, Stopping.at(self.clock()))
        if frozen and self.kernel.ignores_sigterm(record.cgroup):
            why = "it ignores SIGTERM (seen while frozen)"
            self.carry_out(record, (stops.Kill(record.ref, record.cgroup, why, unit=True),))
            self._keep(record, Stopping.at(self.clock()).killed(self.clock()))

    def settle(self, batch: list[Record]) -> list[Record]:
        """One look at units being stopped (core.stops.advance_block, batched per manager):
        the settled go on to 'verify', the others are escalated on time or on memory.
        Returns those still stopping."""
        states: dict[str, UnitState | None] = {}
        silent: set[str] = set()
        for key in sorted({r.manager for r in batch} & set(self.managers)):
            names = [r.unit for r in batch if r.manager == key]
            try:
                read = self.managers[key].unit_states(names)
                states |= {str(UnitRef(key, n)): st for n, st in read.items()}
            except ManagerError:
                silent.add(key)  # not answering: the deadlines still run
        memory = self.available()
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
            stopping = self.clock_of(record)
            clock = stopping or Stopping.at(now)
            kind = stops.Kind.BLOCK
            stop = stops.Stop(record.ref, record.cgroup, clock, kind=kind, quiet=not stopping)
            after, commands = stops.advance_block(stop, seen, now, self.limits())
            if commands and not (stop.quiet and isinstance(commands[0], stops.Settled)):
                self._keep(record, after.stopping)
            self.carry_out(record, commands)
            done = any(isinstance(c, stops.Settled) for c in commands)
            if not done and after.stopping.due(now):
                still.append(record)
        return still

    def carry_out(self, record: Record, commands: Sequence[stops.Command]) -> None:
        """What core.stops.advance_block() said of a block's stop, done."""
        for command in commands:
            if isinstance(command, stops.Say):
                tell(self.log, command.event)
            elif isinstance(command, stops.Settled):
                if not self.ledger.move(record, forward(record.step)):
                    return
                waited = command.waited
                record.note("not running" if waited is None else f"stopped after {waited:.2f}s")
                self.ledger.save(record)
            elif isinstance(command, stops.GiveUp):
                self.ledger.problem(record, command.why)
            else:
                how, killed = self.kernel.carry_out(command, self.managers.get(record.manager))
                if killed is False:
                    self.ledger.problem(record, f"cgroup kill: {how}")
                    continue
                record.note(f"killed: {how} ({command.why})")
                tell(self.log, command.event(how, cgroup=bool(killed)))

    def kill_cgroup(self, record: Record, why: str) -> None:
        """Its cgroup killed from the kernel's side (its manager or engine did not answer)."""
        self.carry_out(record, (stops.Kill(record.ref, record.cgroup, why),))

    def running(self, record: Record) -> bool:
        """Whether the unit has anything to stop: not stopped by its manager's word, or
        something left in its cgroup; True when its manager cannot say (stop it)."""
        manager = self.managers.get(record.manager)
        if manager is None:
            return True
        try:
            state = manager.unit_states([record.unit]).get(record.unit)
        except ManagerError:
            return True
        active, load = (state.active_state, state.load_state) if state else (None, None)
        return not (settled(active, load, 0) and not self.kernel.pids(record.cgroup))
