"""A block as a state machine: its steps, the changes between them, and a stop's escalation.

Pure: plain values in, plain values out. The blocker (block/blocker.py) is the
executor: it reads the managers, the files and the memory, asks this module
what follows, carries out what it says through the managers and the kernel,
and is the one place that writes the records.

A unit's block goes stop -> plan -> disable -> mask -> settle -> verify ->
blocked (blocker.py's docstring says what each step does); a container's goes
stop -> blocked, through its engine. TRANSITIONS lists every change a block may
make, the rewinds included; moved() refuses any other.

While a stop is pending, escalate() says what comes next on time and on
memory: SIGKILL through the manager when the stop timeout is up (at once when
the judged figure falls below the reserve), the cgroup's kill when that too is
not enough, and when even that leaves the unit running, a pause before the
whole escalation begins again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum, StrEnum
from itertools import pairwise

from .quantities import format_size


class Step(StrEnum):
    """A block's steps, in order; a record always names the next one. The values are what
    the records on disk say."""

    STOP = "stop"
    PLAN = "plan"
    DISABLE = "disable"
    MASK = "mask"
    SETTLE = "settle"
    VERIFY = "verify"
    BLOCKED = "blocked"


STEPS = tuple(Step)

# Every step change a unit's block may make, and only these.
TRANSITIONS: dict[Step, frozenset[Step]] = {
    Step.STOP: frozenset({Step.PLAN}),
    Step.PLAN: frozenset({Step.DISABLE}),
    Step.DISABLE: frozenset({Step.MASK}),
    Step.MASK: frozenset({Step.SETTLE}),
    Step.SETTLE: frozenset(
        {
            Step.VERIFY,
            # Rewind: its mask vanished while it stopped (a reboot with a loader in D state,
            # her runtime dir removed at logout): laid again before it is looked at.
            Step.MASK,
        }
    ),
    Step.VERIFY: frozenset(
        {
            Step.BLOCKED,
            # Rewind: active again before the mask took (verify finds it running, or a
            # decision asks to stop it again).
            Step.SETTLE,
            # Rewind: a decision asks to stop it again and its mask is gone (unmasked by hand).
            Step.MASK,
        }
    ),
    Step.BLOCKED: frozenset(
        {
            # Rewind: its mask vanished (reboot, manager restart, by hand): laid again.
            Step.MASK,
            # Rewind: a decision asks to stop it again while the mask still stands (it
            # started before the mask was back).
            Step.SETTLE,
        }
    ),
}
# A container's block has two steps: the stop, with its restart policy set to "no", done
# by the engine in one go off the loop; then blocked.
CONTAINER_TRANSITIONS: dict[Step, frozenset[Step]] = {
    Step.STOP: frozenset({Step.BLOCKED}),
    # Rewind: running again (started by hand, or its policy changed back): stopped again.
    Step.BLOCKED: frozenset({Step.STOP}),
}


# The step a unit's block goes on to once the work of its step is done.
FORWARD = dict(pairwise(STEPS))


def forward(step: Step | str, *, container: bool = False) -> Step:
    """The step after `step` (its work done): blocked stays blocked; a container's stop,
    done by its engine with its policy, is its block."""
    return Step.BLOCKED if container else FORWARD.get(Step(step), Step.BLOCKED)


class StepError(RuntimeError):
    """A step change the table does not allow; str() names the unit and both steps."""


def moved(name: str, step: Step | str, to: Step, *, container: bool = False) -> Step:
    """`to`, if a block at `step` may go there; StepError (naming `name`) if not."""
    table = CONTAINER_TRANSITIONS if container else TRANSITIONS
    if to not in table.get(Step(step), frozenset()):
        raise StepError(f"{name}: no step change from {step} to {to}")
    return to


class Work(StrEnum):
    """What the executor does for a unit's block at its step, in one pass."""

    STOP = "stop"  # freeze the unit and StopUnit it (the step moves on once it is out)
    PLAN = "plan"  # record the links a disable removes and where the mask goes
    DISABLE = "disable"  # DisableUnitFiles, then check each recorded link is gone
    MASK = "mask"  # lay the mask in the manager's runtime control directory
    LOOK = "look"  # read its state: settled, or escalate() says what next (batched)
    VERIFY = "verify"  # read LoadState back (batched per manager)
    NONE = "none"  # nothing now: blocked, or its stop is out and awaited


