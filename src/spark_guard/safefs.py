"""Files in trees that someone else can write, touched only as they could touch them.

The guard runs as root, but the unit files, links, runtime directories and
model files it deals with often belong to a user, who can swap any
directory of theirs for a symlink at any moment. Every path into such a tree
goes through here:

- `Tree` walks a path from a root-owned anchor (`/`, `/run/user/UID`, the
  user's home from passwd) one component at a time with O_NOFOLLOW
  directory fds, checks each component's owner, and works relative to the
  pinned fd: `symlinkat`, `unlinkat`, `renameat`, and files created with
  O_EXCL under a random name. `realpath()` is never called on anything a
  user can change.
- `as_user` gives the calling thread the owner's file rights (setfsuid and
  setfsgid are per thread on Linux), so the kernel refuses whatever that user
  could not do themselves, and what is created belongs to them.
- `read_regular` reads a bounded prefix of a regular file: O_NONBLOCK then
  fstat, so a FIFO or a device is refused instead of blocking or streaming.

Plain syscalls only: no fork, no exec.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
import threading
from collections.abc import Iterator

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # root-owned symlinks followed above an anchor, as the kernel's own limit


class UnsafePath(OSError):
    """A path that leaves its tree, crosses a symlink or someone else's directory."""


_libc: ctypes.CDLL | None = None
_groups_dropped = False
_groups_lock = threading.Lock()


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)  # by soname: no ldconfig subprocess
    return _libc


def _drop_supplementary_groups() -> None:
    """Root's supplementary groups (group 0) would still apply at another fsuid: drop them.

    They give a root process nothing its uid does not, so this is done once, for
    the whole process, before the first switch.
    """
    global _groups_dropped
    with _groups_lock:
        if not _groups_dropped:
            if os.getgroups():
                os.setgroups([])
            _groups_dropped = True


@contextlib.contextmanager
def as_user(uid: int, gid: int) -> Iterator[None]:
    """The calling thread's file accesses run with uid/gid's rights until the block ends."""
    if os.geteuid() != 0 or (uid == 0 and gid == 0):
        yield  # already that user, or root acting as root
        return
    _drop_supplementary_groups()
    libc = _c()
    old_gid = libc.setfsgid(gid)
    old_uid = libc.setfsuid(uid)
    try:
        # setfsuid reports the previous value, never an error: read the new one back.
        if libc.setfsuid(-1) != uid or libc.setfsgid(-1) != gid:
            raise PermissionError(errno.EPERM, f"cannot take the file rights of uid {uid}")
        yield
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)


def read_regular(fd_or_path: str, limit: int, *, dir_fd: int | None = None) -> bytes:
    """At most `limit` bytes of a regular file; anything else (FIFO, device, dir) is refused.

    O_NONBLOCK makes the open of a FIFO return at once; fstat then says what it is.
    """
    fd = os.open(
        fd_or_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dir_fd
    )
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(errno.EINVAL, f"{fd_or_path}: not a regular file")
        chunks = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _split(path: str) -> list[str]:
    if not os.path.isabs(path):
        raise UnsafePath(errno.EINVAL, f"{path}: not an absolute path")
    parts = [p for p in path.split("/") if p and p != "."]
    if ".." in parts:
        raise UnsafePath(errno.EINVAL, f"{path}: '..' is not followed")
    return parts


def _open_trusted(path: str) -> int:
    """An fd for `path`, every component owned by root; root's own symlinks are followed
    (/lib -> usr/lib, a /home on another disk), anyone else's are refused."""
    todo = _split(path)
    fd = os.open("/", _DIR_FLAGS)
    links = 0
    try:
        while todo:
            part = todo.pop(0)
            st = os.lstat(part, dir_fd=fd)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid != 0 or links >= _MAX_LINKS:
                    raise UnsafePath(
                        errno.ELOOP, f"{path}: {part!r} is a symlink not owned by root"
                    )
                links += 1
                target = os.readlink(part, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _DIR_FLAGS)
                todo = [p for p in target.split("/") if p and p != "."] + todo
                if ".." in todo:
                    raise UnsafePath(errno.EINVAL, f"{path}: a symlink with '..' on the way")
                continue
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if os.fstat(fd).st_uid != 0:
                raise UnsafePath(errno.EPERM, f"{path}: {part!r} is not owned by root")
        return fd
    except BaseException:
        os.close(fd)
        raise


