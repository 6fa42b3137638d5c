"""`spark-guard run`: the watch loop, sense -> decide -> act, as a Type=notify service.

READY=1 goes out once the first snapshot is taken and the managers are
connected, i.e. as soon as the guard can act. STATUS= carries a one-line
summary for `systemctl status`; WATCHDOG=1 is sent from the loop itself so a
wedged loop is restarted by the manager.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
import traceback
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import sdnotify

from . import config as config_mod
from .act import act
from .block.blocker import Blocker
from .core.config import Config, ConfigError
from .core.events import Event, EventKind, tell
from .core.policy import brake, full_look_due, poll_interval
from .core.quantities import format_size
from .core.snapshot import Decision, Memory, Snapshot, judged
from .core.step import GuardState, remember, step
from .core.text import printable
from .metrics import TextfileWriter
from .roomkeeper import RoomKeeper
from .sense import Sensor
from .statefile import PublishedState, Publisher
from .statefile import build as build_state
from .system.cgroupfs import cpu_seconds, v2_root
from .system.memlock import mlockall
from .system.procfs import ProcError
from .system.psi import PsiTrigger
from .system.reclaim import RoomMaker

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

# The brake looks this far ahead, in units of (a full look + the wait before the next
# read of MemAvailable): the look's time and the wait both vary pass to pass.
BRAKE_MARGIN = 1.5


class Guard:
    """The daemon: one loop that senses, decides and acts, pass after pass, until SIGTERM.

    I/O only: owns the Sensor (sense), the Blocker (act), the state.json Publisher,
    the metrics writer and the sd_notify link. What it remembers for its judgement
    is one GuardState value, and step() (pure) turns it and a Snapshot into the next
    one. Each pass reads MemAvailable, lets the brake freeze what is about to cross
    the reserve, takes a full look (look()) when one is due, then waits on the PSI
    trigger, a signal or a worker's wake-up.
    """

    def __init__(
        self,
        config: Config,
        config_path: Path,
        log: FilteringBoundLogger,
        *,
        dry_run: bool,
        config_error: ConfigError | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.log = log
        # --dry-run on the command line holds for the life of the process; the config's
        # [guard] dry_run follows the file, reload by reload, both ways.
        self.dry_run_flag = dry_run
        self.dry_run = dry_run or config.dry_run
        self.config_error = config_error
        self.notifier = sdnotify.SystemdNotifier()
        # A manager call that came back, answered or timed out, is progress: the watchdog
        # is pinged then too, so a pass of several bounded calls is never taken for a wedge.
        # Models read, managers connected, engines answered off the loop wake it for a look.
        self.sensor = Sensor(
            config,
            log,
            heartbeat=lambda: self._watchdog(time.monotonic()),
            on_answer=self._look_now,
        )
        self.blocker = Blocker(
            self.sensor.answering,  # (a manager late in the last pass is left out)
            config,
            log,
            tick=lambda: self.notifier.notify("WATCHDOG=1"),
            adopt_stops=True,  # a stop-only stop an earlier guard sent is escalated here
        )
        self.state = GuardState()
        self.publisher = Publisher(config.runtime)
        self.metrics = TextfileWriter(config.metrics_textfile)
        self._metrics_problem = ""
        self._decided_at = 0.0
        self._decision_seconds = 0.0
        self._pinged_at = 0.0  # wall clock of the last WATCHDOG=1, for the metrics
        self._last_status = ""
        self._force_full = False  # a reload changes what counts: look at everything once
        self._pinged = -1e9
        watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        self._watchdog_every = watchdog_usec / 3e6 if watchdog_usec else 1.0
        self._interval = 0.0  # the last wait between passes
        self._failures_said: dict[str, float] = {}  # a failed pass's error -> said again from
        self._stop = False
        self._reload = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.psi: PsiTrigger | None = None
        # Built once: the loop only waits on it.
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        # Room for the GPU is made off the loop (system/reclaim.py); its answer wakes it.
        maker = RoomMaker(
            self.sensor.proc,
            v2_root(config.cgroup),
            os.path.join(config.proc, "sys", "vm"),
            on_done=self._wake_up,
        )
        self.room = RoomKeeper(maker, config, log, on_change=self._look_now)

    # --- signals --------------------------------------------------------------

    def _on_term(self, _signum: int, _frame: FrameType | None) -> None:
        self._stop = True

    def _on_hup(self, _signum: int, _frame: FrameType | None) -> None:
        self._reload = True

    def _look_now(self) -> None:
        """From a worker thread (a model read, a manager connected): an answer is in, the
        next pass takes it now."""
        self._force_full = True
        self._wake_up()

    def _wake_up(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"m")

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGHUP, self._on_hup)
        # A signal writes a byte here, so it ends the poll() at once.
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    # --- the loop -------------------------------------------------------------

    def run(self) -> int:
        self.install_signals()
        try:
            self.psi = PsiTrigger(self.config.proc, self.config.psi_stall)
            if self.psi.fd is not None:
                self._poller.register(self.psi.fd, select.POLLPRI)
        except OSError as e:
            tell(
                self.log,
                Event.of(
                    EventKind.PSI_TRIGGER_OFF,
                    "info",
                    error=str(e),
                    msg=f"memory pressure trigger unavailable, polling only: {e}",
                ),
            )
        self.sensor.refresh_managers()
        ready = False
        next_refresh = 0.0
        decision: Decision | None = None
        snapshot: Snapshot | None = None
        pressure = False
        while not self._stop:
            try:
                ready, next_refresh, decision, snapshot, pressure = self._pass(
                    ready, next_refresh, decision, snapshot, pressure
                )
            except Exception as e:
                # The guard never dies of a pass: a restart would meet the same fault, and
                # the machine would be unguarded meanwhile. Ready even so: boot waits on it.
                self._pass_failed(e)
                if not ready:
                    ready = True
                    self.notifier.notify("READY=1")
                self._watchdog(time.monotonic())
                pressure = self._wait(self.config.poll_min)
        self.notifier.notify("STOPPING=1")
        tell(self.log, Event.of(EventKind.GUARD_STOPPING, "info", msg="spark-guard stopping"))
        self.close()
        return 0

    def _pass(
        self,
        ready: bool,
        next_refresh: float,
        decision: Decision | None,
        snapshot: Snapshot | None,
        pressure: bool,
    ) -> tuple[bool, float, Decision | None, Snapshot | None, bool]:
        """One pass of the loop: what it carries to the next is handed back."""
        if self._reload:
            self._reload = False
            self.reload()
        now = time.monotonic()
        memory = self._memory()
        # Room for the GPU first (unified memory): a write handed to a thread, never a
        # wait; then the brake: a loader about to take the headroom below the reserve
        # is frozen now, not after the full look (0.1-0.5 s) that decides on it.
        self.room.tick(None if self.dry_run else memory, decision, self.state.new_loaders, now)
        braked = self._brake(memory, snapshot, decision, now)
        if (
            pressure
            or self._force_full
            or braked
            or self._full_look_due(memory, snapshot, decision, now)
        ):
            self._force_full = False
            if now >= next_refresh:
                self.sensor.refresh_managers(wait=0)  # connections come in off the loop
                next_refresh = now + 2.0
            decision, snapshot = self.look(memory)
        if self.blocker.braked:
            self.blocker.release_brakes()  # what the decision did not block goes on
        if not ready and snapshot is not None:
            ready = True
            tell(
                self.log,
                Event.of(
                    EventKind.GUARD_STARTED,
                    "info",
                    dry_run=self.dry_run,
                    managers=sorted(self.sensor.managers),
                    gpu=snapshot.gpu_accounting,
                    msg="spark-guard watching"
                    + (" (dry run: deciding, not acting)" if self.dry_run else "")
                    + (
                        ""
                        if self.sensor.managers
                        else "; no systemd manager reached yet: no unit can be seen or "
                        "stopped until one answers (systemd not PID 1, or no right to "
                        "its private socket)"
                    ),
                ),
            )
            self.notifier.notify("READY=1")
        self._watchdog(now)
        interval = poll_interval(
            decision, snapshot, self.config, memory, spent=time.monotonic() - now
        )
        if self.blocker.settling:
            # A stop under way is looked at by the loop, not waited in: back within poll.min.
            interval = min(interval, self.config.poll_min)
        self._interval = interval
        pressure = self._wait(interval)
        return ready, next_refresh, decision, snapshot, pressure

    def _pass_failed(self, error: Exception) -> None:
        """A pass that raised: said as one event with its traceback, the same error at most
        once a minute, and the loop goes on."""
        text = f"{type(error).__name__}: {error}"
        now = time.monotonic()
        if now < self._failures_said.get(text, 0.0):
            return
        if len(self._failures_said) >= 64:  # errors that carry PIDs or sizes: bounded
            self._failures_said = {k: t for k, t in self._failures_said.items() if t > now}
            if len(self._failures_said) >= 64:
                self._failures_said.clear()
        self._failures_said[text] = now + 60.0
        where = "".join(traceback.format_exception(error)[-8:])
        tell(
            self.log,
            Event.of(
                EventKind.PASS_FAILED,
                "error",
                error=text,
                traceback=where,
                msg=f"a pass of the loop failed, going on: {text}",
            ),
        )

    def look(self, memory: Memory | None = None) -> tuple[Decision | None, Snapshot | None]:
        """A full look: sense -> step -> act; never raises for a bad reading. `memory`: the
        pass's reading of /proc/meminfo, carried in the snapshot (read there when None)."""
        began = time.monotonic()
        try:
            snapshot = self.sensor.snapshot(
                rescue=not self.state.boot_over, memory=memory, room=self.room.view(began)
            )
            snapshot = replace(snapshot, stopping=self.blocker.stopping)  # the guard's own
        except ProcError as e:
            tell(self.log, Event.of(EventKind.SENSE_FAILED, "error", error=str(e), msg=str(e)))
            self._status(None, None)
            return None, None
        outcome = step(self.state, snapshot, self.config, dry_run=self.dry_run)
        self._decision_seconds = time.monotonic() - began
        self._decided_at = time.time()
        self.state = outcome.state
        act(outcome, self.blocker, self.log)
        if not self.dry_run:
            self.blocker.advance(snapshot.memory, snapshot.rule)
        self._status(outcome.decision, outcome.snapshot)
        self._publish(outcome.decision, outcome.snapshot)
        return outcome.decision, outcome.snapshot

    def _publish(self, decision: Decision, snapshot: Snapshot) -> None:
        state = build_state(
            decision,
            snapshot,
            self.blocker.records.values(),
            dry_run=self.dry_run,
            last_action=self.state.last_action,
            config_error=str(self.config_error) if self.config_error else None,
            counts={"actions": dict(self.state.counts), "starts": dict(self.state.starts)},
            decided_at=self._decided_at,
            decision_seconds=self._decision_seconds,
            watchdog_at=self._pinged_at,
            room_made=self.room.counts,
            managers=sorted(self.sensor.managers),
        )
        try:
            written = self.publisher.publish(state)
        except OSError as e:
            tell(
                self.log,
                Event.of(
                    EventKind.STATE_UNWRITTEN,
                    "debug",
                    error=str(e),
                    msg=f"cannot publish state: {e}",
                ),
            )
            return
        if written is not None and self.metrics.wanted:
            self._write_metrics(written)

    def _write_metrics(self, state: PublishedState) -> None:
        root = v2_root(self.config.cgroup)
        cpu = {
            ld["unit"]: used
            for ld in state["loaders"]
            if ld["cgroup"] and (used := cpu_seconds(root, ld["cgroup"])) is not None
        }
        self.metrics.write(state, cpu)
        if self.metrics.problem and self.metrics.problem != self._metrics_problem:
            tell(
                self.log,
                Event.of(
                    EventKind.METRICS_OFF,
                    "warning",
                    error=self.metrics.problem,
                    msg=f"Prometheus metrics not written: {self.metrics.problem}",
                ),
            )
        self._metrics_problem = self.metrics.problem

    def _memory(self) -> Memory | None:
        try:
            return self.sensor.proc.memory()
        except ProcError:
            return None  # the full pass says what is wrong

    def _brake(
        self,
        memory: Memory | None,
        snapshot: Snapshot | None,
        decision: Decision | None,
        now: float,
    ) -> bool:
        """Freeze the growing loaders at once when MemAvailable is below the reserve, or will
        be before the guard reads it again; True when it froze any (a full look follows).
        A few D-Bus calls on the managers' private sockets: no fork, no exec, no system bus."""
        if self.dry_run or memory is None or snapshot is None or decision is None:
            return False
        lookahead = BRAKE_MARGIN * (self._decision_seconds + max(self._interval, 0.0))
        refs = brake(
            memory,
            now,
            self.state.history,
            decision,
            self.config,
            lookahead,
            self.state.new_loaders,
        )
        if not refs:
            return False
        reserve = self.config.reserve_for(memory.total)
        headroom = judged(memory, decision.rule)
        why = (
            f"{'device headroom' if decision.rule.unified else 'MemAvailable'} "
            f"{format_size(headroom)} "
            + ("below" if headroom < reserve else "falling toward")
            + f" the reserve {format_size(reserve)}"
        )
        frozen = self.blocker.brake(
            refs, why, mem_available=memory.available, reserve=reserve, lookahead=lookahead
        )
        return bool(frozen)

    def _full_look_due(
        self,
        memory: Memory | None,
        snapshot: Snapshot | None,
        decision: Decision | None,
        now: float,
    ) -> bool:
        """A quiet steady pass reads MemAvailable only (and keeps it for the trend)."""
        if snapshot is None or decision is None or memory is None:
            return True
        if full_look_due(memory, snapshot, decision.reserve, now, busy=self.blocker.busy):
            return True
        self.state = remember(self.state, now, judged(memory, snapshot.rule), self.config)
        return False

    def _watchdog(self, now: float) -> None:
        # systemd wants a ping within WatchdogSec=; a third of it is plenty, not every pass.
        if now - self._pinged >= self._watchdog_every:
            self.notifier.notify("WATCHDOG=1")
            self._pinged = now
            self._pinged_at = time.time()

    def _wait(self, timeout: float) -> bool:
        """Sleep until the next pass; True when a memory pressure event ended it."""
        poller = self._poller
        start = time.monotonic()
        try:
            events = poller.poll(timeout * 1000)
        except OSError:
            # poll() is restarted after a signal, but a ptrace attach (gdb, py-spy) can end it
            # with the kernel's internal ERESTART* errno: a short wait, never a dead guard.
            events = []
        pressure = False
        for fd, _ in events:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 64)
            else:
                pressure = True
        if pressure:
            # The kernel fires at most once per PSI window (2 s): one line per event at most.
            waited = time.monotonic() - start
            tell(
                self.log,
                Event.of(
                    EventKind.PRESSURE_WAKE,
                    "info",
                    waited=round(waited, 3),
                    poll=round(timeout, 3),
                    msg=f"memory pressure woke the guard {waited:.2f}s into a {timeout:.2f}s wait",
                ),
            )
        if pressure and not self._stop and not self._reload:
            # A pressure event: act now, but never spin faster than poll.min.
            rest = self.config.poll_min - (time.monotonic() - start)
            if rest > 0:
                time.sleep(rest)
        return pressure

    def _status(self, decision: Decision | None, snapshot: Snapshot | None) -> None:
        # One line for `systemctl status`: a config error or a unit can carry a user's text.
        line = printable(self.status_line(decision, snapshot))
        if line != self._last_status:  # one datagram per change, not per pass
            self._last_status = line
            self.notifier.notify("STATUS=" + line)

    def status_line(self, decision: Decision | None, snapshot: Snapshot | None) -> str:
        parts = []
        if self.config_error is not None:
            parts.append(f"CONFIG ERROR, built-in defaults in use: {self.config_error}")
        if decision is None or snapshot is None:
            parts.append("cannot read memory state")
        else:
            memory = snapshot.memory
            device = ""
            if decision.rule.unified and memory.free is not None:
                device = (
                    f"MemFree {format_size(memory.free)} (floor {format_size(decision.floor)}), "
                    f"headroom {format_size(decision.headroom)}, "
                )
            parts.append(
                f"{decision.phase}{' dry-run' if self.dry_run else ''}; "
                f"available {format_size(memory.available)}, {device}"
                f"reserve {format_size(decision.reserve)}; "
                f"loaders {len(decision.loaders)}; blocked {len(self.blocker.records)}; "
                f"last action: {self.state.last_action}"
            )
        return " | ".join(parts)

    def reload(self) -> None:
        """SIGHUP: take a valid config, refuse a broken one and keep the last good one."""
        self.notifier.notify("RELOADING=1")
        try:
            new = config_mod.load(self.config_path)
        except ConfigError as e:
            tell(
                self.log,
                Event.of(
                    EventKind.CONFIG_RELOAD_REFUSED,
                    "error",
                    file=str(self.config_path),
                    error=str(e),
                    msg=f"config reload refused, keeping the running config: {e}",
                ),
            )
        else:
            self.config = new
            self.config_error = None
            self.sensor.reconfigure(new)
            self.blocker.reconfigure(new)
            self.room.reconfigure(new)
            self.dry_run = self.dry_run_flag or new.dry_run
            self.metrics = TextfileWriter(new.metrics_textfile)
            self._force_full = True
            tell(
                self.log,
                Event.of(
                    EventKind.CONFIG_RELOADED,
                    "info",
                    file=str(self.config_path),
                    msg=f"config reloaded from {self.config_path}",
                ),
            )
        self.notifier.notify("READY=1")

    def close(self) -> None:
        self.room.close()
        if self.psi is not None:
            self.psi.close()
        self.sensor.close()
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)


def run(config_path: Path, *, dry_run: bool, log: FilteringBoundLogger) -> int:
    config_error: ConfigError | None = None
    try:
        config = config_mod.load(config_path)
    except ConfigError as e:
        # A broken config must not leave the machine unprotected: run on defaults, loudly.
        config, config_error = Config(), e
        tell(
            log,
            Event.of(
                EventKind.CONFIG_INVALID,
                "error",
                file=str(config_path),
                error=str(e),
                msg=f"invalid config, protecting with built-in defaults: {e}",
            ),
        )
    try:
        how = mlockall()
        tell(log, Event.of(EventKind.MEMLOCK, "debug", flags=how))
    except OSError as e:
        tell(
            log,
            Event.of(
                EventKind.MEMLOCK_FAILED,
                "warning",
                error=str(e),
                msg=f"mlockall failed, pages may be evicted: {e}",
            ),
        )
    guard = Guard(config, config_path, log, dry_run=dry_run, config_error=config_error)
    return guard.run()
