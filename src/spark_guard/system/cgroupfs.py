"""The last resort when a manager does not answer: kill one unit's cgroup from the kernel side.

Only the unit's own cgroup is touched, so no process of another unit is ever
signalled. cgroup.kill (Linux 5.14) kills the whole subtree atomically; on
older kernels, or where the cgroup tree is read-only to the guard, every PID
listed in the subtree gets SIGKILL through a pidfd, which cannot hit a
recycled PID.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable, Iterable

from .procfs import ProcFS


def v2_root(base: str) -> str:
    """Where the cgroups systemd names (ProcFS.cgroup) live: the cgroup2 mount, `base`
    itself or `base`/unified on a hybrid host; on a pure cgroup v1 host, the named
    `name=systemd` hierarchy, `base`/systemd (no cgroup.kill there: the kills signal
    each listed process). Before, kills on pure v1 looked in `base` and did nothing."""
    if os.path.exists(os.path.join(base, "cgroup.controllers")):
        return base
    unified = os.path.join(base, "unified")
    if os.path.exists(os.path.join(unified, "cgroup.controllers")):
        return unified
    named = os.path.join(base, "systemd")
    if os.path.exists(os.path.join(named, "cgroup.procs")):
        return named
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


# A user makes cgroups in her delegated subtree: one 1,000 levels deep made os.walk (a
# recursion on Python 3.11) raise RecursionError, and a wide one is work without end on
# the loop. The walk is a loop of its own, and stops at these.
WALK_CGROUPS = 4096
WALK_DEPTH = 64


def _walk(top: str) -> list[str]:
    """The cgroup directories of the subtree at `top`, itself first: breadth first, at
    most WALK_CGROUPS of them and WALK_DEPTH below it; none if it cannot be read."""
    out = [top]
    level = [top]
    for _ in range(WALK_DEPTH):
        below = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    below += [e.path for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            if len(out) + len(below) >= WALK_CGROUPS:
                return out + below[: WALK_CGROUPS - len(out)]
        if not below:
            break
        out += below
        level = below
    return out


def _procs(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "cgroup.procs"), "rb") as f:
            return [int(p) for p in f.read(1 << 20).split()]
    except (OSError, ValueError):
        return []


def pids(root: str, cgroup: str) -> list[int]:
    """Every PID in the unit's cgroup subtree (read-only: works under ProtectControlGroups=),
    within WALK_CGROUPS and WALK_DEPTH."""
    if not cgroup or cgroup == "/":
        return []
    found: list[int] = []
    for d in _walk(_dir(root, cgroup)):
        found += _procs(d)
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
    return send(root, cgroup, signal.SIGKILL, cgroup_of=cgroup_of)


def send(
    root: str, cgroup: str, sig: signal.Signals, *, cgroup_of: Callable[[int], str | None]
) -> str:
    """`sig` to every process listed in the unit's cgroup subtree; returns what was done."""
    if not cgroup or cgroup == "/":
        raise OSError(f"refusing to signal cgroup {cgroup!r}")
    path = _dir(root, cgroup)
    count = 0
    for dirpath in _walk(path):
        for pid in _procs(dirpath):
            with contextlib.suppress(ProcessLookupError):
                # The pidfd first, then the check that it is one of ours: a PID read from
                # cgroup.procs may have been recycled since, but the pidfd pins the process
                # it names, and that process must still be in the cgroup to be signalled.
                fd = os.pidfd_open(pid)
                try:
                    where = cgroup_of(pid)
                    if where is not None and (where + "/").startswith(cgroup.rstrip("/") + "/"):
                        signal.pidfd_send_signal(fd, sig)
                        count += 1
                finally:
                    os.close(fd)
    if count == 0 and not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such cgroup")
    return f"{sig.name} to {count} process(es) listed in {path}"


# How long kill_uid goes on listing by default: a fork storm's children are listed and
# killed until none of hers is left, or until then (each round is a listing and a pidfd
# per process). It runs on the guard's loop: what is left is killed again next pass.
KILL_DEADLINE = 0.25