class Tree:
    """Everything below `anchor`, belonging to `uid`:`gid` (root: uid 0).

    The anchor itself is reached through root-owned directories only; below
    it no symlink is followed and each directory must belong to `uid` or root.
    For a user, every call runs with that user's file rights.
    """

    def __init__(self, anchor: str, uid: int = 0, gid: int = 0) -> None:
        self.anchor = os.path.normpath(anchor)
        self.uid = uid
        self.gid = gid

    def __repr__(self) -> str:
        return f"Tree({self.anchor}, uid={self.uid})"

    def contains(self, path: str) -> bool:
        path = os.path.normpath(path)
        return path == self.anchor or path.startswith(self.anchor.rstrip("/") + "/")

    def _below(self, path: str) -> list[str]:
        if not self.contains(path):
            raise UnsafePath(errno.EPERM, f"{path}: outside {self.anchor}")
        rest = os.path.normpath(path)[len(self.anchor.rstrip("/")) :]
        return _split("/" + rest.lstrip("/"))

    def _open_anchor(self) -> int:
        parent, leaf = os.path.split(self.anchor)
        if not leaf:
            return _open_trusted("/")
        pfd = _open_trusted(parent)
        try:
            fd = os.open(leaf, _DIR_FLAGS, dir_fd=pfd)
        except OSError as e:
            raise UnsafePath(e.errno, f"{self.anchor}: {e.strerror}") from None
        finally:
            os.close(pfd)
        if os.fstat(fd).st_uid not in (0, self.uid):
            os.close(fd)
            raise UnsafePath(errno.EPERM, f"{self.anchor}: not owned by root or uid {self.uid}")
        return fd

    @contextlib.contextmanager
    def directory(self, path: str, *, create: int = 0) -> Iterator[int]:
        """A pinned fd for directory `path`, with the owner's rights held while it is used.

        `create`: how many trailing components may be made if missing (mode 0755,
        owned by the tree's owner because they are made with the owner's rights).
        """
        parts = self._below(path)
        with as_user(self.uid, self.gid):
            fd = self._open_anchor()
            try:
                for i, part in enumerate(parts):
                    try:
                        nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    except FileNotFoundError:
                        if i < len(parts) - create:
                            raise UnsafePath(errno.ENOENT, f"{path}: no such directory") from None
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(part, 0o755, dir_fd=fd)
                        nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                        if self.uid == 0:
                            os.fchmod(nfd, 0o755)  # as systemd makes it, whatever our umask
                    except OSError as e:
                        if e.errno in (errno.ELOOP, errno.ENOTDIR):
                            raise UnsafePath(
                                e.errno, f"{path}: {part!r} is not a directory (a symlink?)"
                            ) from None
                        raise UnsafePath(e.errno, f"{path}: {e.strerror} at {part!r}") from None
                    os.close(fd)
                    fd = nfd
                    owner = os.fstat(fd).st_uid
                    if owner not in (0, self.uid):
                        raise UnsafePath(
                            errno.EPERM,
                            f"{path}: {part!r} belongs to uid {owner}, not root or {self.uid}",
                        )
                yield fd
            finally:
                os.close(fd)

    # --- links -------------------------------------------------------------

    def readlink(self, path: str) -> tuple[str, os.stat_result] | None:
        """(target, lstat) of the symlink at `path`; None if nothing is there."""
        parent, name = os.path.split(path)
        try:
            with self.directory(parent) as fd:
                return _readlink(name, fd, path)
        except UnsafePath as e:
            if e.errno == errno.ENOENT:
                return None
            raise

    def symlink(self, path: str, target: str, *, create: int = 0) -> bool:
        """Make `path` -> `target`; False if that link is already there; UnsafePath if
        something else is."""
        parent, name = os.path.split(path)
        with self.directory(parent, create=create) as fd:
            try:
                os.symlink(target, name, dir_fd=fd)
            except FileExistsError:
                found = _readlink(name, fd, path)
                if found is not None and found[0] == target:
                    return False
                what = found[0] if found is not None else "not a symlink"
                raise UnsafePath(
                    errno.EEXIST, f"{path}: something else is there ({what})"
                ) from None
            os.fsync(fd)
            return True

    def unlink_link(self, path: str, target: str) -> bool:
        """Remove the symlink at `path` only while it still points to `target`."""
        parent, name = os.path.split(path)
        try:
            with self.directory(parent) as fd:
                found = _readlink(name, fd, path)
                if found is None or found[0] != target:
                    return False
                os.unlink(name, dir_fd=fd)
                os.fsync(fd)
                return True
        except UnsafePath as e:
            if e.errno == errno.ENOENT:
                return False
            raise

    # --- files -------------------------------------------------------------

    def read(self, path: str, limit: int) -> bytes | None:
        """A bounded read of regular file `path`; None if it is not there."""
        parent, name = os.path.split(path)
        try:
            with self.directory(parent) as fd:
                return read_regular(name, limit, dir_fd=fd) if _exists(name, fd) else None
        except UnsafePath as e:
            if e.errno == errno.ENOENT:
                return None
            raise

    def write(self, path: str, data: bytes, *, mode: int = 0o644, create: int = 0) -> None:
        """Replace `path` atomically: a new file under a random name (O_EXCL), fsync, rename."""
        parent, name = os.path.split(path)
        with self.directory(parent, create=create) as fd:
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            tfd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                mode,
                dir_fd=fd,
            )
            try:
                try:
                    os.fchmod(tfd, mode)  # whatever the umask
                    view = memoryview(data)
                    while view:
                        view = view[os.write(tfd, view) :]
                    os.fsync(tfd)
                finally:
                    os.close(tfd)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
            os.fsync(fd)

    def unlink(self, path: str) -> bool:
        """Remove file or symlink `path`; False if it was not there."""
        parent, name = os.path.split(path)
        try:
            with self.directory(parent) as fd:
                os.unlink(name, dir_fd=fd)
                os.fsync(fd)
                return True
        except FileNotFoundError:
            return False
        except UnsafePath as e:
            if e.errno == errno.ENOENT:
                return False
            raise

    def rmdir(self, path: str) -> bool:
        """Remove directory `path` if it is empty; False if it is not (or not there)."""
        parent, name = os.path.split(path)
        try:
            with self.directory(parent) as fd:
                os.rmdir(name, dir_fd=fd)
                return True
        except (FileNotFoundError, OSError) as e:
            if isinstance(e, UnsafePath) and e.errno != errno.ENOENT:
                raise
            return False


def _exists(name: str, fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return False
    return True


def _readlink(name: str, fd: int, path: str) -> tuple[str, os.stat_result] | None:
    try:
        st = os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return None
    if not stat.S_ISLNK(st.st_mode):
        raise UnsafePath(errno.EEXIST, f"{path}: not a symlink")
    return os.readlink(name, dir_fd=fd), st
