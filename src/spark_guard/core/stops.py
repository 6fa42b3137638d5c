"""A stop as one value, and advance(): what follows it, pure.

A stop-only stop (a server that loads on request, asked over its API from outside
any unit) is stopped and left enabled: no record, no mask. Its kinds are a unit's,
stopped through its manager (frozen first), and a container's, stopped through its
engine with its restart policy left as it is. While it is under way it is one Stop
value, kept on disk (block/records.py, `stopping/`) so that a guard restarted before
the server has gone escalates it still.

The executor (block/loose.py) reads what the machine needs, once per pass, into a
Seen: its manager's word on the unit, the processes left in its cgroup, whether
its engine's stop is still under way and what it answered, the memory figure. Then
advance(stop, seen, now, limits) returns the stop's next value (None: done with,
forgotten) and the commands to carry out, as data: Kill (SIGKILL through its
manager, else its cgroup from the kernel's side) and Say (an event). Every step,
escalation, rest and word said is chosen here; the tests are transcripts of plain
values (tests/test_stops.py).

Settled means stopped **and** nothing left in its cgroup: with KillMode=process or
SendSIGKILL=no a unit reads inactive while its server keeps the memory (F3). A run
the stop never went to is a new decision's to judge, never this stop's to kill (F8).
A stop an earlier guard sent, whose manager cannot say which run is there now, waits
for it, and does not keep the loop busy meanwhile (F11).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from .block import Escalation, Stopping, escalate, settled
from .events import Event, EventKind
from .snapshot import UnitRef
from .text import printable

# After a stop went out, a unit neither deactivating nor stopped is a new run: for a stop
# an earlier guard sent, once this long has passed since.
LOOSE_GRACE = 1.0

# A process: (pid, its start in clock ticks; None if unreadable). A pid alone may be reused.
Process = tuple[int, int | None]


class Kind(StrEnum):
    """How a stop went out."""

    UNIT = "unit"  # stop-only: StopUnit through its manager, frozen first
    ENGINE = "engine"  # stop-only: a container's, through its engine
    # A unit's block at its settle step: stopped, disabled and masked (block/blocker.py
    # walks its record's steps; this machine is its stop's, from the stop to verify).
    BLOCK = "block"


@dataclass(frozen=True)
class Stop:
    """Everything about one stop-only stop under way."""

    ref: UnitRef
    cgroup: str
    stopping: Stopping
    # Sent by an earlier guard (read from disk): which run it stops is known only from
    # its manager's answer, never from its cgroup (a new run has the same one).
    restored: bool = False
    seen_stopping: bool = False  # seen deactivating: a later other state is a new run
    # The processes the stop went to: a run with none of them left is a new one.
    went_to: frozenset[Process] = frozenset()
    # An earlier guard's, its manager silent: it waits for the manager, not escalated
    # blind, and the loop is not kept busy for it.
    waiting: bool = False
    kind: Kind = Kind.UNIT
    # A block's, found at settle with no stop of this guard's (a guard restarted, a mask laid
    # again): nothing to say when it is found stopped.
    quiet: bool = False


@dataclass(frozen=True)
class Seen:
    """What the executor read of one stop this pass."""

    left: frozenset[Process] = frozenset()  # the processes in its cgroup now
    manager: bool = True  # its manager is connected (a unit's)
    answered: bool = True  # ... and answered the read of its state
    active_state: str | None = None  # None: it does not list the unit
    load_state: str | None = None
    busy: bool = False  # a container's: its engine's stop is still under way
    error: str = ""  # a container's: why its engine did not stop it
    memory: tuple[int, int] | None = None  # (the judged figure, the reserve)


@dataclass(frozen=True)
class Limits:
    stop_timeout: float
    kill_timeout: float


@dataclass(frozen=True)
class Say:
    event: Event


@dataclass(frozen=True)
class Kill:
    """SIGKILL what runs of the stop: through its manager first (`unit`), else (or when
    that fails) its cgroup from the kernel's side. event() says it, given how it went."""

    ref: UnitRef
    cgroup: str
    why: str
    unit: bool = False
    # Said as the stop failing (its manager or engine did not take it), not as a kill.
    failed: bool = False

    def event(self, how: str, cgroup: bool = False) -> Event:
        """Said once done: `how` it went; `cgroup`: its cgroup was killed."""
        key = str(self.ref)
        if self.failed:
            through = " through its engine" if self.ref.is_container else ""
            return Event.of(
                EventKind.UNIT_STOP_FAILED,
                "error",
                unit=key,
                manager=self.ref.manager,
                error=self.why,
                how=how,
                msg=f"cannot stop {key}{through}: {self.why}; {how}",
            )
        return Event.of(
            EventKind.UNIT_KILLED,
            "warning",
            unit=key,
            manager=self.ref.manager,
            how=how,
            error=self.why,
            cgroup=self.cgroup if cgroup else None,
            msg=f"{key}: killed its cgroup ({self.why})" if cgroup else f"{key}: {how}: {self.why}",
        )