def kill_uid(
    root: str,
    cgroup: str,
    uid: int,
    *,
    uid_of: Callable[[int], int | None],
    cgroup_of: Callable[[int], str | None],
    start_of: Callable[[int], int | None] | None = None,
    spare: Callable[[list[int]], set[int]] | None = None,
    any_user: bool = False,
    until: float | None = None,
    also: Iterable[int] = (),
    signalled: dict[int, tuple[int | None, float]] | None = None,
) -> int:
    """SIGKILL the processes of real uid `uid` in the cgroup's subtree, and no other: a
    user's job inside a system unit, her scope, a cgroup of her own. `any_user`: any uid
    but root's (her delegated subtree, where her user namespaces' subuids run too). Through
    a pidfd, each checked after it is pinned (the uid, still in the subtree), listed again
    until a listing shows none of hers not yet signalled (forks meanwhile), or until
    `until` (time.monotonic()), by default KILL_DEADLINE from now. `spare`: of the listed
    pids, those to leave (her manager in its init.scope). `also`: pids seen in the subtree
    beyond the walk's bounds, checked as the listed ones are. `signalled`: the caller's
    account of what earlier calls signalled (pid -> (start, by `start_of`; when, by
    time.monotonic())), brought up to date: a process signalled before and still there is
    not waited on again, since one in uninterruptible sleep (a wedged driver) never goes,
    and would hold every pass for the whole budget; one gone, or whose PID names another
    process now, leaves it. Returns how many were signalled now."""
    if not cgroup or cgroup == "/" or uid == 0:
        raise OSError(f"refusing to kill uid {uid}'s processes in cgroup {cgroup!r}")
    inside = cgroup.rstrip("/") + "/"
    before = signalled if signalled is not None else {}
    extra = list(dict.fromkeys(also))

    def theirs(pid: int) -> bool:
        return (owner := uid_of(pid)) == uid or (any_user and owner not in (None, 0))

    def start(pid: int) -> int | None:
        return start_of(pid) if start_of else None

    done: set[int] = set()  # signalled by this call (a dying process may still be listed)
    deadline = time.monotonic() + KILL_DEADLINE if until is None else until
    while True:
        listed = list(dict.fromkeys(pids(root, cgroup) + extra))
        skip = (spare(listed) if spare else set()) | done  # the rest in the kernel's order:
        left = [pid for pid in listed if pid not in skip]  # oldest (a storm's parent) first
        fresh = 0
        for pid in left:
            if time.monotonic() >= deadline and done:
                break  # the budget is spent: the rest is killed next pass
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                fd = os.pidfd_open(pid)
                try:
                    where = cgroup_of(pid)
                    if where is None or not (where + "/").startswith(inside) or not theirs(pid):
                        continue
                    began = start(pid)
                    if pid in before and before[pid][0] == began:
                        continue  # signalled by an earlier call, and not gone yet
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    done.add(pid)
                    before[pid] = (began, time.monotonic())
                    fresh += 1
                finally:
                    os.close(fd)
        if not fresh or time.monotonic() >= deadline:
            break
        time.sleep(0.005)  # forks made before the kill landed show in the next listing
    for pid in list(before):
        # Gone (or its PID another process's now): a later process with its number is new.
        # `also` names PIDs whether or not they live: the kernel's word decides.
        if not _still(pid, before[pid][0], inside, cgroup_of, start):
            del before[pid]
    return len(done)


def _still(
    pid: int,
    began: int | None,
    inside: str,
    cgroup_of: Callable[[int], str | None],
    start: Callable[[int], int | None],
) -> bool:
    """Whether the process signalled as `pid` (started at `began`) is still in the subtree."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError, ValueError, OSError):
        return False
    try:
        where = cgroup_of(pid)
        return where is not None and (where + "/").startswith(inside) and start(pid) == began
    finally:
        os.close(fd)


def paused(proc_root: str, pid: int, cgroup_base: str = "/sys/fs/cgroup") -> str:
    """Why process `pid` cannot answer now, from the kernel's word, or "": stopped
    (SIGSTOP, a tracer) or frozen (the cgroup freezer, which a user may set on her own
    manager's delegated cgroup: its cgroup.events says "frozen 1", inherited from any
    frozen parent). Small reads of /proc and cgroupfs, no call: a user's manager that is
    paused is not called, since a call would hold the GIL for the bus timeout."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        end = stat.rindex(b")")
        state = stat[end + 2 : end + 3]
    except (OSError, ValueError):
        return ""
    if state in (b"T", b"t"):
        return "stopped (SIGSTOP)" if state == b"T" else "stopped by a tracer"
    cgroup = ProcFS(proc_root).cgroup(pid)
    if not cgroup:
        return ""
    events = os.path.join(_v2_root(cgroup_base), cgroup.lstrip("/"), "cgroup.events")
    try:
        with open(events, "rb") as f:
            frozen = b"\nfrozen 1" in b"\n" + f.read(4096)
    except OSError:
        return ""
    return "frozen (cgroup freezer)" if frozen else ""


@functools.lru_cache(maxsize=4)
def _v2_root(base: str) -> str:
    return v2_root(base)
