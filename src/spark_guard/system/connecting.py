"""Managers connected and verified: off the loop on a thread of its own (the daemon's),
or all at once, PID 1 first (a command's: connect_all)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from ..core.snapshot import SYSTEM
from .managers import Manager, ManagerError, ManagerUntrusted
from .worker import spawn


class Connecting:
    """A manager being connected and verified on a thread of its own.

    A peer that accepts and never answers (a frozen manager, PID 1 deep in a
    daemon-reload, a user's fake) costs that thread the bus timeout, never the
    guard's loop. A user manager is vouched for by PID 1 over a connection of
    this thread's own (`system_socket`): sd-bus connections are not shared
    between threads. `on_done` is called from the thread when it has an answer.
    """

    def __init__(
        self,
        key: str,
        socket_path: str,
        proc_root: str,
        system_socket: str | None,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.key = key
        self.manager = Manager(key, socket_path, proc_root)
        self.error: ManagerError | None = None
        self._system_socket = system_socket
        self._on_done = on_done
        self._done = threading.Event()
        if spawn(self._run, f"connect {key}") is None:
            self._run(ManagerError(f"{key}: cannot start a thread to connect (a pids limit?)"))

    def _run(self, cannot: ManagerError | None = None) -> None:
        system = None
        try:
            if cannot is not None:
                raise cannot
            if self._system_socket is not None:
                system = Manager(SYSTEM, self._system_socket, self.manager.proc_root)
                system.connect()  # PID 1 there but silent: no verdict yet, asked again later
            self.manager.connect(system)
        except ManagerError as e:
            self.error = e
            if system is not None and system.silent_until > self.manager.silent_until:
                self.manager.silent_until = system.silent_until
        except Exception as e:  # a thread must not die silently: the loop reads it as an error
            self.error = ManagerError(f"{self.key}: {e}")
        finally:
            if system is not None:
                system.close()
            self._done.set()
            self._on_done()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(max(timeout, 0.0))


def connect_all(
    found: Mapping[str, str], proc_root: str = "/proc"
) -> tuple[dict[str, Manager], list[str]]:
    """Every manager `found` (discover()), connected and verified as the daemon's are: PID
    1 first, which vouches for each user's (issue 40, H7: a fake of hers in her
    init.scope passes every other check). Where PID 1 is there but does not answer, no
    user's manager is believed. Returns those connected, and why each other was not."""
    managers: dict[str, Manager] = {}
    errors: list[str] = []
    for key in sorted(found, key=lambda k: k != SYSTEM):
        m = Manager(key, found[key], proc_root)
        try:
            if key != SYSTEM and SYSTEM in found and SYSTEM not in managers:
                raise ManagerUntrusted(f"{key}: PID 1 did not answer, so it cannot vouch for it")
            m.connect(managers.get(SYSTEM))
            managers[key] = m
        except ManagerError as e:
            m.close()
            errors.append(str(e))
    return managers, errors
