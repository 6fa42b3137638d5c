"""The files the guard itself touches: mask links it lays (and release removes),
enablement links it reads before a disable (and release puts back).

The disable itself is the unit's manager's (DisableUnitFiles): the daemon
never writes into /etc/systemd or a home directory. Everything here is a
plain syscall in this process (no systemctl, no fork), through safefs:

- where a mask goes comes from the guard's own anchors, never from what a
  manager reports: /run/systemd/system.control for PID 1,
  <user_runtime>/UID/systemd/user.control for a user's manager;
- a user's files are changed only inside that user's trees (their runtime
  dir for masks, their home from passwd for restored links), walked from the
  root-owned anchor with O_NOFOLLOW and that user's file rights, so whatever
  a user swaps for a symlink, the kernel refuses the guard what it would
  refuse the user; PID 1's files are changed only through root's directories;
- links are read with the owner's rights too, from /, through directories of
  root or the owner only.

A mask is removed only while it still points to /dev/null, and a link is put
back only where nothing else stands: a file someone else put there is never
touched.
"""

from __future__ import annotations

import errno
import os
import pwd
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.snapshot import SYSTEM, manager_uid
from .safefs import Tree, UnsafePath, anchor_stat

NULL = "/dev/null"
SYSTEM_CONTROL = "/run/systemd/system.control"


class UnitFileError(RuntimeError):
    """A link could not be laid, removed or restored; str() names the path and why."""


@dataclass(frozen=True)
class Link:
    """A symlink as it was: enough to put it back byte for byte."""

    path: str
    target: str
    uid: int
    gid: int


@dataclass(frozen=True)
class Owner:
    """Whose unit files these are, and the trees the guard may change for them.

    runtime: where masks (and runtime enablement links) go; home: where
    persistent links are restored (None: the daemon, which never writes there).
    For root both are / (every directory on the way root's).
    """

    uid: int
    gid: int
    runtime: Tree
    home: Tree | None = None

    @property
    def reads(self) -> Tree:
        """Reading: from /, through directories of root or the owner, with their rights,
        never into FUSE (hers would hold the loop: mounts.py)."""
        return Tree("/", self.uid, self.gid, no_fuse=True)

    def tree_for(self, path: str) -> Tree:
        """The tree `path` lies in; a one-line error naming it when it is in none."""
        trees = [t for t in (self.runtime, self.home) if t is not None]
        for tree in trees:
            if tree.contains(path):
                return tree
        where = " or ".join(t.anchor for t in trees)
        raise UnitFileError(f"{path}: outside {where}: not changed for uid {self.uid}")


def mask_dir(manager: str, user_runtime: str) -> str:
    """Where the guard masks a unit of `manager`: the runtime control directory, the one
    runtime directory that outranks /etc/systemd/system and ~/.config/systemd/user.

    Derived from the guard's own configuration, not from the manager's UnitPath:
    a user's manager could name any directory there.
    """
    if manager == SYSTEM:
        return SYSTEM_CONTROL
    runtime = os.path.join(os.path.normpath(user_runtime), str(manager_uid(manager)))
    return os.path.join(runtime, "systemd", "user.control")


def owner(manager: str, user_runtime: str, *, home: bool = False) -> Owner:
    """The owner of `manager`'s files and their trees.

    A user's group is their runtime dir's (no passwd lookup on the daemon's
    path); `home=True` (the release command) looks their home up in passwd.
    """
    uid = manager_uid(manager)
    if uid == 0:
        root = Tree("/")
        return Owner(0, 0, root, root if home else None)
    anchor = os.path.join(os.path.normpath(user_runtime), str(uid))
    entry = _passwd(uid) if home else None
    try:
        gid = anchor_stat(anchor).st_gid
    except OSError as e:
        if entry is None:
            raise UnitFileError(f"{_why(e)} (uid {uid}'s runtime dir)") from None
        gid = entry.pw_gid  # logged out: its masks went with its runtime dir
    runtime = Tree(anchor, uid, gid, no_fuse=True)  # (the loop walks it: never into FUSE)
    if entry is None:
        return Owner(uid, gid, runtime)
    return Owner(uid, gid, runtime, Tree(entry.pw_dir, uid, entry.pw_gid, no_fuse=True))


