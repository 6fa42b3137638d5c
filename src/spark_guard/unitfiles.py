"""The files the guard itself touches: mask links it lays (and release removes),
enablement links it reads before a disable (and release puts back).

The disable itself is the unit's manager's (DisableUnitFiles): the guard
never writes into /etc/systemd or a home directory. Everything here is a
plain syscall in this process (no systemctl, no fork). A directory is
reached by walking its resolved path from / with O_NOFOLLOW and checking
each step's owner, so a user who owns part of a path (their home, their
runtime dir) cannot turn a root process's symlink or unlink elsewhere. A
mask is removed only while it still points to /dev/null, and a link is put
back only where nothing else stands: a file someone else put there is never
touched.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

NULL = "/dev/null"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnitFileError(RuntimeError):
    """A link could not be laid, removed or restored; str() names the path and why."""


@dataclass(frozen=True)
class Link:
    """A symlink as it was: enough to put it back byte for byte."""

    path: str
    target: str
    uid: int
    gid: int


@contextlib.contextmanager
def _directory(path: str, owner: int, create: tuple[int, int] | None = None) -> Iterator[int]:
    """An fd for directory `path`, owned at every step by root or `owner`.

    `create` = (uid, gid): make the last component if it is missing, owned so.
    """
    real = os.path.realpath(path)
    parts = [p for p in real.split("/") if p]
    fd = os.open("/", _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create is None or i != len(parts) - 1:
                    raise UnitFileError(f"{path}: no such directory") from None
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.fchmod(nfd, 0o755)  # as systemd makes it, whatever our umask
                if create != (0, 0):
                    os.fchown(nfd, *create)
            except OSError as e:
                raise UnitFileError(f"{path}: {e.strerror} at {part!r}") from None
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            if st.st_uid not in (0, owner):
                raise UnitFileError(
                    f"{path}: {'/'.join(parts[: i + 1])} belongs to uid {st.st_uid}, "
                    f"not root or {owner}: refusing to change anything there"
                )
        yield fd
    finally:
        os.close(fd)


def _readlink(name: str, fd: int) -> str | None:
    """Target of symlink `name` in `fd`; None if absent; error if not a symlink."""
    try:
        st = os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return None
    if not stat.S_ISLNK(st.st_mode):
        raise UnitFileError(f"{name}: not a symlink")
    return os.readlink(name, dir_fd=fd)


def read_link(path: str, owner: int) -> Link | None:
    """The symlink at `path` as it is now, or None if nothing is there."""
    parent, name = os.path.split(path)
    with _directory(parent, owner) as fd:
        try:
            target = _readlink(name, fd)
        except UnitFileError as e:
            raise UnitFileError(f"{path}: {e}") from None
        if target is None:
            return None
        st = os.lstat(name, dir_fd=fd)
        return Link(path, target, st.st_uid, st.st_gid)


def lay_mask(directory: str, name: str, uid: int, gid: int) -> bool:
    """Symlink `directory/name` to /dev/null; True if we made it, False if one was there."""
    with _directory(directory, uid, create=(uid, gid)) as fd:
        try:
            os.symlink(NULL, name, dir_fd=fd)
        except FileExistsError:
            try:
                target = _readlink(name, fd)
            except UnitFileError:
                target = "a regular file"
            if target == NULL:
                return False
            raise UnitFileError(
                f"{os.path.join(directory, name)}: in the way of the mask ({target})"
            ) from None
        except OSError as e:
            raise UnitFileError(f"{os.path.join(directory, name)}: {e.strerror}") from None
        if uid:
            os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
        return True


def remove_mask(path: str, owner: int) -> bool:
    """Remove our mask link; False (untouched) unless it still points to /dev/null."""
    parent, name = os.path.split(path)
    try:
        with _directory(parent, owner) as fd:
            if _readlink(name, fd) != NULL:
                return False
            os.unlink(name, dir_fd=fd)
            return True
    except UnitFileError:
        return False


def restore_conflict(link: Link, owner: int) -> str | None:
    """Why `link` cannot be put back (something else is at its path), or None."""
    parent, name = os.path.split(link.path)
    try:
        with _directory(parent, owner) as fd:
            target = _readlink(name, fd)
    except UnitFileError as e:
        if "no such directory" in str(e):
            return None
        return str(e)
    if target is None or target == link.target:
        return None
    return f"{link.path} now points to {target}, not {link.target}"


def restore_link(link: Link, owner: int) -> bool:
    """Put an enablement link back as it was; False if it is already there."""
    parent, name = os.path.split(link.path)
    grandparent, leaf = os.path.split(parent)
    if not os.path.isdir(parent):
        # A *.wants directory someone emptied and removed: make it again, as its owner had it.
        with _directory(grandparent, owner) as gfd, contextlib.suppress(FileExistsError):
            os.mkdir(leaf, 0o755, dir_fd=gfd)
            if link.uid:
                os.chown(leaf, link.uid, link.gid, dir_fd=gfd)
    with _directory(parent, owner) as fd:
        target = _readlink(name, fd)
        if target == link.target:
            return False
        if target is not None:
            raise UnitFileError(f"{link.path} now points to {target}, not {link.target}")
        os.symlink(link.target, name, dir_fd=fd)
        os.chown(name, link.uid, link.gid, dir_fd=fd, follow_symlinks=False)
        os.fsync(fd)
        return True


def shadowing_file(dirs: tuple[str, ...], before: str, name: str) -> str | None:
    """A file named `name` in a directory that outranks `before` (a mask cannot beat it)."""
    for d in dirs:
        if d == before:
            return None
        if os.path.lexists(os.path.join(d, name)):
            return os.path.join(d, name)
    return None
