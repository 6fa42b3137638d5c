"""The last resort when a manager does not answer: kill one unit's cgroup from the kernel side.

Only the unit's own cgroup is touched, so no process of another unit is ever
signalled. cgroup.kill (Linux 5.14) kills the whole subtree atomically; on
older kernels, or where the cgroup tree is read-only to the guard, every PID
listed in the subtree gets SIGKILL through a pidfd, which cannot hit a
recycled PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable


def v2_root(base: str) -> str:
    """The cgroup2 mount: `base` itself, or `base`/unified on a hybrid host."""
    if os.path.exists(os.path.join(base, "cgroup.controllers")):
        return base
    unified = os.path.join(base, "unified")
    if os.path.exists(os.path.join(unified, "cgroup.controllers")):
        return unified
    return base


def _dir(root: str, cgroup: str) -> str:
    return os.path.join(root, cgroup.lstrip("/"))


def populated(root: str, cgroup: str) -> bool | None:
    """Whether any process is left in the subtree; None if the cgroup is unknown."""
    try:
        with open(os.path.join(_dir(root, cgroup), "cgroup.events"), "rb") as f:
            for line in f:
                if line.startswith(b"populated "):
                    return line.split()[1] == b"1"
    except OSError:
        return None
    return None


def cpu_seconds(root: str, cgroup: str) -> float | None:
    """CPU time the cgroup's subtree has used (cpu.stat usage_usec); None if unknown."""
    try:
        with open(os.path.join(_dir(root, cgroup), "cpu.stat"), "rb") as f:
            for line in f:
                if line.startswith(b"usage_usec "):
                    return int(line.split()[1]) / 1e6
    except (OSError, ValueError):
        return None
    return None


def pids(root: str, cgroup: str) -> list[int]:
    """Every PID in the unit's cgroup subtree (read-only: works under ProtectControlGroups=)."""
    if not cgroup or cgroup == "/":
        return []
    found: list[int] = []
    for dirpath, _dirs, files in os.walk(_dir(root, cgroup)):
        if "cgroup.procs" in files:
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(dirpath, "cgroup.procs"), "rb") as f,
            ):
                found += [int(p) for p in f.read().split()]
    return found


def kill(root: str, cgroup: str, *, cgroup_of: Callable[[int], str | None]) -> str:
    """SIGKILL everything in the unit's cgroup; returns how it was done. `cgroup_of`: a
    process's cgroup as systemd tracks it (ProcFS.cgroup), for the fallback's check."""
    if not cgroup or cgroup == "/":
        raise OSError(f"refusing to kill cgroup {cgroup!r}")
    path = _dir(root, cgroup)
    try:
        with open(os.path.join(path, "cgroup.kill"), "wb", buffering=0) as f:
            f.write(b"1")
        return f"{path}/cgroup.kill"
    except OSError:
        # No cgroup.kill (before 5.14), or a read-only /sys/fs/cgroup
        # (ProtectControlGroups=): signal the listed processes instead.
        pass
    count = 0
    for dirpath, _dirs, files in os.walk(path):
        if "cgroup.procs" not in files:
            continue
        with open(os.path.join(dirpath, "cgroup.procs"), "rb") as f:
            pids = [int(p) for p in f.read().split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                # The pidfd first, then the check that it is one of ours: a PID read from
                # cgroup.procs may have been recycled since, but the pidfd pins the process
                # it names, and that process must still be in the cgroup to be signalled.
                fd = os.pidfd_open(pid)
                try:
                    where = cgroup_of(pid)
                    if where is not None and (where + "/").startswith(cgroup.rstrip("/") + "/"):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                        count += 1
                finally:
                    os.close(fd)
    if count == 0 and not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such cgroup")
    return f"SIGKILL to {count} process(es) listed in {path}"


KILL_ROUNDS = 4  # a process that forked meanwhile is found on the next listing


def kill_uid(
    root: str,
    cgroup: str,
    uid: int,
    *,
    uid_of: Callable[[int], int | None],
    cgroup_of: Callable[[int], str | None],
    spare: Callable[[list[int]], set[int]] | None = None,
) -> int:
    """SIGKILL the processes of real uid `uid` in the cgroup's subtree, and no other: a
    user's job inside a system unit, her scope, a cgroup of her own. Through a pidfd, each
    checked after it is pinned (her uid, still in the subtree), listed again until a
    listing finds none (a fork meanwhile). `spare`: of the listed pids, those to leave
    (her manager in its init.scope). Returns how many were signalled."""
    if not cgroup or cgroup == "/" or uid == 0:
        raise OSError(f"refusing to kill uid {uid}'s processes in cgroup {cgroup!r}")
    inside = cgroup.rstrip("/") + "/"
    done: set[int] = set()  # signalled already (a dying process may still be listed)
    for _ in range(KILL_ROUNDS):
        listed = pids(root, cgroup)
        left = set(listed) - (spare(listed) if spare else set()) - done
        signalled = 0
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                fd = os.pidfd_open(pid)
                try:
                    where = cgroup_of(pid)
                    if where is None or not (where + "/").startswith(inside):
                        continue
                    if uid_of(pid) != uid:
                        continue
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    signalled += 1
                    done.add(pid)
                finally:
                    os.close(fd)
        if not signalled:
            break
    return len(done)
