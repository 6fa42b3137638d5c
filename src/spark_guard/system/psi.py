"""The kernel's memory pressure (PSI) trigger: a file descriptor poll() wakes on."""

from __future__ import annotations

import os

# 2 s: the shortest window an unprivileged process may ask for (no CAP_SYS_RESOURCE).
PSI_WINDOW_US = 2_000_000


class PsiTrigger:
    """A kernel PSI trigger on memory: poll() wakes when stalls pass a threshold."""

    def __init__(self, proc_root: str, stall: float) -> None:
        self.fd: int | None = None
        if stall <= 0:
            return
        path = os.path.join(proc_root, "pressure", "memory")
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        try:
            os.write(fd, f"some {int(stall * 1e6)} {PSI_WINDOW_US}\0".encode())
        except OSError:
            os.close(fd)
            raise
        self.fd = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
