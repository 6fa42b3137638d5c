"""What goes wrong talking to a systemd manager: each error says which manager and why."""

from __future__ import annotations


class ManagerError(RuntimeError):
    """A manager could not be reached or refused a call; str() says which and why."""


class ManagerUntrusted(ManagerError):
    """What listens on a user's socket is not that user's systemd (a fake, or a redirect)."""


class ManagerSilent(ManagerError):
    """A call timed out: the manager is busy (a daemon-reload under memory pressure) or
    frozen. It is not asked again until SILENT_FOR has passed."""


class FreezeLate(ManagerError):
    """FreezeUnit sent, not answered within FREEZE_TIMEOUT: the kernel has not frozen the
    cgroup yet (a process in an uninterruptible wait). It may still land; not silent."""


class ManagerNotRunning(ManagerError):
    """No private socket for that manager: it is not running (a user not logged in)."""
