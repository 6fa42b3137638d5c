"""Never into a FUSE filesystem on the loop's walks of users' runtime trees (F12).

A user may mount FUSE over her own directories (fusermount is setuid); with
`user_allow_other` in /etc/fuse.conf root can enter it, and then every lookup,
stat or open there is a request to her daemon, which need never answer: the
caller waits in the kernel for good (killable only), the loop with it, until
the watchdog, and again at every start. So a directory on the guard's walks of
her runtime tree (her manager's socket, the masks it lays) is first opened with
O_PATH, which asks no filesystem anything; its mount is read from the kernel
(/proc/self/fdinfo, /proc/self/mountinfo); on FUSE it is refused, else opened
again through the pinned fd (".", which crosses no mount). Plain reads of /proc.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import threading
from collections.abc import Iterator

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MOUNTINFO_MAX = 16 << 20  # 100,000 mounts (fs.mount-max) of ~160 bytes


class _FuseMounts:
    """The ids of the FUSE mounts, read again only when the kernel says the table
    changed (POLLPRI on /proc/self/mountinfo, as systemd watches it)."""

    def __init__(self, proc: str = "/proc") -> None:
        self.path = os.path.join(proc, "self", "mountinfo")
        self._lock = threading.Lock()
        self._fd = -1
        self._ids: frozenset[int] = frozenset()

    def ids(self) -> frozenset[int]:
        with self._lock:
            try:
                if self._fd < 0:
                    self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                    self._ids = self._read()
                else:
                    poller = select.poll()
                    poller.register(self._fd, select.POLLPRI | select.POLLERR)
                    if poller.poll(0):
                        self._ids = self._read()
            except OSError:
                # The change it signalled is spent: read afresh next time, not kept stale.
                if self._fd >= 0:
                    os.close(self._fd)
                self._fd = -1
                raise
            return self._ids

    def _read(self) -> frozenset[int]:
        os.lseek(self._fd, 0, os.SEEK_SET)
        chunks, size = [], 0
        while size < MOUNTINFO_MAX and (chunk := os.read(self._fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
        ids = set()
        for line in b"".join(chunks).splitlines():
            # ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
            fields = line.split(b" - ", 1)
            kind = fields[1].split(b" ", 1)[0] if len(fields) == 2 else b""
            if kind == b"fuse" or kind.startswith((b"fuse.", b"fuseblk")):
                ids.add(int(line.split(b" ", 1)[0]))
        return frozenset(ids)


FUSE = _FuseMounts()


def mount_id(fd: int) -> int | None:
    """The mount an fd is on, from the kernel's /proc/self/fdinfo (None: not said)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f.read(4096).splitlines():
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def on_fuse(fd: int) -> bool:
    return mount_id(fd) in FUSE.ids()


def open_dir(name: str, dir_fd: int) -> int:
    """Directory `name` in `dir_fd`, as os.open(name, O_DIRECTORY|O_NOFOLLOW) would give
    it, never entering FUSE: EXDEV there (a symlink: ENOTDIR, as O_NOFOLLOW gives)."""
    fd = os.open(name, _PATH_FLAGS | os.O_DIRECTORY, dir_fd=dir_fd)
    try:
        if on_fuse(fd):
            raise OSError(errno.EXDEV, f"a FUSE mount at {name!r}: not entered")
        return os.open(".", _DIR_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def pinned(name: str, dir_fd: int) -> Iterator[int]:
    """An O_PATH fd of whatever is at `name` (not followed, a mount on it crossed), for
    fstat or readlinkat through it; OSError EXDEV where that is FUSE (an lstat of it, or
    a readlink, would be a request to her daemon)."""
    fd = os.open(name, _PATH_FLAGS, dir_fd=dir_fd)
    try:
        if on_fuse(fd):
            raise OSError(errno.EXDEV, f"a FUSE mount at {name!r}: not entered")
        yield fd
    finally:
        os.close(fd)


def present(root: str, parts: tuple[str, ...]) -> bool:
    """Whether something is at root/parts... (`root`: root's), walked with O_PATH and never
    into FUSE (a FUSE mount on the way: False). A symlink on the way counts as there: what
    reaches through it judges it (a manager's connection refuses it, and says so)."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return False
    try:
        for i, part in enumerate(parts):
            nfd = os.open(part, _PATH_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if on_fuse(fd):
                return False
            if i < len(parts) - 1 and stat.S_ISLNK(os.fstat(fd).st_mode):
                return True
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
