"""Make room for the GPU: drop clean page cache and compact memory, off the loop.

Three kernel files, each written, never a process forked:
- `memory.reclaim` of the cgroup2 root (Linux 5.19+): reclaims about the bytes asked.
  With `swappiness=0` (newer kernels) it takes file pages only; where the kernel
  refuses that argument it is used bare only when there is no swap, since it could
  otherwise push a loader's anonymous memory to swap.
- `/proc/sys/vm/drop_caches` = 1: every clean, unmapped page-cache page; never anon.
  The fallback where memory.reclaim is missing (cgroup v1, older kernels) or could swap.
- `/proc/sys/vm/compact_memory` = 1: free blocks of 2 MiB and larger again.

A reclaim can take seconds on 100 GiB of cache, so one worker thread does the
writes (the GIL is released in the write) and the loop only submits and collects:
the brake and the block never wait on it. A method that failed for a reason that
will not change (missing file, refused argument, read-only mount) is not tried again.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.room import RoomPlan
from ..core.snapshot import Memory
from .procfs import ProcError, ProcFS
from .worker import spawn

RECLAIM = "memory.reclaim"
RECLAIM_FILE_ONLY = "memory.reclaim swappiness=0"
DROP_CACHES = "drop_caches"
_FINAL = (errno.ENOENT, errno.EINVAL, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)


@dataclass(frozen=True)
class RoomMade:
    """One plan carried out: how, with the figures before and after."""

    plan: RoomPlan
    before: Memory
    after: Memory | None
    method: str  # the reclaim that worked ("" when none was asked or none worked)
    compacted: bool
    seconds: float
    errors: tuple[str, ...] = ()

    @property
    def done(self) -> str:
        """What was done, in words: "reclaimed page cache (how) and compacted", or ""."""
        return " and ".join(
            ([f"reclaimed page cache ({self.method})"] if self.method else [])
            + (["compacted"] if self.compacted else [])
        )

    @property
    def dropped(self) -> int:
        """Clean page cache gone between before and after (what the reclaim did)."""
        if self.after is None:
            return 0
        return self.before.file_clean - self.after.file_clean

    @property
    def freed(self) -> int:
        """MemFree gained (negative: a loader took more meanwhile)."""
        if self.after is None or self.after.free is None or self.before.free is None:
            return 0
        return self.after.free - self.before.free


@dataclass
class RoomMaker:
    """One thread that carries out RoomPlans; `submit` never waits, `take` collects."""

    proc: ProcFS
    cgroup_root: str  # the cgroup2 mount (cgroupfs.v2_root)
    sysctl: str = "/proc/sys/vm"
    on_done: Callable[[], None] = lambda: None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _wake: threading.Condition = field(init=False)
    _pending: tuple[RoomPlan, Memory] | None = None
    _done: list[RoomMade] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _busy: bool = False
    _closed: bool = False
    # Methods that failed for good, each with the error said for it.
    broken: dict[str, str] = field(default_factory=dict)
    # A memory.reclaim write has worked here: mapped page cache counts as droppable.
    reclaims_mapped: bool = False

    def __post_init__(self) -> None:
        self._wake = threading.Condition(self._lock)

    @property
    def busy(self) -> bool:
        return self._busy

    def reclaim_possible(self, swap_total: int) -> bool:
        """Whether a way of dropping page cache is left that did not fail for good."""
        ways = [RECLAIM_FILE_ONLY, DROP_CACHES] + ([RECLAIM] if swap_total == 0 else [])
        return any(way not in self.broken for way in ways)

    def submit(self, plan: RoomPlan, before: Memory) -> bool:
        """Hand a plan to the worker; False (and nothing done) while one is in hand, or
        where no thread can be started (a pids limit): the next pass tries again."""
        with self._lock:
            if self._busy or self._closed:
                return False
            if self._thread is None or not self._thread.is_alive():
                thread = spawn(self._run, "spark-guard make-room")
                if thread is None:
                    return False
                self._thread = thread
            self._busy = True
            self._pending = (plan, before)
            self._wake.notify()
        return True

    def take(self) -> list[RoomMade]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._pending is None:
                    return
                (plan, before), self._pending = self._pending, None
            try:
                made = self.carry_out(plan, before)
            except Exception as e:  # the thread outlives any surprise; the loop is told
                made = RoomMade(plan, before, None, "", False, 0.0, (f"make-room: {e!r}",))
            with self._lock:
                self._done.append(made)
                self._busy = False
            self.on_done()

    # --- the writes (the worker thread; `spark-guard preflight --make-room` calls it too)

    def carry_out(self, plan: RoomPlan, before: Memory) -> RoomMade:
        began = time.monotonic()
        errors: list[str] = []
        method = ""
        if plan.reclaim > 0:
            method = self._reclaim(plan.reclaim, before, errors)
        compacted = plan.compact and self._write(
            "compact_memory", os.path.join(self.sysctl, "compact_memory"), b"1", errors
        )
        try:
            after: Memory | None = self.proc.memory()
        except (OSError, ProcError):  # the loop's next read says what is wrong
            after = None
        return RoomMade(
            plan, before, after, method, compacted, time.monotonic() - began, tuple(errors)
        )

    def _reclaim(self, amount: int, before: Memory, errors: list[str]) -> str:
        reclaim = os.path.join(self.cgroup_root, "memory.reclaim")
        tries = [(RECLAIM_FILE_ONLY, reclaim, f"{amount} swappiness=0".encode())]
        if before.swap_total == 0:
            # No swap: the bare write can take nothing but file pages.
            tries.append((RECLAIM, reclaim, str(amount).encode()))
        tries.append((DROP_CACHES, os.path.join(self.sysctl, "drop_caches"), b"1"))
        for name, path, data in tries:
            if self._write(name, path, data, errors):
                if name.startswith(RECLAIM):
                    self.reclaims_mapped = True  # it evicts mapped cache too (drop_caches not)
                return name
        return ""

    def _write(self, name: str, path: str, data: bytes, errors: list[str]) -> bool:
        if name in self.broken:
            return False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            self._failed(name, path, e, errors)
            return False
        try:
            os.write(fd, data)
        except OSError as e:
            if e.errno == errno.EAGAIN and name.startswith(RECLAIM):
                return True  # reclaimed less than asked: what it could, the after figure says
            self._failed(name, path, e, errors)
            return False
        finally:
            os.close(fd)
        return True

    def _failed(self, name: str, path: str, e: OSError, errors: list[str]) -> None:
        why = f"{path}: {e.strerror or e}"
        errors.append(why)
        if e.errno in _FINAL:
            self.broken[name] = why
            if name == RECLAIM_FILE_ONLY and e.errno == errno.ENOENT:
                self.broken[RECLAIM] = why  # the same file: its bare write is not tried