@dataclass(frozen=True)
class Settled:
    """A block's stop is over (`waited`: since it went out; None: nothing was stopped):
    its record goes on to verify its mask."""

    waited: float | None


@dataclass(frozen=True)
class GiveUp:
    """A block's stop that nothing ended: its record's problem, said once; it rests, then
    escalates again from SIGKILL."""

    why: str


Command = Say | Kill | Settled | GiveUp


def sent(
    ref: UnitRef,
    cgroup: str,
    now: float,
    reason: str,
    *,
    job: str | None = None,
    frozen: bool = False,
    went_to: frozenset[Process] = frozenset(),
    ignores_sigterm: bool = False,
    engine: str = "",
) -> tuple[Stop, tuple[Command, ...]]:
    """A stop that went out now: through its manager (`job`, frozen first where it could
    be, to `went_to`) or its engine (`engine`). A frozen unit with a process that ignores
    SIGTERM is killed at once: the stop could only end at its timeout, and the thaw would
    give it those seconds to allocate."""
    kind = Kind.ENGINE if ref.is_container else Kind.UNIT
    stop = Stop(ref, cgroup, Stopping.at(now), went_to=went_to, kind=kind)
    key = str(ref)
    if kind == Kind.ENGINE:
        how = f"stop-only, engine {engine}"
        msg = (
            f"stopping {key} through {engine} ({reason}), its restart policy left as it "
            "is: it loads on request and no unit asked this load"
        )
    else:
        how = "stop-only"
        msg = (
            f"stopping {key} ({reason}), not masking or disabling it: it loads on "
            "request and no unit asked this load (asked over its API)"
        )
    out: list[Command] = [
        Say(
            Event.of(
                EventKind.UNIT_STOP_REQUESTED,
                "warning",
                unit=key,
                manager=ref.manager,
                job=job,
                how=how,
                reason=reason,
                frozen=frozen,
                msg=msg,
            )
        )
    ]
    if frozen and ignores_sigterm:
        out.append(Kill(ref, cgroup, "it ignores SIGTERM (seen frozen)", unit=True))
        stop = replace(stop, stopping=stop.stopping.killed(now))
    return stop, tuple(out)


def refused(ref: UnitRef, cgroup: str, error: str) -> Kill:
    """Its manager did not take the stop: its cgroup is killed from the kernel's side."""
    return Kill(ref, cgroup, error, failed=True)


def cannot_stop(ref: UnitRef, error: str, paused_for: float | None = None) -> Event:
    """A block's stop its manager did not take; `paused_for`: its processes are paused
    (SIGSTOP) meanwhile, and killed if it does not answer within that many seconds."""
    key = str(ref)
    paused = (
        f"; its processes are paused (SIGSTOP) until it answers, killed if it does not "
        f"within {paused_for:g}s"
        if paused_for is not None
        else ""
    )
    return Event.of(
        EventKind.UNIT_STOP_FAILED,
        "error",
        unit=key,
        manager=ref.manager,
        error=error,
        msg=f"cannot stop {key}: {error}{paused}",
    )


def unwritten(ref: UnitRef, error: str) -> Event:
    """A stop that could not be kept on disk (a full or read-only disk): this guard still
    escalates it, and a restarted one would not know it."""
    name = printable(str(ref))
    msg = f"cannot keep the stop of {name} on disk: {error}"
    return Event.of(EventKind.STATE_UNWRITTEN, "warning", unit=name, error=error, msg=msg)


def unreadable(error: str) -> Event:
    """A kept stop's file that is not one (it is set aside, named, by the store)."""
    return Event.of(EventKind.RECORD_UNREADABLE, "error", error=error, msg=error)


def restored(
    ref: UnitRef, cgroup: str, sent_at: float, boot: str, this_boot: str, now: float
) -> Stop | None:
    """A stop an earlier guard kept on disk, or None (to forget) when it is not this
    boot's (nothing of it runs), or a container's (its engine escalated it by itself, and
    a run started again has the same cgroup: not one to kill on an old clock)."""
    if not boot or boot != this_boot or ref.is_container:
        return None
    return Stop(ref, cgroup, Stopping.at(min(sent_at, now)), restored=True)


