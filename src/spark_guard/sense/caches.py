"""What the sensor keeps of a unit or a process from one reading to the next, and what
one pass may read and hold of what users control."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.classify import CommandLine
from ..core.snapshot import ARGV_OWNER_BUDGET, ARGV_PASS_BUDGET, ARGV_UNIT_BUDGET
from ..foresight.predict import Prediction
from ..system.managers import UnitDetails

MAPS_RECHECK = 5.0  # seconds between re-reads of one process's maps
MAPS_MIN_RSS = 256 * 1024**2  # smaller processes are not worth a maps scan
# A maps scan of 65,000 mappings takes ~26 ms: at most this many a pass, biggest first,
# and at most this many processes' mapped models held per manager (16 paths each).
MAPS_SCANS_PER_PASS = 8
MAPS_HELD_PER_OWNER = 32


@dataclass
class UnitCache:
    details: UnitDetails | None = None
    prediction: Prediction | None = None
    predicted: bool = False
    pids: frozenset[int] = frozenset()
    used: int = 0
    at: float = 0.0
    # ExecStart= read once per run (bounded, split): no pass splits it again.
    commands: tuple[CommandLine, ...] | None = None
    # When this run was first seen (a container's: its engine's StartedAt is wall-clock).
    since: float = 0.0
    details_bytes: int = 0  # what `details` holds of its writer's text
    # Details unreadable, or a footprint found unknown: when they are asked for again.
    retry_at: float = 0.0
    # Its manager was out of view when it was first seen (the normal case at boot: a
    # linger user's manager starts beside the guard): judged on its processes' argv, as
    # a group is, and read afresh from the manager once it answers. Nothing learnt then
    # is final.
    kernel_view: bool = False
    read_at: float = 0.0  # seen by the kernel, its manager failed to answer: asked again then
    # The processes' argv a prediction was made from (a group's, or a unit seen in the
    # kernel's view): a footprint not known from them is foreseen again when they change
    # (a wrapper that execs its server, a second process that names the model).
    foreseen_from: tuple[tuple[str, ...], ...] = ()
    argv: tuple[CommandLine, ...] = ()  # its processes' argv as last read


@dataclass
class ProcCache:
    cmdline: CommandLine | None = None  # read and split once per process
    argv_bytes: int = 0  # what it holds, or would: 0 until read
    models: tuple[str, ...] = ()
    maps_at: float = -MAPS_RECHECK
    # Its real uid (status): read at first sight; a user's cannot change without root's
    # help, root's can (cron's child turns into her job), so root's is read again once
    # the process is big and whenever its command line is read.
    uid: int | None = None
    # Whose entry this is: a PID reused by another process (a fork storm wraps pid_max
    # within a pass) must not inherit its cmdline, uid or models. A new cgroup resets it,
    # and a big process's start time is checked every pass (_fresh).
    cgroup: str = ""
    start: int | None = None
    reread: bool = False  # its argv was systemd's, before the exec: read again next pass


def smaller(new: Prediction, old: Prediction | None) -> bool:
    """A new footprint below one known before (or none where one was known)."""
    return old is not None and old.bytes is not None and (new.bytes or 0) < old.bytes


class PassBudget:
    """What one pass may read and hold of what users control: argv bytes per unit, per
    manager and in all (snapshot.py's ARGV_*_BUDGET), maps scans, and processes whose
    mapped models are held per manager. What is over it is not read, or dropped, and
    asked again next pass, when the unit's biggest processes come first."""

    def __init__(self) -> None:
        self.left = ARGV_PASS_BUDGET
        self.by_owner: dict[str, int] = {}
        # Maps: scans this pass, and processes whose mapped models are held per manager.
        self.maps_scans = MAPS_SCANS_PER_PASS
        self.maps_held: dict[str, int] = {}
        # Unit details (ExecStart=, Environment=) the unit caches hold, per manager.
        self.details_held: dict[str, int] = {}
        self.argv_reads = 0  # argv read this pass, all units (the watchdog's progress)

    def hold_maps(self, owner: str) -> bool:
        held = self.maps_held.get(owner, 0)
        if held >= MAPS_HELD_PER_OWNER:
            return False
        self.maps_held[owner] = held + 1
        return True

    def unit(self, owner: str) -> int:
        return min(ARGV_UNIT_BUDGET, self.left, self.by_owner.get(owner, ARGV_OWNER_BUDGET))

    def spend(self, owner: str, n: int) -> None:
        self.left -= n
        self.by_owner[owner] = self.by_owner.get(owner, ARGV_OWNER_BUDGET) - n
