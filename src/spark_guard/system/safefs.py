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
import re
import stat
import threading
import time
from collections.abc import Collection, Iterator

from . import mounts

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# write()'s temporary names, and how old one must be before it is a dead writer's.
_TEMPORARY = re.compile(r"\.(.+)\.[0-9a-f]{12}\.tmp")
LEFTOVER_AGE = 60.0
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


_REGULAR_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def open_regular(
    name: str, *, dir_fd: int | None = None, nofollow: bool = False, shown: str | None = None
) -> tuple[int, os.stat_result]:
    """An fd for a regular file and its stat: the one opener for files a user can place
    (models, configs, a server's state). A FIFO, device, socket or directory is refused,
    before the open where a stat says so (opening a device can act) and after it by fstat
    (it may have been swapped since): UnsafePath, EINVAL. O_NONBLOCK: the open of a FIFO
    swapped in returns at once instead of waiting for a writer. `nofollow`: a symlink is
    refused (ELOOP) instead of followed. Other OSErrors (ENOENT, EACCES) as they came."""
    shown = shown or name
    before = os.stat(name, dir_fd=dir_fd, follow_symlinks=not nofollow)
    if nofollow and stat.S_ISLNK(before.st_mode):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), shown)  # as O_NOFOLLOW says it
    if not stat.S_ISREG(before.st_mode):
        raise UnsafePath(errno.EINVAL, f"{shown}: not a regular file")
    fd = os.open(name, _REGULAR_FLAGS | (os.O_NOFOLLOW if nofollow else 0), dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(errno.EINVAL, f"{shown}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one read: device, inode, size and mtime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_regular(
    fd_or_path: str, limit: int, *, dir_fd: int | None = None, nofollow: bool = False
) -> bytes:
    """At most `limit` bytes of a regular file (open_regular); anything else is refused.
    `nofollow`: a symlink is refused too (ELOOP) instead of read through."""
    fd, _ = open_regular(fd_or_path, dir_fd=dir_fd, nofollow=nofollow)
    try:
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


def open_dir(path: str) -> int:
    """An fd of directory `path`, walked from / one component at a time with O_NOFOLLOW:
    no symlink is followed anywhere on the way (UnsafePath, ELOOP, naming the component
    that is one). The one opener for a directory no one's anchor vouches for (a container's
    bind mount); other OSErrors (ENOENT, EACCES) as they came."""
    fd = os.open("/", _DIR_FLAGS)
    try:
        for part in _parts(path):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                    raise UnsafePath(
                        errno.ELOOP, f"{path}: {part!r} is a symlink, not followed", part
                    ) from None
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _is_link(name: str, fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _dir(part: str, fd: int, no_fuse: bool) -> int:
    return mounts.open_dir(part, fd) if no_fuse else os.open(part, _DIR_FLAGS, dir_fd=fd)


def _open_dir(part: str, fd: int, *, make: bool, no_fuse: bool = False) -> int:
    """Open directory `part` in `fd` (never through a symlink; `no_fuse`: never into FUSE);
    `make`: create it if missing."""
    try:
        return _dir(part, fd, no_fuse)
    except FileNotFoundError:
        if not make:
            raise
    made = True
    try:
        os.mkdir(part, 0o755, dir_fd=fd)
    except FileExistsError:
        made = False  # someone was quicker: it is checked like any other
    nfd = _dir(part, fd, no_fuse)
    if made:
        try:
            os.fchmod(nfd, 0o755)  # as systemd makes it, whatever our umask
        except OSError:
            os.close(nfd)
            raise
    return nfd


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def _split(path: str) -> list[str]:
    if not os.path.isabs(path):
        raise UnsafePath(errno.EINVAL, f"{path}: not an absolute path")
    parts = _parts(path)
    if ".." in parts:
        raise UnsafePath(errno.EINVAL, f"{path}: '..' is not followed")
    return parts


def _root_link(part: str, fd: int) -> str | None:
    """The target of `part` if it is a symlink root owns (root put it there), else None."""
    try:
        with mounts.pinned(part, fd) as link:
            st = os.fstat(link)
            is_roots = stat.S_ISLNK(st.st_mode) and st.st_uid == 0
            return os.readlink("", dir_fd=link) if is_roots else None
    except OSError:
        return None


def _resolve(done: list[str], target: str, todo: list[str]) -> list[str]:
    """What is left to walk from / once root's symlink in /done is replaced by `target`.

    /done holds no symlink (each was resolved as it came), so '..' in the target
    can be resolved as text.
    """
    where = os.path.normpath(os.path.join("/" + "/".join(done), target))
    return _parts(where) + todo


def _open_trusted(path: str) -> int:
    """An fd for `path`, every component owned by root; root's own symlinks are followed
    (/lib -> usr/lib, a /home on another disk), anyone else's are refused."""
    todo = _split(path)
    done: list[str] = []
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
                todo = _resolve(done, os.readlink(part, dir_fd=fd), todo)
                done = []
                old, fd = fd, -1
                os.close(old)
                fd = os.open("/", _DIR_FLAGS)
                continue
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            done.append(part)
            if os.fstat(fd).st_uid != 0:
                raise UnsafePath(errno.EPERM, f"{path}: {part!r} is not owned by root")
        return fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def anchor_stat(path: str) -> os.stat_result:
    """fstat of directory `path` (itself not followed), reached through root's directories:
    the owner and group of an anchor, such as a user's runtime dir, without a passwd lookup."""
    parent, leaf = os.path.split(os.path.normpath(path))
    try:
        pfd = _open_trusted(parent)
    except UnsafePath:
        raise
    except OSError as e:
        raise UnsafePath(e.errno, f"{path}: {e.strerror}") from None
    try:
        fd = _dir(leaf, pfd, no_fuse=True) if leaf else os.dup(pfd)  # (a user's runtime dir)
    except OSError as e:
        raise UnsafePath(e.errno, f"{path}: {e.strerror}") from None
    finally:
        os.close(pfd)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


# `create` for Tree.directory/write: every missing component may be made, as makedirs would.
MAKEDIRS = 1 << 16


class Tree:
    """Everything below `anchor`, belonging to `uid`:`gid` (root: uid 0).

    The anchor itself is reached through root-owned directories only; below
    it no symlink is followed and each directory must belong to `uid` or root.
    For a user, every call runs with that user's file rights.

    Anchored at /, a symlink root owns is followed (root made it: /var/run,
    a /home on another disk); anyone else's is refused there too.

    `any_owner`: directories below the anchor may belong to anyone (a symlink is
    still refused). Only for a root tree that makes new files (`write`): a
    directory's owner can then swap in only a directory of their own, where an
    O_EXCL temporary file and a rename harm nothing (node_exporter's textfile
    directory sits in /var/lib/prometheus, which belongs to prometheus).
    `no_fuse`: never into a FUSE mount (a user's runtime tree, walked on the loop:
    mounts.py).
    """

    def __init__(
        self,
        anchor: str,
        uid: int = 0,
        gid: int = 0,
        no_fuse: bool = False,
        *,
        any_owner: bool = False,
    ) -> None:
        self.anchor, self.uid, self.gid = os.path.normpath(anchor), uid, gid
        self.any_owner, self.no_fuse = any_owner, no_fuse

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
        try:
            pfd = _open_trusted(parent if leaf else "/")
        except UnsafePath:
            raise
        except OSError as e:
            raise UnsafePath(e.errno, f"{self.anchor}: {e.strerror}") from None
        if not leaf:
            return pfd
        try:
            fd = _dir(leaf, pfd, self.no_fuse)
        except OSError as e:
            raise UnsafePath(e.errno, f"{self.anchor}: {e.strerror}") from None
        finally:
            os.close(pfd)
        if not self.any_owner and os.fstat(fd).st_uid not in (0, self.uid):
            os.close(fd)
            raise UnsafePath(errno.EPERM, f"{self.anchor}: not owned by root or uid {self.uid}")
        return fd

    @contextlib.contextmanager
    def directory(self, path: str, *, create: int = 0) -> Iterator[int]:
        """A pinned fd for directory `path`, with the owner's rights held while it is used.

        `create`: how many trailing components may be made if missing (mode 0755,
        owned by the tree's owner because they are made with the owner's rights;
        MAKEDIRS: any).
        """
        todo = self._below(path)
        with as_user(self.uid, self.gid):
            fd = self._open_anchor()
            try:
                done: list[str] = []  # walked below the anchor, no symlink among them
                links = 0
                while todo:
                    part = todo.pop(0)
                    try:
                        nfd = _open_dir(part, fd, make=len(todo) < create, no_fuse=self.no_fuse)
                    except FileNotFoundError:
                        raise UnsafePath(errno.ENOENT, f"{path}: no such directory") from None
                    except OSError as e:
                        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                            raise UnsafePath(e.errno, f"{path}: {e.strerror} at {part!r}") from None
                        target = _root_link(part, fd) if self.anchor == "/" else None
                        if target is None or links >= _MAX_LINKS:
                            raise UnsafePath(
                                e.errno, f"{path}: {part!r} is not a directory (a symlink?)"
                            ) from None
                        links += 1
                        todo = _resolve(done, target, todo)
                        done = []
                        old, fd = fd, -1
                        os.close(old)
                        fd = self._open_anchor()
                        continue
                    os.close(fd)
                    fd = nfd
                    done.append(part)
                    owner = os.fstat(fd).st_uid
                    if not self.any_owner and owner not in (0, self.uid):
                        raise UnsafePath(
                            errno.EPERM,
                            f"{path}: {part!r} belongs to uid {owner}, not root or {self.uid}",
                        )
                yield fd
            finally:
                if fd >= 0:
                    os.close(fd)

    def lstat(self, path: str) -> os.stat_result | None:
        """lstat of whatever is at `path` (not followed); None if nothing is there."""
        parent, name = os.path.split(path)
        try:
            with self.directory(parent) as fd, mounts.pinned(name, fd) as it:
                return os.fstat(it)
        except FileNotFoundError:
            return None
        except UnsafePath as e:
            if e.errno == errno.ENOENT:
                return None
            raise

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
                if not _exists(name, fd):
                    return None
                try:
                    return read_regular(name, limit, dir_fd=fd, nofollow=True)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise UnsafePath(
                            e.errno, f"{path}: a symlink, not a regular file"
                        ) from None
                    raise
        except UnsafePath as e:
            if e.errno == errno.ENOENT:
                return None
            raise

    def write(
        self, path: str, data: bytes, *, mode: int = 0o644, create: int = 0, durable: bool = True
    ) -> None:
        """Replace `path` atomically: a temporary (O_EXCL), fsync (if `durable`), rename."""
        parent, name = os.path.split(path)
        with self.directory(parent, create=create) as fd:
            tmp = f".{name}.{os.urandom(6).hex()}.tmp"  # _TEMPORARY
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            tfd = os.open(tmp, flags, mode, dir_fd=fd)
            try:
                try:
                    os.fchmod(tfd, mode)  # whatever the umask
                    view = memoryview(data)
                    while view:
                        view = view[os.write(tfd, view) :]
                    if durable:
                        os.fsync(tfd)
                finally:
                    os.close(tfd)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
            if durable:
                os.fsync(fd)

    def remove_leftovers(
        self, directory: str, names: Collection[str] | None = None, age: float = LEFTOVER_AGE
    ) -> list[str]:
        """Remove the temporary files of write()s that died in `directory` (a kill between
        the write and the rename, or a rename that failed and whose file could not be
        removed either): those of `names` only if given, and only once `age` seconds old,
        when no live writer can still be at them. Returns what it removed; what cannot be
        removed now is left for a later call."""
        removed: list[str] = []
        with contextlib.suppress(OSError), self.directory(directory) as fd:
            for entry in os.listdir(fd):
                found = _TEMPORARY.fullmatch(entry)
                if found is None or (names is not None and found[1] not in names):
                    continue
                with contextlib.suppress(OSError):
                    st = os.lstat(entry, dir_fd=fd)
                    # A time from the future (the clock stepped back) counts as old.
                    if stat.S_ISREG(st.st_mode) and not 0 <= time.time() - st.st_mtime < age:
                        os.unlink(entry, dir_fd=fd)
                        removed.append(os.path.join(directory, entry))
        return removed

    def unlink(self, path: str, *, durable: bool = True) -> bool:
        """Remove file or symlink `path`; False if it was not there."""
        parent, name = os.path.split(path)
        try:
            with self.directory(parent) as fd:
                os.unlink(name, dir_fd=fd)
                if durable:
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
        except OSError as e:  # (FileNotFoundError among them)
            if isinstance(e, UnsafePath) and e.errno != errno.ENOENT:
                raise
            return False


def own_tree(*, any_owner: bool = False) -> Tree:
    """The guard's own files (records, the login note, state.json): from /, through
    directories of root (or of the user running it, outside production), with its rights."""
    uid = os.geteuid()
    return Tree("/", uid, os.getegid() if uid else 0, any_owner=any_owner)


def _exists(name: str, fd: int) -> bool:
    try:
        with mounts.pinned(name, fd):
            return True
    except FileNotFoundError:
        return False


def _readlink(name: str, fd: int, path: str) -> tuple[str, os.stat_result] | None:
    try:
        with mounts.pinned(name, fd) as link:  # (lstat and readlink never ask FUSE)
            st = os.fstat(link)
            if not stat.S_ISLNK(st.st_mode):
                raise UnsafePath(errno.EEXIST, f"{path}: not a symlink")
            return os.readlink("", dir_fd=link), st
    except FileNotFoundError:
        return None
