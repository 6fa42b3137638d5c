"""The systemd managers the guard watches: found, connected off the loop, believed.

PID 1's and each user's (at boot a linger user's starts beside the guard). A socket is
found by discover(); the connection is made and its peer verified off the loop
(system/connecting.py); an answer (believed, refused, silent) is taken in at the next
full look. A manager not believed is said once per reason and asked again now and then;
one that timed out is left alone until its silence is over.

A pass asks PID 1 first, on the loop, then the users' managers in parallel, each in its
turn (sense/asking.py): three frozen at once cost a pass one turn, not three timeouts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from ..core.config import Config
from ..core.events import Event, EventKind, tell
from ..core.snapshot import SYSTEM
from ..system.connecting import Connecting
from ..system.managers import Manager, ManagerError, ManagerUntrusted, discover
from .asking import USER_TURN

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

UNTRUSTED_RETRY = 10.0  # seconds before a manager that failed verification is tried again


class ManagerWatch:
    """The managers connected now (`managers`, one dict for the guard's life: the blocker
    acts through the same), those connecting, and those late in the last pass."""

    def __init__(
        self,
        config: Config,
        log: FilteringBoundLogger,
        clock: Callable[[], float],
        heartbeat: Callable[[], None] | None,
        on_answer: Callable[[], None],
    ) -> None:
        # Paths keep their start-up values across a reload.
        self.system_manager, self.user_runtime = config.system_manager, config.user_runtime
        self.proc = config.proc
        self.log, self.clock = log, clock
        # Given to every Manager: after each call that came back, on the loop's own thread
        # (made here): a user's manager answering a worker (asking.py) says nothing of it.
        loop = threading.get_ident()
        self.heartbeat = heartbeat and (
            lambda: heartbeat() if threading.get_ident() == loop else None
        )
        self.on_answer = on_answer
        self.managers: dict[str, Manager] = {}
        self.connecting: dict[str, Connecting] = {}
        self._untrusted: dict[str, tuple[float, str]] = {}  # key -> (retry at, why)
        # key -> monotonic time: a call to that manager timed out; not reconnected before.
        self._silent: dict[str, float] = {}
        self._found: dict[str, str] = {}  # the last discover(): key -> socket
        self.late: set[str] = set()  # not back within their turn in the last pass

    def refresh(self, wait: float) -> None:
        """Forget managers gone; start connecting those that appeared (boot, linger, login).
        `wait`: how long to wait for the connections here (a command, the first pass); 0
        for the daemon's loop, which takes them in at its next full look (adopt)."""
        found = discover(self.system_manager, self.user_runtime)
        self._found = found
        for key in [k for k in self.managers if k not in found]:
            self.drop(key, "socket gone")
        now = self.clock()
        for key, sock in found.items():
            if key in self.managers or key in self.connecting:
                continue
            if now < self._untrusted.get(key, (0.0, ""))[0]:
                continue
            if time.monotonic() < self._silent.get(key, 0.0):
                continue  # it timed out a moment ago: asked again once its silence is over
            system = found.get(SYSTEM) if key != SYSTEM else None
            self.connecting[key] = Connecting(key, sock, self.proc, system, self.on_answer)
        if wait > 0:
            deadline = time.monotonic() + wait
            for pending in list(self.connecting.values()):
                pending.wait(deadline - time.monotonic())

    def adopt(self) -> None:
        """Take in the connections that have an answer: believed, refused or silent."""
        now = self.clock()
        for key, pending in list(self.connecting.items()):
            if not pending.done:
                continue
            del self.connecting[key]
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

    def _note_silence(self, m: Manager) -> None:
        if m.silent_until > time.monotonic():
            self._silent[m.key] = m.silent_until

    def drop(self, key: str, why: str) -> None:
        """Forget a manager that failed a call or whose socket is gone (said)."""
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

    def failed(self, key: str, e: ManagerError) -> None:
        """A call to `key` failed: dropped (a timeout makes it silent for SILENT_FOR)."""
        self.drop(key, str(e))

    def pending(self, keys: set[str]) -> None:
        """The user managers not back within their turn in this pass (sense/asking.py):
        said once, when one first misses its turn, and again only after it answered."""
        for key in sorted(keys - self.late):
            tell(
                self.log,
                Event.of(
                    EventKind.MANAGER_LATE,
                    "info",
                    manager=key,
                    msg=f"{key} manager: no answer within its turn ({USER_TURN:g}s): its"
                    " units are judged by what the kernel shows until it answers",
                ),
            )
        self.late = {k for k in keys if k in self.managers}

    def close(self) -> None:
        for key in list(self.managers):
            self.managers.pop(key).close()
        for pending in self.connecting.values():
            if pending.done:
                pending.manager.close()  # one still connecting dies with its daemon thread
        self.connecting.clear()


class Answering(Mapping[str, Manager]):
    """The managers as the blocker sees them: those late in the last pass left out. No
    block waits on a manager that did not answer its turn: its units are paused or
    killed from the kernel's side, as when it is out of view, until it answers."""

    def __init__(self, watch: ManagerWatch) -> None:
        self._watch = watch

    def __getitem__(self, key: str) -> Manager:
        if key in self._watch.late:
            raise KeyError(key)
        return self._watch.managers[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k in list(self._watch.managers) if k not in self._watch.late)

    def __len__(self) -> int:
        return sum(1 for _ in self)