# The steps whose work, once done, lets the next step's run in the same pass: everything
# up to the mask goes out at once, since memory may be going.
CASCADE = (Work.STOP, Work.PLAN, Work.DISABLE, Work.MASK)
# The work that changes files (a manager's links, a mask): it runs only once the record of
# what it changes is on disk, so that a release can always undo it. The stop changes no
# file and goes first.
FILE_WORK = (Work.DISABLE, Work.MASK)


def work_for(step: Step | str, stop_sent: bool) -> Work:
    """The work a unit's block does at `step`; `stop_sent`: this guard sent its stop."""
    step = Step(step)
    if step == Step.STOP:
        return Work.NONE if stop_sent else Work.STOP
    return {
        Step.PLAN: Work.PLAN,
        Step.DISABLE: Work.DISABLE,
        Step.MASK: Work.MASK,
        Step.SETTLE: Work.LOOK,
        Step.VERIFY: Work.VERIFY,
    }.get(step, Work.NONE)


def due(
    step: Step | str, stopping: Stopping | None, retry_at: float, now: float, mask_gone: bool
) -> bool:
    """Whether a unit's block is worked on in this pass: a blocked unit only when its mask
    is gone (laid again); a stop in progress on every pass, but not while it rests after
    a give-up; anything else unfinished once its retry is due (RETRY_AFTER after a try)."""
    step = Step(step)
    if step == Step.BLOCKED:
        return mask_gone
    if step == Step.SETTLE and stopping is not None:
        return stopping.due(now)
    return now >= retry_at


class Verdict(StrEnum):
    """What verify() reads in a unit's state after its mask."""

    BLOCKED = "blocked"  # LoadState masked: done
    RUNNING = "running"  # active again before the mask took: its stop is looked at again
    NOT_MASKED = "not-masked"  # not masked and not running: a file outranks the mask


def verdict(load_state: str | None, active_state: str | None) -> Verdict:
    """The verdict on a unit's state read back after a reload (None: not listed)."""
    if load_state == "masked":
        return Verdict.BLOCKED
    if active_state is not None and active_state not in SETTLED:
        return Verdict.RUNNING
    return Verdict.NOT_MASKED


def verified(found: Verdict) -> Step | None:
    """Where verify's verdict takes a block: blocked; back to its stop (running again
    before the mask took); or nowhere (a file outranks the mask: said, tried again)."""
    return {Verdict.BLOCKED: Step.BLOCKED, Verdict.RUNNING: Step.SETTLE}.get(found)


SETTLED = ("inactive", "failed")  # ActiveStates a stop ends in


def running_again(step: Step | str, mask_present: bool, *, container: bool = False) -> Step | None:
    """Where a unit's block goes back to when a decision finds it running again: its mask
    first if the mask is gone (unmasked by hand while no guard watched), else its stop is
    looked at again; a blocked container's, its stop. None: the block has not got that
    far; it goes on as it is."""
    if container:
        return Step.STOP if Step(step) == Step.BLOCKED else None
    if Step(step) not in (Step.BLOCKED, Step.VERIFY):
        return None
    return Step.MASK if not mask_present else Step.SETTLE


# The steps after the mask was laid: a mask gone from under one of them is laid again.
MASKED_STEPS = (Step.SETTLE, Step.VERIFY, Step.BLOCKED)


def mask_gone(step: Step | str, present: bool) -> Step | None:
    """A block past its mask whose mask vanished (reboot, manager restart, her runtime dir
    removed at logout): the mask goes back, from settle and verify as from blocked. Left
    at settle or verify, the unit would be disabled but not masked, and a Wants=, timer or
    socket would start it; verify would reload its manager for ever."""
    return Step.MASK if Step(step) in MASKED_STEPS and not present else None


def settled(active_state: str | None, load_state: str | None, left: int | None) -> bool:
    """Whether a stopped unit is done with: its manager says it is not running (or knows it
    no longer) **and** nothing is left in its cgroup (`left`: processes there, None where
    no cgroup is known). With KillMode=process (a wrapper whose server is its child) or
    SendSIGKILL=no a unit reads inactive while its server keeps its memory."""
    stopped = active_state is None or active_state in SETTLED or load_state == "not-found"
    return stopped and not left


