"""A path resolved beneath an anchor, as openat2's RESOLVE_BENEATH does, in plain calls.

For what a container mounts: a Hugging Face cache's snapshot files reach
`../../blobs/` through relative symlinks, which are followed while they stay
beneath the mount's source; anything else is refused (safefs.UnsafePath).
"""

from __future__ import annotations

import errno
import os

from .safefs import _DIR_FLAGS, _MAX_LINKS, UnsafePath, _is_link, _parts, open_dir

BENEATH_DEPTH = 64  # directories held open at once below the anchor
BENEATH_STEPS = 4096  # components resolved in all, symlinks' included


def open_beneath(anchor: str, path: str) -> tuple[int, str]:
    """(an fd of the directory holding `path`'s last component, that component's name),
    with `path` resolved beneath directory `anchor` as openat2's RESOLVE_BENEATH does,
    done here one component at a time: the anchor is opened with open_dir (no symlink
    above it followed); below it a symlink is followed while its target stays beneath
    the anchor (a relative target, a '..' never above it; an absolute target is refused:
    inside a container it names the container's root, not the host's), at most
    _MAX_LINKS of them. The way a Hugging Face cache's snapshot files reach
    `../../blobs/`. UnsafePath (ELOOP; its strerror the reason alone, without the path)
    for a way out; other OSErrors as they came."""
    try:
        stack = [open_dir(anchor)]
    except UnsafePath as e:
        raise UnsafePath(errno.ELOOP, f"{e.filename!r} is a symlink, not followed", path) from None
    todo = list(reversed(_parts(path)))
    links = steps = 0

    def out(why: str) -> UnsafePath:
        return UnsafePath(errno.ELOOP, why, path)

    try:
        while todo:
            steps += 1
            if steps > BENEATH_STEPS or len(stack) > BENEATH_DEPTH:
                # A fd is held a level: 2,000 levels took the daemon's every fd (EMFILE).
                raise out(f"deeper than {BENEATH_DEPTH} levels or {BENEATH_STEPS} steps")
            part = todo.pop()
            if part == "..":
                if len(stack) == 1:
                    raise out("'..' above the mount")
                os.close(stack.pop())
                continue
            if _is_link(part, stack[-1]):
                links += 1
                if links > _MAX_LINKS:
                    raise out("too many symlinks")
                target = os.readlink(part, dir_fd=stack[-1])
                if target.startswith("/"):
                    raise out(f"{part!r} is a symlink to an absolute path, not followed")
                todo.extend(reversed(_parts(target)))
                continue
            if not todo:
                return os.dup(stack[-1]), part
            stack.append(os.open(part, _DIR_FLAGS, dir_fd=stack[-1]))
        raise out("names a directory")
    finally:
        for fd in stack:
            os.close(fd)