def _passwd(uid: int) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        raise UnitFileError(f"uid {uid}: no passwd entry, so no home to restore links in") from None


def _why(e: OSError) -> str:
    """An error as one line: safefs's own messages name the path already."""
    if isinstance(e, UnsafePath):
        return str(e.strerror)
    return f"{e.filename}: {e.strerror}" if e.filename else str(e.strerror or e)


def read_link(path: str, who: Owner) -> Link | None:
    """The symlink at `path` as it is now, or None if nothing is there."""
    try:
        found = who.reads.readlink(path)
    except OSError as e:
        raise UnitFileError(_why(e)) from None
    if found is None:
        return None
    target, st = found
    return Link(path, target, st.st_uid, st.st_gid)


def present(path: str, who: Owner) -> bool:
    """Whether anything is at `path` (a link is not followed), seen with the owner's rights."""
    try:
        return who.reads.lstat(path) is not None
    except OSError as e:
        raise UnitFileError(_why(e)) from None


def _runtime(path: str, who: Owner) -> Tree:
    if not who.runtime.contains(path):
        raise UnitFileError(f"{path}: outside {who.runtime.anchor}: not changed for uid {who.uid}")
    return who.runtime


def lay_mask(path: str, who: Owner) -> bool:
    """Symlink `path` to /dev/null; True if we made it, False if one was there.

    Its directory (the control dir) is made if missing, by the owner.
    """
    tree = _runtime(path, who)
    try:
        return tree.symlink(path, NULL, create=1)
    except OSError as e:
        if e.errno == errno.EEXIST:
            try:
                what = (tree.readlink(path) or ("gone",))[0]
            except OSError:
                what = "not a symlink"
            raise UnitFileError(f"{path}: in the way of the mask ({what})") from None
        raise UnitFileError(_why(e)) from None


def remove_mask(path: str, who: Owner) -> bool:
    """Remove our mask link; False (untouched) unless it still points to /dev/null.

    UnitFileError when the way there is no longer the owner's (a directory swapped
    for a symlink): whatever is there now is not the mask we laid.
    """
    tree = _runtime(path, who)
    try:
        return tree.unlink_link(path, NULL)
    except UnsafePath as e:
        if e.errno == errno.EEXIST:
            return False  # something that is not a symlink: not ours
        raise UnitFileError(_why(e)) from None
    except OSError as e:
        raise UnitFileError(_why(e)) from None


def restore_conflict(link: Link, who: Owner) -> str | None:
    """Why `link` cannot be put back (something else is at its path, or the way there
    is not the owner's), or None."""
    try:
        tree = who.tree_for(link.path)
        found = tree.readlink(link.path)
    except UnitFileError as e:
        return str(e)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        return _why(e)
    if found is None:
        # A removed *.wants dir is made again, but nothing above it.
        wants = os.path.dirname(link.path)
        above = os.path.dirname(wants)
        try:
            if tree.lstat(wants) is None and tree.lstat(above) is None:
                return f"{above}: no such directory, so {link.path} cannot be put back"
        except OSError as e:
            return _why(e)
        return None
    if found[0] == link.target:
        return None
    return f"{link.path} now points to {found[0]}, not {link.target}"


def restore_link(link: Link, who: Owner) -> bool:
    """Put an enablement link back as it was; False if it is already there.

    Made with the owner's rights, so it is theirs; a *.wants directory someone
    emptied and removed is made again the same way.
    """
    tree = who.tree_for(link.path)
    try:
        found = tree.readlink(link.path)
        if found is not None and found[0] == link.target:
            return False
        if found is not None:
            raise UnitFileError(f"{link.path} now points to {found[0]}, not {link.target}")
        return tree.symlink(link.path, link.target, create=1)
    except OSError as e:
        raise UnitFileError(_why(e)) from None


def shadowing_file(dirs: Sequence[str], before: str, name: str, who: Owner) -> str | None:
    """A file named `name` in a directory that outranks `before` (a mask cannot beat it).

    Looked at with the owner's rights; a directory that is not theirs or root's
    is passed over.
    """
    for d in dirs:
        if os.path.normpath(d) == os.path.normpath(before):
            return None
        path = os.path.join(d, name)
        try:
            if who.reads.lstat(path) is not None:
                return path
        except OSError:
            continue
    return None