class Stage(IntEnum):
    """How far a pending stop has been taken."""

    SENT = 0  # the stop went out (the unit frozen first where it can be)
    KILLED = 1  # SIGKILL through the manager
    CGROUP_KILLED = 2  # every process of its cgroup killed by the kernel (cgroup.kill)


class Escalation(StrEnum):
    """What escalate() asks the executor to do."""

    KILL_UNIT = "kill-unit"
    KILL_CGROUP = "kill-cgroup"
    GIVE_UP = "give-up"  # still running after all of it: said, and tried again later


# After SIGKILL, how long a unit may take to go before the cgroup kill, while memory is short.
KILL_GRACE = 0.5
# Seconds between attempts to finish a block that did not complete.
RETRY_AFTER = 5.0


@dataclass(frozen=True)
class Stopping:
    """A stop this guard sent: when, how far it has been taken and since when, and (after
    a give-up) until when it rests."""

    sent: float
    stage: Stage = Stage.SENT
    since: float = 0.0
    hold_until: float = 0.0

    @classmethod
    def at(cls, now: float) -> Stopping:
        return cls(sent=now, since=now)

    def killed(self, now: float) -> Stopping:
        """SIGKILL sent now (a frozen unit that ignores SIGTERM is killed at once)."""
        return replace(self, stage=Stage.KILLED, since=now)

    def settled(self) -> Stopping:
        """The unit stopped: a later rewind escalates again from the stop it was sent."""
        return replace(self, stage=Stage.SENT, since=self.sent, hold_until=0.0)

    def due(self, now: float) -> bool:
        """Whether the stop is looked at now (not resting after a give-up)."""
        return now >= self.hold_until


def escalate(
    stopping: Stopping,
    now: float,
    memory: tuple[int, int] | None,
    stop_timeout: float,
    kill_timeout: float,
) -> tuple[Stopping, Escalation | None, str]:
    """One look at a unit still running after its stop: (the stop's next state, what to do
    or None, why). `memory`: (the judged figure, the reserve), None when /proc cannot say.
    A figure below the reserve skips the waiting: SIGKILL at once, the cgroup's kill
    KILL_GRACE after it."""
    elapsed = now - stopping.since
    short = ""
    if memory is not None and memory[0] < memory[1]:
        short = (
            f"MemAvailable {format_size(memory[0])} below the reserve "
            f"{format_size(memory[1])} {now - stopping.sent:.2f}s after the stop"
        )
    if stopping.stage == Stage.SENT and (elapsed >= stop_timeout or short):
        why = short or f"it did not stop within {stop_timeout:g}s"
        return replace(stopping, stage=Stage.KILLED, since=now), Escalation.KILL_UNIT, why
    if stopping.stage == Stage.KILLED and (
        elapsed >= kill_timeout or (short and elapsed >= KILL_GRACE)
    ):
        why = short or f"still running {now - stopping.sent:.1f}s after the stop"
        nxt = replace(stopping, stage=Stage.CGROUP_KILLED, since=now)
        return nxt, Escalation.KILL_CGROUP, why
    if stopping.stage == Stage.CGROUP_KILLED and elapsed >= kill_timeout:
        # The next try escalates again from SIGKILL, after a rest.
        rest = replace(stopping.settled(), hold_until=now + RETRY_AFTER)
        return rest, Escalation.GIVE_UP, "still running after stop, SIGKILL and cgroup kill"
    return stopping, None, ""


def container_stuck(
    stopping: Stopping,
    now: float,
    answered: bool,
    engine_timeout: float,
    memory: tuple[int, int] | None,
) -> str:
    """Why a container whose block is under way (the engine's stop waits, off the loop)
    is to be killed from the kernel's side now, as a unit is when its manager does not
    answer: its engine has not answered within its timeout, or the judged figure is below
    the reserve. "" to let the engine do it."""
    waited = now - stopping.sent
    if not answered and waited >= engine_timeout:
        return f"its engine did not answer within {waited:.1f}s"
    if memory is not None and memory[0] < memory[1]:
        return (
            f"MemAvailable {format_size(memory[0])} below the reserve "
            f"{format_size(memory[1])} {waited:.2f}s after the stop"
        )
    return ""
