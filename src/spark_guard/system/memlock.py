"""Keep the guard's pages in RAM: when memory runs out it must not wait on a page-in."""

from __future__ import annotations

import ctypes
import os

MCL_CURRENT = 1
MCL_FUTURE = 2
MCL_ONFAULT = 4  # lock pages as they are touched, not whole thread stacks up front


def mlockall() -> str:
    """Lock current and future pages; returns the flags used or raises OSError."""
    # By soname: ctypes.util.find_library would run ldconfig in a subprocess.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for flags, name in (
        (MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT, "current|future|onfault"),
        (MCL_CURRENT | MCL_FUTURE, "current|future"),
    ):
        if libc.mlockall(flags) == 0:
            return name
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: kernel older than 4.4 knows no ONFAULT; try without
            raise OSError(err, os.strerror(err))
    raise OSError(22, os.strerror(22))
