"""The kernel port of the act side: what a stop reads of a cgroup and how it kills one.

A unit's cgroup is killed with cgroup.kill (or SIGKILL to each process where the
kernel has none); a user's rootless container is in her delegated subtree, so there
her processes and her subuids' are killed, never root's (a setuid program she runs
there), as her groups are. Reads only of /proc and /sys/fs/cgroup, and signals: no
fork, no exec, nothing on a bus.
"""

from __future__ import annotations

import os
import signal

from ..core.attribution import in_her_tree
from ..core.snapshot import UnitRef
from ..core.stops import Kill, Process
from ..core.text import printable
from ..system import cgroupfs
from ..system.managers import ManagerError
from ..system.procfs import ProcFS
from .ports import ManagerPort

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


class Kernel:
    """Cgroups and processes, below the root of the cgroup v2 tree."""

    def __init__(self, cgroup_root: str, proc: ProcFS) -> None:
        self.root = cgroup_root
        self.proc = proc

    def pids(self, cgroup: str) -> list[int]:
        return cgroupfs.pids(self.root, cgroup) if cgroup else []

    def populated(self, cgroup: str) -> bool | None:
        return cgroupfs.populated(self.root, cgroup)

    def processes(self, cgroup: str) -> frozenset[Process]:
        """The processes in a cgroup, each with its start (a pid alone may be reused)."""
        return frozenset((p, self.proc.start_ticks(p)) for p in self.pids(cgroup))

    def send(self, cgroup: str, sig: signal.Signals) -> str:
        """Signal every process of a cgroup; how it was done (raises on failure)."""
        return cgroupfs.send(self.root, cgroup, sig, cgroup_of=self.proc.cgroup)

    def kill(self, ref: UnitRef, cgroup: str) -> str:
        """SIGKILL what runs in `ref`'s cgroup; how it was done (raises on failure)."""
        uid = ref.engine_owner if ref.is_container else 0
        if not uid:
            return cgroupfs.kill(self.root, cgroup, cgroup_of=self.proc.cgroup)
        count = cgroupfs.kill_uid(
            self.root,
            cgroup,
            uid,
            uid_of=self.proc.uid,
            cgroup_of=self.proc.cgroup,
            start_of=self.proc.start_ticks,
            any_user=in_her_tree(cgroup, uid),
        )
        return f"{count} process(es) of uid {uid} and her subuids signalled"

    def carry_out(self, kill: Kill, manager: ManagerPort | None) -> tuple[str, bool | None]:
        """A Kill of core/stops.py: KillUnit SIGKILL through its manager where it says so,
        else (or when that fails) the cgroup's kill. (How it went; True: its cgroup was
        killed, False: nothing could be, None: its manager killed it.)"""
        failed = ""
        if kill.unit and manager is not None:
            try:
                manager.kill_unit(kill.ref.name, signal.SIGKILL)
                return "KillUnit SIGKILL", None
            except ManagerError as e:
                failed = f" (KillUnit: {e})"
        try:
            return self.kill(kill.ref, kill.cgroup) + failed, True
        except (OSError, ValueError, RuntimeError) as e:
            where = printable(kill.cgroup) or "(unknown)"
            return f"its cgroup {where} could not be killed: {e}{failed}", False

    def ignores_sigterm(self, cgroup: str) -> bool:
        """Whether any process of the cgroup has SIGTERM set to SIG_IGN (/proc/PID/status)."""
        for pid in self.pids(cgroup):
            try:
                with open(os.path.join(self.proc.root, str(pid), "status"), "rb") as f:
                    for line in f:
                        if line.startswith(b"SigIgn:"):
                            if int(line.split()[1], 16) & SIGTERM_BIT:
                                return True
                            break
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        return False

    def resumed(self, cgroup: str) -> bool:
        """Whether a process of the cgroup runs or sleeps, as no stopped one does (one in an
        uninterruptible wait is let be: stop_timeout ends that)."""
        return any(
            (self.proc.state(pid) or ("",))[0] in ("R", "S", "Z")  # Z: leader gone, threads on
            for pid in self.pids(cgroup)
        )
