"""Whose a process is: the unit, or the user's group, its memory counts for. Pure.

A process's cgroup path says which manager's unit it runs in (the deepest
manager root wins); its real uid says whether it is that unit's or a user's.
A login user's process in a scope or service of root's managers (her crontab's
job in cron.service, one `sudo -u` runs) is hers: a group of her level, judged
and killed alone. A process in or below user@UID.service that her manager does
not account for (her manager out of view, a cgroup of her own that names no
unit, user@UID.service itself) is hers too, whatever its uid but root's. The
sensor reads the cgroups and the uids (a uid only where it matters: `uid` is
asked lazily); this module only judges them. docs/security.md says why each case goes where it goes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .snapshot import (
    FIRST_LOGIN_UID,
    SYSTEM,
    SYSTEM_RANGE,
    UnitRef,
    manager_uid,
    user_manager,
    valid_unit_name,
)

# Root's managers, PID 1 and root's own: a login user's process in one of their units is
# her job or session there, not theirs.
ROOTS = (SYSTEM, user_manager(0))
_USER_TREE = re.compile(r"^((?:/[^/]+\.slice)*/user@(\d+)\.service)(?:/|$)")

# A process of a unit: (pid, its RSS, its GPU memory or None).
Proc = tuple[int, int, int | None]


@dataclass(frozen=True)
class Owner:
    """Whose a process is: the unit (or group) it counts for, and its cgroup."""

    ref: UnitRef
    cgroup: str
    group: str = ""  # what a group of a user's processes is (SeenUnit.group); "": a unit


def human(uid: int | None) -> bool:
    """A user's uid (snapshot.py's FIRST_LOGIN_UID and SYSTEM_RANGE): whose processes in a
    scope or a service of root's are theirs, not the unit's. Debian's system users,
    DynamicUser= and nobody are not; a directory's users and subuids are."""
    return uid is not None and uid >= FIRST_LOGIN_UID and uid not in SYSTEM_RANGE


def user_tree(cgroup: str) -> tuple[str, int] | None:
    """(user@UID.service's cgroup, UID) when `cgroup` lies in a user manager's delegated
    subtree: the outermost user@UID.service below slices only (what PID 1 makes; a user's
    own cgroups are deeper). None otherwise."""
    m = _USER_TREE.match(cgroup)
    return (m.group(1), int(m.group(2))) if m else None


def in_her_tree(cgroup: str, uid: int) -> bool:
    """Whether `cgroup` lies in the subtree delegated to `uid` (user@UID.service): there
    every process but root's is hers, her user namespaces' subuids included."""
    tree = user_tree(cgroup)
    return tree is not None and tree[1] == uid


def in_tree(cgroup: str, base: str) -> bool:
    """Whether `cgroup` is `base` or lies below it."""
    return cgroup == base or cgroup.startswith(base.rstrip("/") + "/")


def unit_cgroup(cgroup: str, unit: str) -> str:
    """The unit's own cgroup in a process's path: '/a.slice/u.service/x' -> '/a.slice/u.service'."""
    parts = cgroup.split("/")
    return "/".join(parts[: parts.index(unit) + 1]) if unit in parts else cgroup


def unit_of_cgroup(cgroup: str, root: str) -> str | None:
    """The unit a cgroup path belongs to, as seen by the manager rooted at `root`.

    '/system.slice/foo.service/payload' -> 'foo.service'; the first component
    below the root that is not a slice names the unit (services may delegate
    sub-cgroups of their own).
    """
    prefix = "" if root == "/" else root
    if prefix and not (cgroup == prefix or cgroup.startswith(prefix + "/")):
        return None
    for part in cgroup[len(prefix) :].split("/"):
        if part and not part.endswith(".slice"):
            return part if valid_unit_name(part) else None
    return None


def attribute(cgroup: str, roots: Mapping[str, str]) -> tuple[str, str] | None:
    """(manager key, unit) for a cgroup path, given each manager's root cgroup: the
    deepest manager root wins."""
    best: tuple[int, str, str] | None = None
    for key, root in roots.items():
        unit = unit_of_cgroup(cgroup, root)
        depth = 0 if root == "/" else root.count("/")
        if unit and (best is None or depth > best[0]):
            best = (depth, key, unit)
    return (best[1], best[2]) if best else None


