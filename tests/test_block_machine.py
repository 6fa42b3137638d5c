"""The block machine (core.block) as transcripts, h11's way: plain values, no files, no
manager. Each transcript is what an admin would read in a stubborn loader's record: the
time of each look, the memory seen, and what the guard did at it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from spark_guard.core.block import (
    CASCADE,
    KILL_GRACE,
    RETRY_AFTER,
    Escalation,
    Stage,
    Step,
    StepError,
    Stopping,
    Verdict,
    Work,
    container_stuck,
    due,
    escalate,
    forward,
    mask_gone,
    moved,
    running_again,
    settled,
    verdict,
    verified,
    work_for,
)

GiB = 1 << 30
STOP_TIMEOUT = 10.0  # guard.stop_timeout
KILL_TIMEOUT = 5.0  # guard.kill_timeout
PLENTY = (40 * GiB, 8 * GiB)  # (the judged figure, the reserve)
SHORT = (6 * GiB, 8 * GiB)


def transcript(looks: Sequence[tuple[float, tuple[int, int] | None]]) -> list[tuple[float, str]]:
    """Run a stop sent at t=0 through one look per (time, memory); what each look did."""
    stopping = Stopping.at(0.0)
    said = []
    for now, memory in looks:
        if not stopping.due(now):
            said.append((now, "resting"))
            continue
        stopping, what, why = escalate(stopping, now, memory, STOP_TIMEOUT, KILL_TIMEOUT)
        said.append((now, f"{what}: {why}" if what else "waits"))
    return said


def test_a_loader_that_ignores_the_stop_is_killed_on_time_then_its_cgroup_then_retried():
    looks = [(1.0, PLENTY), (9.9, PLENTY), (10.0, PLENTY), (14.9, PLENTY), (15.0, PLENTY)]
    looks += [(19.9, PLENTY), (20.0, PLENTY), (24.9, PLENTY), (25.0, PLENTY)]
    assert transcript(looks) == [
        (1.0, "waits"),
        (9.9, "waits"),
        (10.0, "kill-unit: it did not stop within 10s"),
        (14.9, "waits"),
        (15.0, "kill-cgroup: still running 15.0s after the stop"),
        (19.9, "waits"),
        (20.0, "give-up: still running after stop, SIGKILL and cgroup kill"),
        (24.9, "resting"),  # RETRY_AFTER of rest, then the escalation begins again
        (25.0, "kill-unit: it did not stop within 10s"),
    ]
    assert RETRY_AFTER == 5.0


def test_below_the_reserve_the_waiting_is_skipped():
    looks = [(0.1, SHORT), (0.3, SHORT), (0.1 + KILL_GRACE, SHORT), (0.7, SHORT)]
    said = transcript(looks)
    assert said[0] == (
        0.1,
        "kill-unit: MemAvailable 6.0GiB below the reserve 8.0GiB 0.10s after the stop",
    )
    assert said[1] == (0.3, "waits")  # SIGKILL gets KILL_GRACE to work
    assert said[2][1].startswith("kill-cgroup: MemAvailable 6.0GiB below the reserve")
    assert said[3] == (0.7, "waits")


def test_memory_back_above_the_reserve_returns_to_the_timeouts():
    said = transcript([(0.1, SHORT), (3.0, PLENTY), (5.1, PLENTY)])
    assert [s for _, s in said][1:] == ["waits", "kill-cgroup: still running 5.1s after the stop"]


def test_without_a_figure_the_timeouts_alone_decide():
    assert transcript([(9.0, None), (10.0, None)])[-1] == (
        10.0,
        "kill-unit: it did not stop within 10s",
    )


def test_a_frozen_loader_that_ignores_sigterm_starts_at_the_kill():
    stopping = Stopping.at(0.0).killed(0.0)
    assert stopping.stage == Stage.KILLED
    after, what, _ = escalate(stopping, KILL_TIMEOUT, PLENTY, STOP_TIMEOUT, KILL_TIMEOUT)
    assert what == Escalation.KILL_CGROUP and after.stage == Stage.CGROUP_KILLED


def test_a_settled_stop_escalates_again_from_its_stop_if_it_runs_again():
    stopping = Stopping.at(0.0).killed(2.0).settled()
    assert (stopping.stage, stopping.since, stopping.hold_until) == (Stage.SENT, 0.0, 0.0)
    _, what, _ = escalate(stopping, 30.0, PLENTY, STOP_TIMEOUT, KILL_TIMEOUT)
    assert what == Escalation.KILL_UNIT


@pytest.mark.parametrize(
    ("step", "mask_present", "back"),
    [
        (Step.BLOCKED, True, Step.SETTLE),  # started before its mask was back
        (Step.BLOCKED, False, Step.MASK),  # unmasked by hand: the mask first
        (Step.VERIFY, True, Step.SETTLE),
        (Step.VERIFY, False, Step.MASK),
        (Step.PLAN, False, None),  # not that far yet: the block goes on as it is
        (Step.SETTLE, True, None),
    ],
)
def test_a_unit_running_again_rewinds_by_the_table(step, mask_present, back):
    assert running_again(step, mask_present) == back
    if back is not None:
        assert moved("u", step, back) == back


@pytest.mark.parametrize("step", list(Step))
def test_a_vanished_mask_is_laid_again_from_every_step_after_it(step):
    # (F1) From settle and verify too: a reboot while a loader in D state settles.
    after = step in (Step.SETTLE, Step.VERIFY, Step.BLOCKED)
    assert mask_gone(step, present=True) is None
    assert mask_gone(step, present=False) == (Step.MASK if after else None)
    if after:
        assert moved("u", step, Step.MASK) == Step.MASK


@pytest.mark.parametrize(
    ("active", "load", "left", "done"),
    [
        ("inactive", "loaded", 0, True),
        ("failed", "loaded", None, True),  # no cgroup known: its manager's word
        (None, None, 0, True),  # not listed any more
        ("inactive", "not-found", 0, True),
        ("inactive", "loaded", 1, False),  # F3: KillMode=process, its server left
        ("failed", "loaded", 3, False),
        ("deactivating", "loaded", 0, False),
        ("active", "masked", 0, False),
    ],
)
def test_settled_means_stopped_and_nothing_left(active, load, left, done):
    assert settled(active, load, left) is done


def test_units_and_containers_have_tables_of_their_own():
    with pytest.raises(StepError, match=r"^u: no step change from stop to blocked$"):
        moved("u", Step.STOP, Step.BLOCKED)
    assert moved("container:x", Step.STOP, Step.BLOCKED, container=True) == Step.BLOCKED
    with pytest.raises(StepError):
        moved("container:x", Step.STOP, Step.PLAN, container=True)
    assert moved("u", "verify", Step.BLOCKED) == Step.BLOCKED  # a record's str step reads too


def test_a_container_block_waits_on_its_engine_then_kills_from_the_kernel_side():
    stopping = Stopping.at(0.0)
    # The engine took the call: its stop is its to do, however long it takes, while
    # memory holds.
    assert container_stuck(stopping, 30.0, True, 10.0, PLENTY) == ""
    # Silent past its timeout (dockerd restarting containers before its API serves).
    assert container_stuck(stopping, 9.9, False, 10.0, PLENTY) == ""
    assert container_stuck(stopping, 10.0, False, 10.0, PLENTY) == (
        "its engine did not answer within 10.0s"
    )
    # Below the reserve, nothing waits, answered or not.
    assert container_stuck(stopping, 0.5, True, 10.0, SHORT) == (
        "MemAvailable 6.0GiB below the reserve 8.0GiB 0.50s after the stop"
    )
    assert container_stuck(stopping, 0.5, True, 10.0, None) == ""


def test_a_block_runs_up_to_its_mask_in_one_pass():
    # The executor's cascade, step by step: each work done moves the step, and the next
    # work follows at once until the stop is awaited (LOOK) or there is nothing to do.
    step, sent, done = Step.STOP, False, []
    work = work_for(step, sent)
    while work in CASCADE:
        done.append(work)
        if work == Work.STOP:
            sent = True
        step = moved(
            "u",
            step,
            {
                Work.STOP: Step.PLAN,
                Work.PLAN: Step.DISABLE,
                Work.DISABLE: Step.MASK,
                Work.MASK: Step.SETTLE,
            }[work],
        )
        work = work_for(step, sent)
    assert done == [Work.STOP, Work.PLAN, Work.DISABLE, Work.MASK]
    assert (step, work) == (Step.SETTLE, Work.LOOK)
    assert work_for(Step.VERIFY, True) == Work.VERIFY
    assert work_for(Step.BLOCKED, True) == Work.NONE
    # A record left at its stop by a guard that restarted: the stop goes out again.
    assert work_for(Step.STOP, False) == Work.STOP
    assert work_for(Step.STOP, True) == Work.NONE  # out, and awaited


@pytest.mark.parametrize(
    ("load", "active", "found"),
    [
        ("masked", "inactive", Verdict.BLOCKED),
        ("masked", "active", Verdict.BLOCKED),  # masked is what holds at the next start
        ("loaded", "activating", Verdict.RUNNING),  # started again before the mask took
        ("loaded", "inactive", Verdict.NOT_MASKED),  # a file outranks the mask
        (None, None, Verdict.NOT_MASKED),  # not listed at all
    ],
)
def test_verify_reads_the_state_back(load, active, found):
    assert verdict(load, active) == found
    # Where the verdict takes the block, by the table: blocked, back to its stop, or it
    # stays at verify (said, and tried again).
    to = verified(found)
    assert to == {Verdict.BLOCKED: Step.BLOCKED, Verdict.RUNNING: Step.SETTLE}.get(found)
    if to is not None:
        assert moved("u", Step.VERIFY, to) == to


def test_every_step_goes_forward_by_the_table_and_a_containers_in_one():
    # A unit's block: stop, plan, disable, mask, settle, verify, blocked, one at a time.
    walked = [Step.STOP]
    while walked[-1] != Step.BLOCKED:
        walked.append(moved("u", walked[-1], forward(walked[-1])))
    assert walked == list(Step)
    # A container's: its engine stops it and sets its policy in one go; found running
    # again once blocked, it goes back to its stop, and only then.
    box = "container:x"
    assert moved(box, Step.STOP, forward(Step.STOP, container=True), container=True) == (
        Step.BLOCKED
    )
    back = running_again(Step.BLOCKED, True, container=True)
    assert back is not None and moved(box, Step.BLOCKED, back, container=True) == Step.STOP
    assert running_again(Step.STOP, True, container=True) is None


def test_which_blocks_a_pass_works_on():
    resting = Stopping.at(0.0)
    resting = escalate(resting, 10.0, PLENTY, STOP_TIMEOUT, KILL_TIMEOUT)[0]
    resting = escalate(resting, 15.0, PLENTY, STOP_TIMEOUT, KILL_TIMEOUT)[0]
    resting = escalate(resting, 20.0, PLENTY, STOP_TIMEOUT, KILL_TIMEOUT)[0]  # gave up
    # Blocked: only a mask gone brings it back.
    assert not due(Step.BLOCKED, None, 0.0, 100.0, mask_gone=False)
    assert due(Step.BLOCKED, None, 0.0, 100.0, mask_gone=True)
    # A stop in progress: every pass, but not while it rests after a give-up.
    assert due(Step.SETTLE, Stopping.at(0.0), 50.0, 1.0, mask_gone=False)
    assert not due(Step.SETTLE, resting, 0.0, 24.0, mask_gone=False)
    assert due(Step.SETTLE, resting, 0.0, 25.0, mask_gone=False)
    # Anything else unfinished (a manager that refused the disable): when its retry is due.
    assert not due(Step.DISABLE, None, 5.0, 4.9, mask_gone=False)
    assert due(Step.DISABLE, None, 5.0, 5.0, mask_gone=False)
    # A settle this guard sent no stop for (resumed after a restart): on its retry.
    assert due(Step.SETTLE, None, 5.0, 5.0, mask_gone=False)
