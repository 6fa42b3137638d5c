"""Units paused (SIGSTOP) while their manager is not connected: a linger user's manager
at boot, starting beside the guard. A kill is what Restart= answers with a new run, so
nothing of the unit exits meanwhile and nothing allocates; its stop goes through its
manager once it answers (and its processes get SIGCONT then: systemd signals only the
main process under KillMode=process). Paused too long, or running again (she sent
SIGCONT to her own processes), it is killed instead: pause() answers False.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

from .kernel import Kernel
from .records import Record

# A unit paused while its manager is not connected is looked at for SIGCONT no sooner than
# this after its SIGSTOP (a signal is taken when the process next runs).
PAUSE_SETTLE = 0.5


class Pauses:
    """The units paused now: since when, and which cgroup (a record released or dropped
    meanwhile still gets its SIGCONT)."""

    def __init__(self, kernel: Kernel, clock: Callable[[], float]) -> None:
        self.kernel, self.clock = kernel, clock
        self._paused: dict[str, tuple[float, str]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._paused

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._paused))

    def forget(self, key: str) -> None:
        self._paused.pop(key, None)

    def pause(self, record: Record, limit: float) -> bool:
        """SIGSTOP the unit's processes, or keep them paused: False (kill it instead) for a
        container, past `limit` seconds of waiting, or once anything paused runs again,
        looked at PAUSE_SETTLE after the SIGSTOP."""
        key, now = str(record.ref), self.clock()
        if key in self._paused:
            since = self._paused[key][0]
            if now - since >= limit or (
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

    def resume(self, key: str) -> None:
        """SIGCONT what was paused of `key`, and forget the pause."""
        _, cgroup = self._paused.pop(key)
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            self.kernel.send(cgroup, signal.SIGCONT)

    def hold(self, record: Record, limit: float) -> bool:
        """A unit whose manager is still not connected, paused (or left at its stop by an
        earlier guard, which may have paused it): False when it is to be killed (paused
        too long, or running again)."""
        key = str(record.ref)
        if key not in self._paused:
            if not self.kernel.populated(record.cgroup):
                return True  # nothing of it runs: nothing to hold
            self._paused[key] = (self.clock(), record.cgroup)
        return self.pause(record, limit)
