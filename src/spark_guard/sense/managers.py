"""The systemd managers the guard watches: found, connected off the loop, believed.

PID 1's and each user's (at boot a linger user's starts beside the guard). A socket is
found by discover(); the connection is made and its peer verified off the loop
(system/connecting.py); an answer (believed, refused, silent) is taken in at the next
full look. A manager not believed is said once per reason and asked again now and then;
one that timed out is left alone until its silence is over.

A call to a manager that froze since the last pass waits the bus timeout (5 s), with
the GIL held (pystemd): three frozen at once were 15 s of one pass, blind to every
loader meanwhile. So a pass lets one call time out: after it, the user managers not
yet asked are left for the next pass, which asks them after those that answered (a
manager that answered is asked every pass, however many froze). PID 1 is always
asked, first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.config import Config
from ..core.events import Event, EventKind, tell
from ..core.snapshot import SYSTEM
from ..system.connecting import Connecting
from ..system.managers import Manager, ManagerError, ManagerSilent, ManagerUntrusted, discover

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import

UNTRUSTED_RETRY = 10.0  # seconds before a manager that failed verification is tried again


class ManagerWatch:
    """The managers connected now (`managers`, one dict for the guard's life: the blocker
    acts through the same), those connecting, and the pass's one timeout."""

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
        self.heartbeat = heartbeat  # given to every Manager: after each call that came back
        self.on_answer = on_answer
        self.managers: dict[str, Manager] = {}
        self.connecting: dict[str, Connecting] = {}
        self._untrusted: dict[str, tuple[float, str]] = {}  # key -> (retry at, why)
        # key -> monotonic time: a call to that manager timed out; not reconnected before.
        self._silent: dict[str, float] = {}
        self._found: dict[str, str] = {}  # the last discover(): key -> socket
        # One call may time out per pass (in_turn): whether one did, and the managers left
        # out of this pass and the last one for it.
        self._timed_out = False
        self._answered: set[str] = set()  # asked in this pass (and answered, or dropped)
        self._left_out: set[str] = set()
        self._left_out_now: set[str] = set()

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

    def new_pass(self) -> None:
        """A full look begins: those left out of the last pass are asked early in this one."""
        self._left_out, self._left_out_now, self._timed_out = self._left_out_now, set(), False
        self._answered = set()

    def in_turn(self) -> list[tuple[str, Manager]]:
        """The managers to ask now: PID 1, those that answered, those left out last pass."""
        return sorted(
            self.managers.items(),
            key=lambda item: (item[0] != SYSTEM, item[0] in self._left_out),
        )

    def spent(self, key: str) -> bool:
        """A call timed out in this pass: `key`, a user manager not asked yet in it, waits
        for the next; one that answered a moment ago is asked on."""
        if self._timed_out and key != SYSTEM and key not in self._answered:
            self._left_out_now.add(key)
            return True
        self._answered.add(key)  # (a call that fails now drops it from the managers)
        return False

    def waits(self, key: str) -> bool:
        """Whether `key` was left out of this pass (another manager's call timed out)."""
        return key in self._left_out_now

    def failed(self, key: str, e: ManagerError) -> None:
        """A call to `key` failed: dropped (a timeout spends the pass's one)."""
        self._timed_out = self._timed_out or isinstance(e, ManagerSilent)
        self.drop(key, str(e))

    def close(self) -> None:
        for key in list(self.managers):
            self.managers.pop(key).close()
        for pending in self.connecting.values():
            if pending.done:
                pending.manager.close()  # one still connecting dies with its daemon thread
        self.connecting.clear()
