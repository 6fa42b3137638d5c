"""Readers for /proc, rooted anywhere so tests can feed a fixture tree.

A process may exit between listing and reading: every per-PID reader returns
None for a vanished PID rather than raising. Nothing here forks.

Not psutil: each reader says why in one line; the figures are in docs/benchmarks.md
("psutil or hand-written readers", benchmarks/psutil_cost.py).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from itertools import islice

from ..core.snapshot import (
    ARGV_MAX_ARGS,
    ARGV_MAX_BYTES,
    MAPS_MAX_BYTES,
    MAPS_MAX_MODELS,
    MODEL_SUFFIXES,
    PATH_MAX,
    Memory,
    Pressure,
)

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ProcError(RuntimeError):
    """A file that must exist (meminfo) is missing or malformed."""


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    cgroup: str
    rss: int


class KeptFile:
    """A /proc file opened once and read with pread from offset 0: the kernel makes its
    text anew on each read at 0, and the quiet pass saves an open and a close. Reopened
    after an error (the fd is never shared with a caller). Thread-safe: pread keeps no
    offset."""

    def __init__(self, path: str, limit: int) -> None:
        self.path, self.limit = path, limit
        self._fd: int | None = None
        # The loop, the blocker and the make-room thread share one: an fd closed after an
        # error must not be read by another thread once its number is reused.
        self._lock = threading.Lock()

    def read(self) -> bytes:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.pread(self._fd, self.limit, 0)
            except OSError:
                self._close()
                raise

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self._close()


# meminfo is about 1.5 KiB (60 lines); buddyinfo a line per zone and node.
_MEMINFO_LIMIT = 16 * 1024
_BUDDYINFO_LIMIT = 64 * 1024
_MEMORY_FIELDS = frozenset(
    (
        b"MemTotal",
        b"MemFree",
        b"MemAvailable",
        b"Active(file)",
        b"Inactive(file)",
        b"Dirty",
        b"Writeback",
        b"Shmem",
        b"Mapped",
        b"SwapTotal",
    )
)
# The order of a 2 MiB block in pages: 9 with 4 KiB pages, 5 with 64 KiB ones.
HUGE_BLOCK = 2 * 1024**2
HUGE_ORDER = max(HUGE_BLOCK // PAGE_SIZE, 1).bit_length() - 1


def parse_buddyinfo(raw: bytes, page_size: int = PAGE_SIZE) -> int:
    """Bytes in free blocks of HUGE_BLOCK and larger, over every zone of every node.

    A line is `Node 0, zone   Normal  c0 c1 ... c10`: the count of free blocks of each
    order (2^order pages)."""
    order_min = max(HUGE_BLOCK // page_size, 1).bit_length() - 1
    total = 0
    for line in raw.splitlines():
        _, _, rest = line.partition(b"zone")
        counts = rest.split()[1:]  # the zone's name first
        for order, count in enumerate(counts):
            if order >= order_min and count.isdigit():
                total += int(count) * (page_size << order)
    return total


class ProcFS:
    def __init__(self, root: str = "/proc") -> None:
        self.root = root.rstrip("/") or "/"
        self._meminfo = KeptFile(self._path("meminfo"), _MEMINFO_LIMIT)
        self._buddyinfo = KeptFile(self._path("buddyinfo"), _BUDDYINFO_LIMIT)

    def close(self) -> None:
        self._meminfo.close()
        self._buddyinfo.close()

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    # psutil.virtual_memory() parses every field and opens the file anew: 1.4x this on each
    # quiet pass (psutil_cost.py); here two kept-open files are read with pread
    def memory(self) -> Memory:
        """What the quiet pass reads: MemAvailable, and beside it what a GPU allocation on
        unified memory can get (MemFree, the clean page cache, free 2 MiB blocks)."""
        fields: dict[bytes, int] = {}
        path = self._path("meminfo")
        try:
            raw = self._meminfo.read()
            for line in raw.splitlines():
                name, _, rest = line.partition(b":")
                if name in _MEMORY_FIELDS:
                    fields[name] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError) as e:
            raise ProcError(f"{path}: cannot read MemTotal/MemAvailable: {e}") from None
        if b"MemTotal" not in fields or b"MemAvailable" not in fields:
            raise ProcError(f"{path}: MemTotal or MemAvailable missing")
        get = fields.get
        # Active(file) + Inactive(file) is the page cache on the LRU (Shmem is not in it: it
        # lives on the anon lists); what is dirty or under writeback cannot be dropped now.
        file_pages = get(b"Active(file)", 0) + get(b"Inactive(file)", 0)
        return Memory(
            fields[b"MemTotal"],
            fields[b"MemAvailable"],
            free=get(b"MemFree"),
            file_clean=max(file_pages - get(b"Dirty", 0) - get(b"Writeback", 0), 0),
            dirty=get(b"Dirty", 0) + get(b"Writeback", 0),
            shmem=get(b"Shmem", 0),
            mapped=get(b"Mapped", 0),
            swap_total=get(b"SwapTotal", 0),
            huge_free=self.huge_free(),
        )

    # psutil has no buddyinfo reader
    def huge_free(self) -> int | None:
        """Bytes free in blocks of 2 MiB or larger, summed over every zone of
        /proc/buddyinfo: what a driver that allocates 2 MiB pages can take without a
        compaction. None where the kernel has no buddyinfo."""
        try:
            raw = self._buddyinfo.read()
        except OSError:
            return None
        return parse_buddyinfo(raw)

    # psutil has no vmstat reader
    def pinned(self) -> int | None:
        """Bytes pinned long-term (FOLL_PIN: drivers, RDMA, io_uring), which no reclaim or
        compaction can move; None where /proc/vmstat has no such counters."""
        acquired = released = None
        try:
            with open(self._path("vmstat"), "rb") as f:
                for line in f:
                    if line.startswith(b"nr_foll_pin_acquired "):
                        acquired = int(line.split()[1])
                    elif line.startswith(b"nr_foll_pin_released "):
                        released = int(line.split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if acquired is None or released is None:
            return None
        return max(acquired - released, 0) * PAGE_SIZE

    # psutil has no raw reader: virtual_memory() gives derived figures, not every field
    def meminfo(self) -> dict[str, int]:
        """Every /proc/meminfo field in bytes (the counts, like HugePages_Total, as they are)."""
        out: dict[str, int] = {}
        path = self._path("meminfo")
        try:
            with open(path, "rb") as f:
                for line in f:
                    name, _, rest = line.partition(b":")
                    parts = rest.split()
                    if parts:
                        scale = 1024 if parts[1:] == [b"kB"] else 1
                        out[name.decode()] = int(parts[0]) * scale
        except (OSError, ValueError) as e:
            raise ProcError(f"{path}: cannot read: {e}") from None
        return out

    # pids() and rss() below, which say why they are not psutil's
    def rss_total(self) -> int:
        """RSS summed over every process (shared pages count once per process)."""
        return sum(r for pid in self.pids() if (r := self.rss(pid)) is not None)

    # psutil.getloadavg() is os.getloadavg(): the real /proc, never the configured root
    def loadavg(self) -> str:
        try:
            with open(self._path("loadavg")) as f:
                return " ".join(f.read().split()[:3])
        except OSError:
            return "?"

    # psutil has no PSI reader
    def pressure(self) -> Pressure | None:
        """Memory PSI, or None where the kernel has none (CONFIG_PSI off, psi=0)."""
        try:
            with open(self._path("pressure", "memory"), "rb") as f:
                lines = f.read().decode().splitlines()
        except OSError:
            return None
        avg: dict[str, float] = {}
        for line in lines:
            kind, *pairs = line.split()
            for pair in pairs:
                key, _, value = pair.partition("=")
                if key == "avg10":
                    avg[kind] = float(value)
        if "some" not in avg:
            return None
        return Pressure(avg["some"], avg.get("full", 0.0))

    # psutil.pids() is this listdir; not worth +0.9 MB of RSS in the guard (psutil_cost.py)
    def pids(self) -> list[int]:
        return [int(n) for n in os.listdir(self.root) if n.isdigit()]

    # psutil has no cgroup path
    def cgroup_of_self(self) -> str | None:
        return self.cgroup("self")

    # psutil has no cgroup path
    def cgroup(self, pid: int | str) -> str | None:
        """The process's cgroup path as systemd tracks it.

        Pure cgroup v2 gives it on the '0::' line; hybrid machines leave that
        at '/' and keep the unit in the named 'name=systemd' hierarchy.
        """
        try:
            with open(self._path(str(pid), "cgroup"), "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        unified = named = None
        # "\n" only: a cgroup name may hold \r, \x1c or U+2028 (splitlines() splits on them).
        for line in text.split("\n"):
            fields = line.split(":", 2)
            if len(fields) != 3:
                continue  # malformed, or the tail of a name with a newline: not ours to read
            _, controllers, path = fields
            if controllers == "":
                unified = path
            elif controllers == "name=systemd":
                named = path
        if unified and unified != "/":
            return unified
        return named or unified

    def uid(self, pid: int) -> int | None:
        """The process's real uid, the kernel's word: status's Uid: line (not the owner of
        /proc/PID, which is root's for a process that made itself non-dumpable)."""
        try:
            with open(self._path(str(pid), "status"), "rb") as f:
                head = f.read(2048)
        except OSError:
            return None
        for line in head.split(b"\n"):
            if line.startswith(b"Uid:"):
                fields = line.split()
                return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
        return None

    def start_ticks(self, pid: int) -> int | None:
        """When the process started, in clock ticks since boot (stat's 22nd field)."""
        try:
            with open(self._path(str(pid), "stat"), "rb") as f:
                raw = f.read(4096)
            return int(raw[raw.rindex(b")") + 2 :].split()[19])
        except (OSError, ValueError, IndexError):
            return None

    def state(self, pid: int) -> tuple[str, int] | None:
        """(its state letter, stat's third field: R, S, D, T for stopped, Z...; its parent's
        PID, the fourth); None if gone."""
        try:
            with open(self._path(str(pid), "stat"), "rb") as f:
                raw = f.read(4096)
            letter, parent = raw[raw.rindex(b")") + 2 :].split()[:2]
            return letter.decode(), int(parent)
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    # psutil reads this statm too, after Process(pid) reads stat: 1.8x the walk (psutil_cost.py)
    def rss(self, pid: int) -> int | None:
        try:
            with open(self._path(str(pid), "statm"), "rb") as f:
                return int(f.read().split()[1]) * PAGE_SIZE
        except (OSError, ValueError, IndexError):
            return None

    # the full look's walk: psutil's RSS plus this cgroup() is 1.07-1.8x it (psutil_cost.py)
    def process(self, pid: int) -> ProcessInfo | None:
        cgroup = self.cgroup(pid)
        rss = self.rss(pid)
        if cgroup is None or rss is None:
            return None
        return ProcessInfo(pid, cgroup, rss)

    # psutil's cmdline() reads and splits the whole argv: unbounded, see argv_cost.py
    def cmdline(self, pid: int) -> tuple[str, ...] | None:
        """The process's arguments, bounded: the first ARGV_MAX_ARGS non-empty ones within
        the first ARGV_MAX_BYTES bytes (snapshot.py says why those figures). The kernel
        allows megabytes; a process must not make each look read and split them. An
        argument cut by the byte limit is left out: a cut path would name a file nobody
        gave."""
        try:
            with open(self._path(str(pid), "cmdline"), "rb") as f:
                raw = f.read(ARGV_MAX_BYTES + 1)
        except OSError:
            return None
        if len(raw) > ARGV_MAX_BYTES:
            raw = raw[: raw.rfind(b"\0", 0, ARGV_MAX_BYTES) + 1]
        args = (a.decode(errors="replace") for a in raw.split(b"\0") if a)
        return tuple(islice(args, ARGV_MAX_ARGS))

    # psutil's memory_maps() reads smaps, every mapping's page counts; the paths are in maps
    def mapped_models(self, pid: int) -> tuple[str, ...] | None:
        """Model files (*.gguf, *.safetensors) the process has mapped: one path per file
        (dev, inode), at most MAPS_MAX_MODELS of them, from the first MAPS_MAX_BYTES of
        its maps. A process mapping 64,000 hard links of one file under long names was
        kept path by path, 430 MiB."""
        found: dict[str, None] = {}
        files: set[bytes] = set()
        suffixes = tuple(s.encode() for s in MODEL_SUFFIXES)
        read = 0
        try:
            with open(self._path(str(pid), "maps"), "rb") as f:
                for line in f:
                    read += len(line)
                    if read > MAPS_MAX_BYTES:
                        break
                    line = line.rstrip(b"\n")
                    if not line.lower().endswith(suffixes):
                        continue
                    fields = line.split(maxsplit=5)
                    if len(fields) < 6 or len(fields[5]) > PATH_MAX:
                        continue  # a longer path is no file anyone could name
                    file = fields[3] + b" " + fields[4]  # dev and inode
                    if file in files:
                        continue
                    files.add(file)
                    found[fields[5].decode(errors="replace")] = None
                    if len(found) >= MAPS_MAX_MODELS:
                        break
        except OSError:
            return None
        return tuple(found)
