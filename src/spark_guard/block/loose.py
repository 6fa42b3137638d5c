"""The executor of stop-only stops: reads what core/stops.py needs, does what it says.

A stop-only stop has no record and no mask: the server is stopped (a unit frozen
first, through its manager; a container through its engine, in a thread, since the
engine's stop waits its timeout) and may start again, loading nothing. Each stop is
one core.stops.Stop value, kept here and on disk (`stopping/`) until it settles;
what follows it is core.stops.advance()'s to say. This module only reads (Seen),
carries out the commands (Kill, Say) and keeps the values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core import stops
from ..core.config import Config
from ..core.events import tell
from ..core.snapshot import Action, UnitRef
from ..system.managers import ManagerError
from ..system.worker import spawn
from .brake import Brake
from .kernel import Kernel
from .ports import EnginePort, ManagerPort
from .records import PendingStop

if TYPE_CHECKING:
    pass


@dataclass
class _Box:
    """A container's stop in its engine's hands: the thread, and what went wrong."""

    thread: threading.Thread | None = None
    error: str = ""

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class LooseStops:
    """The stop-only stops under way, each a core.stops.Stop."""

    def __init__(
        self,
        managers: Mapping[str, ManagerPort],
        kernel: Kernel,
        brakes: Brake,
        engine: Callable[[str, float], EnginePort],
        adopt: bool = False,
    ) -> None:
        self.managers, self.kernel, self.brakes, self.engine = managers, kernel, brakes, engine
        # The brake's store, boot and clock: a freeze it made may become a stop's.
        self.store, self.boot, self.clock = brakes.store, brakes.boot_id, brakes.clock
        self.log = brakes.log
        self.stops: dict[str, stops.Stop] = {}
        self._boxes: dict[str, _Box] = {}
        # The stops an earlier guard kept on disk: the daemon adopts them (read once); a
        # one-shot rescue leaves them to the daemon.
        self._loaded = not adopt

    @property
    def busy(self) -> bool:
        return any(not s.waiting for s in self.stops.values())

    def under_way(self) -> frozenset[UnitRef]:
        """The units of the stops under way (an earlier guard's adopted first)."""
        if not self._loaded:
            self._load()
        return frozenset(s.ref for s in self.stops.values())

    def settling(self, now: float) -> bool:
        return any(s.stopping.due(now) and not s.waiting for s in self.stops.values())

    def start(self, action: Action, cgroup: str, engine: str, config: Config) -> None:
        """A stop-only stop: a container's through its engine, a unit's through its manager."""
        if action.unit.is_container:
            self._stop_container(action, cgroup, engine, config.stop_timeout, config.engine_timeout)
        else:
            self._stop(action, cgroup)

    def _stop(self, action: Action, cgroup: str) -> None:
        """Stop a unit through its manager, frozen first; its cgroup killed if the manager
        does not take the stop."""
        ref = action.unit
        if str(ref) in self.stops:
            return  # one under way: its escalation goes on from its own stop
        manager = self.managers.get(ref.manager)
        # Frozen by the brake: it is this stop's now, and release_brakes() must not thaw it.
        braked = frozen = self.brakes.take(ref)
        try:
            if manager is None:
                raise ManagerError(f"{ref.manager} manager is not connected")
            if not frozen:
                frozen, _ = self.brakes.freeze_unit(ref, manager)
            went_to = self.kernel.processes(cgroup)  # (frozen: none can fork or exit)
            job = manager.stop_unit(ref.name)
        except ManagerError as e:
            self._run((stops.refused(ref, cgroup, str(e)),))
            if braked and self.kernel.populated(cgroup) is not False:
                self.brakes.give_back(ref)  # not stopped: the brake's to thaw
            return
        ignores = frozen and self.kernel.ignores_sigterm(cgroup)
        stop, commands = stops.sent(
            ref,
            cgroup,
            self.clock(),
            action.reason,
            job=job,
            frozen=frozen,
            went_to=went_to,
            ignores_sigterm=ignores,
        )
        self._keep(stop)
        self._run(commands)

    def _stop_container(
        self, action: Action, cgroup: str, engine: str, stop_timeout: float, timeout: float
    ) -> None:
        """Stop a container through its engine, its restart policy left as it is (a stop
        by hand is not restarted by it), in a thread: the engine's stop waits, then kills."""
        ref = action.unit
        key = str(ref)
        if key in self.stops:
            return  # one under way
        box = self._boxes[key] = _Box()
        stop, commands = stops.sent(ref, cgroup, self.clock(), action.reason, engine=engine)
        self._keep(stop)
        if not engine:
            box.error = "no engine known for it"  # said by advance()
            return
        api = self.engine(engine, timeout)
        wait = max(1, round(stop_timeout))

        def run() -> None:
            try:
                api.stop(ref.container, wait)
            except Exception as e:  # said by advance(), in the loop
                box.error = str(e) or type(e).__name__

        box.thread = spawn(run, f"stop-only {key}")
        if box.thread is None:
            box.error = "cannot start a thread for its stop (a pids limit?)"
        self._run(commands)

    def advance(self, memory: Callable[[], tuple[int, int] | None], limits: stops.Limits) -> None:
        """One look at each stop, and what core.stops.advance() says of it done. `memory`:
        the judged figure and the reserve, asked only when a stop is under way."""
        if not self._loaded:
            self._load()
        figure = memory() if self.stops else None
        for key, stop in list(self.stops.items()):
            now = self.clock()
            after, commands = stops.advance(stop, self._seen(stop, figure), now, limits)
            if after is None:
                self._forget(key)
            else:
                self.stops[key] = after
            self._run(commands)

    def _seen(self, stop: stops.Stop, memory: tuple[int, int] | None) -> stops.Seen:
        """What advance() needs, its manager's word first: the processes are read after it,
        so a run that started meanwhile is never taken for the one the stop went to."""
        answer: dict[str, Any] = {}
        box = self._boxes.get(str(stop.ref))
        manager = self.managers.get(stop.ref.manager)
        if stop.kind == stops.Kind.ENGINE:
            answer = {"busy": box.busy, "error": box.error} if box else {}
        elif manager is None:
            answer = {"manager": False}
        else:
            try:
                st = manager.unit_states([stop.ref.name]).get(stop.ref.name)
                answer = {
                    "active_state": st and st.active_state,
                    "load_state": st and st.load_state,
                }
            except ManagerError:
                answer = {"answered": False}
        return stops.Seen(self.kernel.processes(stop.cgroup), memory=memory, **answer)

    def _run(self, commands: tuple[stops.Command, ...]) -> None:
        for command in commands:
            if isinstance(command, stops.Say):
                tell(self.log, command.event)
            elif isinstance(command, stops.Kill):
                manager = self.managers.get(command.ref.manager)
                how, killed = self.kernel.carry_out(command, manager)
                tell(self.log, command.event(how, cgroup=bool(killed) and not command.failed))

    def _keep(self, stop: stops.Stop) -> None:
        """Kept in memory and on disk: a guard restarted before the server has gone
        escalates it still."""
        self.stops[str(stop.ref)] = stop
        try:
            kept = PendingStop.of(stop.ref, stop.cgroup, stop.stopping.sent, self.boot)
            self.store.save_stop(kept)
        except OSError as e:  # a full or read-only disk: this guard still escalates it
            tell(self.log, stops.unwritten(stop.ref, str(e)))

    def _forget(self, key: str) -> None:
        stop = self.stops.pop(key)
        self._boxes.pop(key, None)
        self.store.forget_stop(stop.ref)

    def _load(self) -> None:
        """The stops an earlier guard of this boot sent and did not see settle."""
        self._loaded = True
        kept, errors = self.store.stops()
        for e in errors:
            tell(self.log, stops.unreadable(str(e)))
        now = self.clock()
        for pending in kept:
            stop = stops.restored(
                pending.ref, pending.cgroup, pending.sent, pending.boot_id, self.boot, now
            )
            if stop is None:
                self.store.forget_stop(pending.ref)
            elif str(stop.ref) not in self.stops:
                self.stops[str(stop.ref)] = stop