def advance(
    stop: Stop, seen: Seen, now: float, limits: Limits
) -> tuple[Stop | None, tuple[Command, ...]]:
    """One look at a stop: settled (said, and None: forgotten), escalated on time and on
    memory (SIGKILL through its manager, then its cgroup's kill), given up (said; it
    rests, then escalates again from SIGKILL), or waiting."""
    if stop.kind == Kind.BLOCK:
        return advance_block(stop, seen, now, limits)
    key = str(stop.ref)
    if seen.error and not seen.busy:
        # Its engine did not stop it (or none is known): killed from the kernel's side,
        # said, and forgotten (a new decision stops it again).
        if not stop.cgroup:
            how = "no cgroup known"
            return None, (Say(Kill(stop.ref, "", seen.error, failed=True).event(how)),)
        return None, (Kill(stop.ref, stop.cgroup, seen.error, failed=True),)
    stop, state = _state(stop, seen, now)
    stop = replace(stop, waiting=state == "unknown")
    if stop.waiting:
        return stop, ()
    if state == "settled":
        return None, (Say(_stopped(stop, now, " (not masked or disabled)")),)
    if not stop.stopping.due(now):
        return stop, ()
    stop, what, why = _escalated(stop, seen, now, limits)
    if what is None:
        return stop, ()
    if what == Escalation.GIVE_UP:
        said = Event.of(
            EventKind.UNIT_STOP_FAILED,
            "error",
            unit=key,
            manager=stop.ref.manager,
            error=why,
            msg=f"cannot stop {key}: {why}",
        )
        return stop, (Say(said),)
    through = what == Escalation.KILL_UNIT and stop.kind == Kind.UNIT and seen.manager
    return stop, (Kill(stop.ref, stop.cgroup, why, unit=through),)


def advance_block(
    stop: Stop, seen: Seen, now: float, limits: Limits
) -> tuple[Stop, tuple[Command, ...]]:
    """A block's stop: settled on its manager's word and nothing left in its cgroup, or
    escalated on time and on memory. A new run is as much its to stop as the first: the
    block stands until its mask is verified."""
    answered = seen.manager and seen.answered
    if answered and settled(seen.active_state, seen.load_state, len(seen.left)):
        if stop.quiet:
            return stop, (Settled(None),)
        said = Say(_stopped(stop, now))
        settled_now = replace(stop, stopping=stop.stopping.settled())
        return settled_now, (Settled(now - stop.stopping.sent), said)
    stop, what, why = _escalated(stop, seen, now, limits)
    if what is None:
        return stop, ()
    if what == Escalation.GIVE_UP:
        return stop, (GiveUp(why),)
    return stop, (Kill(stop.ref, stop.cgroup, why, unit=what == Escalation.KILL_UNIT),)


def _stopped(stop: Stop, now: float, how: str = "") -> Event:
    """What is said of a stop found settled: after how long since it went out."""
    key, waited = str(stop.ref), now - stop.stopping.sent
    return Event.of(
        EventKind.UNIT_STOPPED,
        "info",
        unit=key,
        manager=stop.ref.manager,
        seconds=round(waited, 3),
        msg=f"{key} stopped after {waited:.2f}s{how}",
    )


def _escalated(
    stop: Stop, seen: Seen, now: float, limits: Limits
) -> tuple[Stop, Escalation | None, str]:
    """core.block.escalate() on the stop's clock: (the stop moved on, what to do, why)."""
    after, what, why = escalate(
        stop.stopping, now, seen.memory, limits.stop_timeout, limits.kill_timeout
    )
    return replace(stop, stopping=after), what, why


def _state(stop: Stop, seen: Seen, now: float) -> tuple[Stop, str]:
    """(the stop, seen deactivating noted; "settled", "running", or "unknown": a stop an
    earlier guard sent whose manager cannot say now whether the processes there are that
    run's or a new one's)."""
    left = "running" if stop.cgroup and seen.left else ""
    if stop.kind == Kind.ENGINE:
        # Under way in its engine, or stopped by it (or failed, with nothing left to kill).
        return stop, "running" if seen.busy else left or "settled"
    if not seen.manager:
        # This guard's own stop, its manager gone since: no new run can start meanwhile.
        return stop, "unknown" if stop.restored else left or "settled"
    if not seen.answered:
        return stop, "unknown" if stop.restored else "running"  # this guard's deadlines run
    if settled(seen.active_state, seen.load_state, 0):
        # Stopped by its manager's word; what is left in its cgroup (KillMode=process,
        # SendSIGKILL=no) still holds the memory, and no new run is ever inactive.
        return stop, left or "settled"
    if seen.active_state == "deactivating":
        return replace(stop, seen_stopping=True), "running"
    if stop.went_to and not stop.went_to & seen.left:
        # None of the processes the stop went to is there: what runs is a new run
        # (StopUnit is answered before its job runs; a fast Restart= may read active at
        # every look): a new decision's to judge, not this stop's.
        return stop, "settled"
    # Another state after the stop was seen running, or (an earlier guard's) some time
    # after it went out, is a new run. This guard's stop not yet seen running may wait
    # behind another job.
    if stop.seen_stopping or (stop.restored and now - stop.stopping.sent >= LOOSE_GRACE):
        return stop, "settled"
    return stop, "running"
