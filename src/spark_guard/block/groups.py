"""A user's groups of processes, killed: what has no unit to stop, mask or undo.

A group (SeenUnit.group) is what a user runs outside any unit of hers that her manager
could stop: her job inside a system unit, processes left in her manager's init.scope, a
session's. Her processes in its cgroup are killed, by the kernel's word (her real uid,
still in it), and nobody else's: the system unit her job ran in, her manager itself,
root's session. In her delegated subtree every non-root process is hers (her user
namespaces' subuids). A pass's kills share one time budget on the loop; what a fork
storm leaves is killed again at the next pass, or by again() for a one-shot rescue.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.attribution import in_her_tree, in_tree, user_tree
from ..core.events import Event, EventKind, tell
from ..core.snapshot import Action, manager_uid
from ..core.text import printable
from ..system import cgroupfs
from ..system.procfs import ProcFS

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger  # type only: no runtime import


@dataclass(frozen=True)
class GroupKill:
    """A group's kill a pass asked for: its cgroup, what it is, and the pids the snapshot
    attributed to it (its cgroup's walk is bounded; these are found wherever they are)."""

    action: Action
    cgroup: str
    group: str | None  # what it is (SeenUnit.group; rescue's unit of a manager out of view)
    pids: tuple[int, ...]


class Groups:
    """The last pass's group kills, and per group the processes signalled and not gone."""

    def __init__(self, proc: ProcFS, cgroup_root: str, log: FilteringBoundLogger) -> None:
        self.proc = proc
        self.cgroup_root = cgroup_root
        self.log = log
        self.kills: dict[str, GroupKill] = {}  # the last pass's (again() repeats them)
        # Per group, the processes its kills signalled (pid -> (start, when)), not yet gone.
        self.signalled: dict[str, dict[int, tuple[int | None, float]]] = {}
        self.stuck_said: dict[str, str] = {}  # a group's processes said to be stuck, where

    @property
    def pending(self) -> bool:
        """A kill of this pass may have more to do (again())."""
        return bool(self.kills)

    def kill(self, kills: list[GroupKill], kill_timeout: float) -> None:
        """This pass's kills, within one budget (cgroupfs.KILL_DEADLINE) together; a group
        not named again is forgotten (gone, or no longer a threat)."""
        until = time.monotonic() + cgroupfs.KILL_DEADLINE
        self.kills = {str(k.action.unit): k for k in kills}
        for kill in kills:
            self._kill(kill, kill_timeout, until)
        for key in set(self.signalled) - set(self.kills):
            del self.signalled[key]

    def again(self, kill_timeout: float) -> None:
        """Kill each group again; one whose kill found nothing new of hers is done."""
        for key, kill in list(self.kills.items()):
            if not self._kill(kill, kill_timeout):
                del self.kills[key]

    def _kill(self, kill: GroupKill, kill_timeout: float, until: float | None = None) -> int:
        """How many were signalled now: those signalled before and still there
        (uninterruptible sleep) are said once, not signalled again. The journal names
        her uid."""
        action, cgroup = kill.action, kill.cgroup
        key = printable(str(action.unit))
        signalled = self.signalled.setdefault(str(action.unit), {})
        uid = -1
        try:
            uid = manager_uid(action.unit.manager)
            count = cgroupfs.kill_uid(
                self.cgroup_root,
                cgroup,
                uid,
                uid_of=self.proc.uid,
                cgroup_of=self.proc.cgroup,
                start_of=self.proc.start_ticks,
                spare=self._spare(cgroup),
                any_user=in_her_tree(cgroup, uid),
                until=until,
                also=kill.pids,  # those deeper than the walk goes
                signalled=signalled,
            )
        except (OSError, ValueError, RuntimeError) as e:  # one group's, never the pass's
            self._failed(action, key, str(e))
            return 0
        if not count:
            # Still there kill_timeout after their SIGKILL: a process freeing a big mapping
            # takes a moment to go; one in uninterruptible sleep never does.
            now = time.monotonic()
            stuck = [p for p, (_, at) in signalled.items() if now - at >= kill_timeout]
            shown = printable(cgroup)
            if stuck and self.stuck_said.get(key) != shown:
                self.stuck_said[key] = shown  # said once, until a kill lands again
                self._failed(
                    action,
                    key,
                    f"{len(stuck)} process(es) of uid {uid} in {shown} are still there "
                    f"{kill_timeout:g}s after SIGKILL (uninterruptible sleep: a driver or "
                    "filesystem that does not return; see spark-guard doctor)",
                    uid=uid,
                    cgroup=cgroup,
                )
            return 0
        self.stuck_said.pop(key, None)
        self._killed(kill, key, uid, count)
        return count

    def _killed(self, kill: GroupKill, key: str, uid: int, count: int) -> None:
        action, shown = kill.action, printable(kill.cgroup)
        what = printable(kill.group or "processes that are no unit")
        tell(
            self.log,
            Event.of(
                EventKind.UNIT_KILLED,
                "warning",
                unit=key,
                manager=action.unit.manager,
                uid=uid,
                how=f"SIGKILL to {count} process(es) of uid {uid} in {shown}",
                cgroup=kill.cgroup,
                reason=action.reason,
                error=action.detail,
                msg=f"{key}: killed {count} process(es) of uid {uid} in {shown} "
                f"({action.reason}); {what}: no mask laid, nothing to undo",
            ),
        )

    def _spare(self, cgroup: str) -> Callable[[list[int]], set[int]]:
        tree = user_tree(cgroup)
        if tree is not None and tree[0] == cgroup:
            return functools.partial(self._spare_tree, cgroup)

        def spare(pids: list[int]) -> set[int]:
            # Her manager is the oldest process of its init.scope: she cannot be older.
            if not cgroup.endswith("/init.scope") or not pids:
                return set()
            starts = {p: self.proc.start_ticks(p) for p in pids}
            known = {p: t for p, t in starts.items() if t is not None}
            return {min(known, key=lambda p: known[p])} if known else set()

        return spare

    def _spare_tree(self, base: str, pids: list[int]) -> set[int]:
        """In user@UID.service itself, what is not hers to kill: whatever lies deeper (her
        units, her manager's init.scope), and a process whose parent is outside her tree:
        her manager (older systemd runs it there), which PID 1 started. Hers have
        their parents in her tree: her orphans go to her manager (a subreaper), and the
        kernel lets no process of hers from outside the tree in (cgroup.procs of the
        common ancestor is root's)."""
        spared = set()
        for pid in pids:
            state = self.proc.state(pid)
            outside = state is None or not in_tree(self.proc.cgroup(state[1]) or "", base)
            if self.proc.cgroup(pid) != base or outside:
                spared.add(pid)
        return spared

    def _failed(self, action: Action, key: str, why: str, **fields: object) -> None:
        tell(
            self.log,
            Event.of(
                EventKind.UNIT_STOP_FAILED,
                "error",
                unit=key,
                manager=action.unit.manager,
                error=why,
                msg=f"cannot kill {key}: {why}",
                **fields,
            ),
        )
