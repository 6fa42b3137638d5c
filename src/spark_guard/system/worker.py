"""Threads the guard starts, one way: spawn() starts a daemon thread or says it could not.

Under a pids limit (TasksMax=, a container's pids.max) or with the machine out of
memory, `Thread.start()` raises (EAGAIN: "can't start new thread"). A caller that
kept the thread before starting it was left holding one that never ran: a container
block whose done() then raised at every pass, an NVML worker that was never asked
again (fault F9). Here nothing is kept until it runs: spawn() returns None, the caller
leaves its state as if nothing was asked, and a later pass tries again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def spawn(target: Callable[..., Any], name: str, *args: Any) -> threading.Thread | None:
    """A daemon thread running target(*args), started; None where none can be started."""
    thread = threading.Thread(target=target, args=args, name=name[:15], daemon=True)
    try:
        thread.start()
    except RuntimeError:
        return None
    return thread