def out_of_view(cgroup: str, uid: Callable[[], int | None]) -> Owner | None:
    """A process below user@UID.service that its manager does not account for: the
    manager is out of view (renamed socket, stopped, never trusted), or the process
    sits in a cgroup of her own that names no unit of it (`.../hideout`). Never PID 1's
    to judge (its user@UID.service is protected), so it would grow unseen. Whatever runs
    in her delegated subtree is hers, whichever uid: hers, her user namespaces' subuids
    (rootless Podman), or a process only root could have put there; root's own (a
    setuid helper) is left to PID 1's unit. A unit of hers is hers (user:UID:UNIT);
    anything else is a group."""
    tree = user_tree(cgroup)
    if tree is None:
        return None
    base, owner_uid = tree
    if owner_uid == 0 or uid() in (0, None):
        return None
    unit = unit_of_cgroup(cgroup, base)
    key = user_manager(owner_uid)
    if unit is not None and unit.endswith(".service"):
        return Owner(UnitRef(key, unit), unit_cgroup(cgroup, unit))
    if unit is not None:
        return Owner(UnitRef(key, unit), unit_cgroup(cgroup, unit), f"her {unit}")
    first = next((p for p in cgroup[len(base) :].split("/") if p), None)
    if first is None:
        # In user@UID.service itself, where her delegation lets her put a process (issue
        # 40, H3): hers too, never PID 1's protected unit's. Its kill takes only what is
        # there and not her manager (block/groups.py), never her whole tree.
        return Owner(UnitRef(key, base), base, f"processes in user@{owner_uid}.service itself")
    path = f"{base}/{first}"
    return Owner(UnitRef(key, path), path, f"a cgroup of her own below user@{owner_uid}.service")


def owner(
    cgroup: str,
    roots: Mapping[str, str],
    uid: Callable[[], int | None],
    guard: UnitRef | None = None,
) -> Owner | None:
    """The unit a process counts for, by its manager's word (`roots`) and the kernel's:
    a process of a login user in a scope of root's managers, or in a unit of theirs that
    does not run as her, is a group of hers (split_jobs() does the services)."""
    found = attribute(cgroup, roots)
    if found is None or (found[0] == SYSTEM and found[1].startswith("user@")):
        hers = out_of_view(cgroup, uid)
        if hers is not None:
            return hers
    if found is None:
        return None
    ref = UnitRef(*found)
    own = unit_cgroup(cgroup, ref.name)
    if ref.name.endswith(".service") or ref == guard:
        return Owner(ref, own)
    who = uid()
    if ref.manager in ROOTS and who is not None and human(who):
        return Owner(UnitRef(user_manager(who), own), own, f"uid {who}'s processes in {ref}")
    if ref.manager != SYSTEM and who and who == manager_uid(ref.manager):
        return Owner(ref, own, f"her {ref.name}")
    return Owner(ref, own)


def split_jobs(
    groups: Mapping[UnitRef, list[Proc]],
    cgroups: Mapping[UnitRef, str],
    uid: Callable[[int, int], int | None],
    guard: UnitRef | None = None,
) -> tuple[
    dict[UnitRef, list[Proc]], dict[UnitRef, str], dict[UnitRef, str], dict[UnitRef, UnitRef]
]:
    """A user's processes in a service of root's managers (her crontab's jobs in Debian's
    cron.service, which has no pam_systemd; a .forward pipe exim runs; her job run as
    one of her subuids) are hers: a group of her level, judged and killed alone; the
    unit's evidence and memory are its own processes' only. Hers by the kernel's word:
    a user's uid (human()) that is not the one the service runs as (the lowest among its
    processes: its main process came first). `uid(pid, memory)`: a process's real uid.
    Returns the processes by unit and group, their cgroups, what each group is, and the
    service each group is a job in."""
    out, where, what = dict(groups), dict(cgroups), {}
    within: dict[UnitRef, UnitRef] = {}
    for ref in [r for r in groups if r.manager in ROOTS and r.name.endswith(".service")]:
        if ref == guard:
            continue
        procs = groups[ref]
        uids = {pid: uid(pid, rss + (g or 0)) for pid, rss, g in procs}
        runs_as = min((u for u in uids.values() if u is not None), default=0)
        theirs = {pid: u for pid, u in uids.items() if u is not None and human(u) and u != runs_as}
        if not theirs:
            continue
        own = cgroups.get(ref, "")
        for who in sorted(set(theirs.values())):
            group = UnitRef(user_manager(who), own or ref.name)
            out.setdefault(group, [])
            out[group] = [*out[group], *(p for p in procs if theirs.get(p[0]) == who)]
            where.setdefault(group, own)
            what[group] = f"uid {who}'s job in {ref}"
            within[group] = ref
        out[ref] = [p for p in procs if p[0] not in theirs]
    return out, where, what, within
