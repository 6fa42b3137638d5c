"""A block's steps as a transcript: a fake manager in a dict, no systemd, no root.

Each event changes the fake manager (or the files) and calls the Blocker; the
transcript says which step changes that call makes (every change goes through
Record.move, which the test watches) and the step the record is left at. The
masks and records land under tmp_path: the manager is `user:<euid>` and its
runtime directory is tmp_path's.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from structlog.testing import capture_logs

from spark_guard import log
from spark_guard.block import files
from spark_guard.block.blocker import Blocker
from spark_guard.block.records import Record
from spark_guard.core import stops
from spark_guard.core.block import RETRY_AFTER, STEPS, TRANSITIONS, Step, StepError
from spark_guard.core.config import Config
from spark_guard.core.snapshot import Action, Decision, Loader, Phase, Reason, SeenUnit, UnitRef
from spark_guard.system.managers import FreezeLate, ManagerError
from spark_guard.system.safefs import own_tree
from spark_guard.system.unitfiles import NULL, Owner, mask_dir
from tests import manager_double
from tests.manager_double import Clock, FakeManager

UID = os.geteuid()
KEY = f"user:{UID}"
UNIT = "llama.service"
REF = UnitRef(KEY, UNIT)


@pytest.fixture
def rig(tmp_path, monkeypatch):
    if UID != 0:
        # Without root, unitfiles.owner() would walk to <user_runtime>/UID through root's
        # directories only, and tmp_path is ours: the masks are laid with our own rights.
        gid = os.getegid()
        monkeypatch.setattr(files, "owner", lambda *_: Owner(UID, gid, own_tree()))
    runtime = tmp_path / "run-user"
    (runtime / str(UID) / "systemd").mkdir(parents=True)
    wants = tmp_path / "home" / ".config" / "systemd" / "user" / "default.target.wants"
    wants.mkdir(parents=True)
    link = wants / UNIT
    link.symlink_to(tmp_path / "home" / ".config" / "systemd" / "user" / UNIT)
    config = Config(
        state=str(tmp_path / "state"),
        motd=str(tmp_path / "motd"),
        issue=str(tmp_path / "issue"),
        user_runtime=str(runtime),
        cgroup=str(tmp_path / "cgroup"),
        proc=str(tmp_path / "proc"),  # no /proc: no boot id, no MemAvailable
    )
    control = mask_dir(KEY, config.user_runtime)
    manager = FakeManager(KEY, control, {UNIT: [str(link)]})
    manager.start(UNIT)
    clock = Clock()
    log.configure("console")
    # FakeManager is duck-typed: it has what the Blocker asks of a Manager, no more.
    managers = {KEY: manager}
    blocker = Blocker(managers, config, log.get_logger(), clock=clock, sleep=clock.sleep)
    moves: list[tuple[Step, Step]] = []
    move = Record.move

    def watched(record: Record, to: Step) -> None:
        was = record.step
        move(record, to)
        moves.append((was, to))

    monkeypatch.setattr(Record, "move", watched)
    return blocker, manager, clock, moves, os.path.join(control, UNIT), str(link)


def stop_decision() -> tuple[list[Action], Decision]:
    return manager_double.stop_decision(REF)


S = Step


def test_a_block_and_its_three_rewinds_go_through_the_table(rig):
    blocker, manager, clock, moves, mask, link = rig

    def block() -> None:
        blocker.block(*stop_decision())

    def unmask() -> None:  # by hand (systemctl unmask reloads), or a reboot/manager restart
        os.unlink(mask)
        manager.reload()

    def unmask_and_start() -> None:
        unmask()
        manager.start(UNIT)

    def sneak_in() -> None:
        manager.start(UNIT)

    def stop_timeout_passes() -> None:
        clock.t += blocker.config.stop_timeout
        blocker.advance()

    # (event, what happens, the step changes it makes, the step it leaves)
    transcript: list[tuple[str, Callable[[], None], list[tuple[Step, Step]], Step]] = [
        (
            "decision: stop it",
            block,
            [(S.STOP, S.PLAN), (S.PLAN, S.DISABLE), (S.DISABLE, S.MASK), (S.MASK, S.SETTLE)],
            S.SETTLE,
        ),
        ("still stopping", blocker.advance, [], S.SETTLE),
        ("it stopped", lambda: manager.stopped(UNIT), [], S.SETTLE),
        ("next pass", blocker.advance, [(S.SETTLE, S.VERIFY), (S.VERIFY, S.BLOCKED)], S.BLOCKED),
        ("nothing new", blocker.advance, [], S.BLOCKED),
        # Rewind 1: the mask vanished (reboot or manager restart): block-renewed.
        ("mask gone", unmask, [], S.BLOCKED),
        (
            "next pass",
            blocker.advance,
            [(S.BLOCKED, S.MASK), (S.MASK, S.SETTLE), (S.SETTLE, S.VERIFY), (S.VERIFY, S.BLOCKED)],
            S.BLOCKED,
        ),
        # Rewind 2: started again while blocked, its mask still there.
        ("started again", lambda: manager.start(UNIT), [], S.BLOCKED),
        ("decision: stop it", block, [(S.BLOCKED, S.SETTLE)], S.SETTLE),
        ("it stopped", lambda: manager.stopped(UNIT), [], S.SETTLE),
        ("next pass", blocker.advance, [(S.SETTLE, S.VERIFY), (S.VERIFY, S.BLOCKED)], S.BLOCKED),
        # Rewind 2, unmasked by hand: the mask goes back first.
        ("unmasked and started", unmask_and_start, [], S.BLOCKED),
        ("decision: stop it", block, [(S.BLOCKED, S.MASK), (S.MASK, S.SETTLE)], S.SETTLE),
        # Rewind 3: verify finds it running again: a start got in before the mask loaded.
        ("it stopped", lambda: manager.stopped(UNIT), [], S.SETTLE),
        ("a start sneaks in", lambda: setattr(manager, "on_reload", sneak_in), [], S.SETTLE),
        ("next pass", blocker.advance, [(S.SETTLE, S.VERIFY), (S.VERIFY, S.SETTLE)], S.SETTLE),
        ("stop_timeout passes: KillUnit", stop_timeout_passes, [], S.SETTLE),
        ("next pass", blocker.advance, [(S.SETTLE, S.VERIFY), (S.VERIFY, S.BLOCKED)], S.BLOCKED),
    ]
    seen = []
    with capture_logs() as events:
        for event, happen, _moves, _step in transcript:
            moves.clear()
            happen()
            record = blocker.records[str(REF)]
            seen.append((event, list(moves), record.step))
    assert seen == [(event, m, step) for event, _, m, step in transcript]

    record = blocker.records[str(REF)]
    assert isinstance(record.step, Step) and record.problem == ""
    assert os.readlink(mask) == NULL and not os.path.lexists(link)
    assert [lr.removed for lr in record.links] == [True]
    assert manager.calls.count(f"stop {UNIT}") == 3 and f"kill {UNIT} 9" in manager.calls
    kinds = [e["event"] for e in events]
    assert kinds.count("unit-blocked") == 4 and kinds.count("block-renewed") == 1
    assert [e["error"] for e in events if e["event"] == "block-failed"] == [
        f"verify: {REF} is active again"
    ]
    # On disk as ever: the plain string, read back as a Step.
    with open(blocker.store.path_of(REF)) as f:
        assert json.load(f)["step"] == "blocked"
    assert blocker.store.load(REF) == record


def test_a_step_change_the_table_does_not_allow_is_refused(rig):
    blocker, manager, *_ = rig
    blocker.block(*stop_decision())
    manager.stopped(UNIT)
    blocker.advance()
    record = blocker.records[str(REF)]
    assert record.step == S.BLOCKED
    with pytest.raises(StepError, match=rf"^{REF}: no step change from blocked to plan$"):
        record.move(S.PLAN)
    assert record.step == S.BLOCKED
    # In the Blocker: a block-failed problem, the record left where it was, the guard going on.
    with capture_logs() as events:
        assert not blocker.ledger.move(record, S.STOP)
    assert record.step == S.BLOCKED
    assert record.problem == f"{REF}: no step change from blocked to stop"
    assert [e["event"] for e in events] == ["block-failed"]


def test_the_table_names_every_step_and_only_steps():
    # The order is the block's: the stop comes before anything is written, the block ends
    # verified. Every step has a way on, to steps only, and each is reached from the stop.
    assert tuple(Step) == STEPS
    assert STEPS[0] is Step.STOP and STEPS[-1] is Step.BLOCKED
    assert STEPS.index(Step.PLAN) < STEPS.index(Step.DISABLE) < STEPS.index(Step.MASK)
    assert set(TRANSITIONS) == set(Step)
    assert all(to and to <= set(Step) for to in TRANSITIONS.values())
    # Forward, each step leads to the next.
    assert all(b in TRANSITIONS[a] for a, b in itertools.pairwise(STEPS))
    reached, todo = {Step.STOP}, [Step.STOP]
    while todo:
        for step in TRANSITIONS[todo.pop()] - reached:
            reached.add(step)
            todo.append(step)
    assert reached == set(Step)


def test_an_old_record_still_loads_and_is_written_the_same():
    r = Record(unit=UNIT, manager=KEY, reason="footprint", detail="d", phase="strict")
    r.step = "verify"  # type: ignore[assignment]  # a str: as a record from before Step had it
    text = r.to_json()
    assert json.loads(text)["step"] == "verify"
    back = Record.from_json(text, "x.json")
    assert back.step is Step.VERIFY and back.to_json() == text


def test_a_manager_that_fails_a_stop_leaves_the_step_for_later(rig):
    blocker, manager, _clock, moves, _mask, _link = rig

    def refuse(*_: object) -> str:
        raise ManagerError("timed out")

    manager.stop_unit = refuse
    blocker.block(*stop_decision())
    record = blocker.records[str(REF)]
    assert record.step == S.STOP and moves == [] and record.problem == "stop: timed out"


def test_a_link_the_record_never_marked_removed_is_put_back_all_the_same(rig, monkeypatch):
    """A crash between DisableUnitFiles and saving removed=True: the record names the link
    but not as removed. Release puts back every recorded link that is absent now."""
    from spark_guard.block import release as release_mod

    blocker, manager, _, _, _, link = rig
    if UID != 0:
        gid = os.getegid()
        monkeypatch.setattr(release_mod, "owner", lambda *_, **__: Owner(UID, gid, own_tree()))
    target = os.readlink(link)
    blocker.block(*stop_decision())
    manager.stopped(UNIT)
    blocker.advance()
    store = blocker.store
    record = store.load(REF)
    assert record is not None and record.step == S.BLOCKED and not os.path.lexists(link)
    record.links[0].removed = False  # as the crash left it
    store.save(record)
    done = release_mod.release(record, store, "/nonexistent", blocker.config.user_runtime)
    assert done.restored == [link] and os.readlink(link) == target


def test_a_second_guard_planning_after_the_first_disabled_adopts_its_record(rig):
    """Two guards at once (rescue beside the daemon): the second plans after the first's
    disable, when the manager lists no link any more and the mask is already there. Its
    plan adopts the record on disk instead of saving over it with links=[] and
    mask_made=False, which would leave release nothing to put back and the mask behind."""
    first, manager, clock, _, mask, link = rig
    first.block(*stop_decision())
    manager.stopped(UNIT)
    first.advance()
    assert first.store.load(REF).step == S.BLOCKED and manager.unit_file_links(UNIT) == []
    second = Blocker({KEY: manager}, first.config, log.get_logger(), clock=clock)
    # Its own record, made before the first one's was on disk.
    record = Record(unit=UNIT, manager=KEY, reason="rescue", detail="d", phase="rescue")
    record.step = S.PLAN
    with second.store.lock():
        files.plan(record, manager, second.user_runtime, lambda: second.ledger.on_record(record))
        second.ledger.save(record)
    assert [(lr.path, lr.removed) for lr in record.links] == [(link, True)]
    assert record.mask_path == mask and record.mask_made
    saved = second.store.load(REF)
    assert saved is not None and [lr.removed for lr in saved.links] == [True]


def test_a_plan_reads_the_record_on_disk_only_after_the_managers_links(rig):
    """The race behind the test above: the second guard asks the manager for the links
    while the first plans, saves and disables. Read before that, the disk had no record
    and the manager then listed no link: the second would record none, and save that
    over the first's. Read after, the first's plan is there to adopt."""
    first, manager, clock, _, mask, link = rig

    class Meanwhile:
        """The manager as the second guard sees it: the first blocks the unit while the
        second's question is on its way."""

        def __getattr__(self, name: str) -> object:
            return getattr(manager, name)

        def unit_file_links(self, name: str) -> list[str]:
            first.block(*stop_decision())
            return manager.unit_file_links(name)

    managers: dict[str, Any] = {KEY: Meanwhile()}  # (duck-typed, as FakeManager is)
    second = Blocker(managers, first.config, log.get_logger(), clock=clock, sleep=clock.sleep)
    second.block(*stop_decision())
    record = second.records[str(REF)]
    assert [(lr.path, lr.removed) for lr in record.links] == [(link, True)]
    assert record.mask_path == mask and record.mask_made
    saved = second.store.load(REF)
    assert saved is not None and [(lr.path, lr.removed) for lr in saved.links] == [(link, True)]


def test_a_block_never_writes_over_a_record_it_cannot_read(rig):
    """The one copy an admin could repair a block's undo from is kept: set aside, named."""
    blocker, *_ = rig
    path = blocker.store.path_of(REF)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    broken = '{"format": 1, "unit": "llama.service", "links": [{"path": "/x"'  # cut short
    with open(path, "w") as f:
        f.write(broken)
    with capture_logs() as events:
        blocker.block(*stop_decision())
    aside = [n for n in os.listdir(os.path.dirname(path)) if ".unreadable-" in n]
    assert len(aside) == 1 and aside[0].startswith(os.path.basename(path))
    with open(os.path.join(os.path.dirname(path), aside[0])) as f:
        assert f.read() == broken
    said = [e for e in events if e["event"] == "record-unreadable" and "kept as" in e["msg"]]
    assert len(said) == 1
    record = blocker.store.load(REF)
    assert record is not None and record.reason == "footprint"


def stop_only_decision() -> tuple[list[Action], Decision]:
    """What the policy says of a server asked over its API from outside any unit."""
    action = Action("stop", REF, Reason.FOOTPRINT, "asked over its API", {}, how="stop-only")
    return [action], Decision(Phase.STEADY, 8, (), (action,))


def test_a_stop_only_stop_outlives_the_guard_rests_and_never_kills_a_new_run(rig):
    """A stop-only stop (no record, no mask) used to live in one guard's memory: a guard
    restarted before its SIGKILL never sent it (the policy drops a deactivating unit), a
    give-up forgot it, and a stop the brake froze was thawed by release_brakes(). Now it
    is kept on disk until it settles, taken over by the next guard of the same boot (not
    by a rescue), escalated again after a give-up's rest, never escalated while its
    manager cannot say which run is there, and the brake's freeze is the stop's."""
    blocker, manager, clock, _moves, mask, _link = rig
    proc = blocker.config.proc
    os.makedirs(f"{proc}/sys/kernel/random")
    with open(f"{proc}/sys/kernel/random/boot_id", "w") as f:
        f.write("b00t\n")

    def guard(managers: dict[str, FakeManager] | None = None) -> Blocker:
        """A guard (re)started: it adopts what an earlier one kept."""
        return Blocker(
            blocker.managers if managers is None else managers,
            blocker.config,
            blocker.log,
            clock=clock,
            sleep=clock.sleep,
            adopt_stops=True,
        )

    first = guard()
    assert first.brake([REF], "test") == [REF]
    first.block(*stop_only_decision())
    first.release_brakes()  # the decision took it: not thawed
    assert manager.calls == [f"freeze {UNIT}", f"stop {UNIT}"]
    assert first.busy and not os.path.lexists(mask)
    kept = os.listdir(os.path.join(blocker.config.state, "stopping"))
    assert kept == [f"{REF}.json"]
    # A stop job that waits behind another keeps the unit active: not a new run, for the
    # guard that sent it.
    manager.active[UNIT] = "active"
    clock.t += 2 * stops.LOOSE_GRACE
    first.advance()
    assert first.busy

    # The guard restarts before the stop timeout. Its manager has not answered yet: which
    # run is there cannot be told, so nothing is escalated, and it waits.
    manager.active[UNIT] = "deactivating"
    clock.t += blocker.config.stop_timeout
    with capture_logs() as events:
        blind = guard(managers={})
        blind.advance()
    # (F11) Nor does it keep the loop at poll.min with a full look each pass for the whole
    # boot: the periodic full look sees her manager come back.
    assert events == [] and not blind.busy and not blind.settling
    # A rescue meanwhile leaves the daemon's stops to the daemon.
    rescue = Blocker(blocker.managers, blocker.config, blocker.log, clock=clock)
    rescue.advance()
    assert not rescue.busy
    # With its manager: the stop is escalated on the first stop's clock.
    again = guard()
    with capture_logs() as events:
        again.advance()
    assert manager.calls[-1] == f"kill {UNIT} 9"
    assert [e["event"] for e in events] == ["unit-killed"]
    assert "did not stop within" in events[0]["error"]

    # SIGKILL does not end it (a process that does not return): the cgroup's kill, a
    # give-up, a rest, and SIGKILL again, never forgotten while it runs.
    manager.active[UNIT] = "deactivating"
    with capture_logs() as events:
        for _ in range(2):  # the cgroup's kill, then the give-up
            clock.t += blocker.config.kill_timeout + 0.1
            again.advance()
            manager.active[UNIT] = "deactivating"
        clock.t += RETRY_AFTER
        again.advance()
    said = [e["event"] for e in events]
    assert said == ["unit-killed", "unit-stop-failed", "unit-killed"], said
    assert manager.calls.count(f"kill {UNIT} 9") == 2
    assert again.busy

    # It went, and an admin starts it again: a new run, not the stop's to kill.
    manager.start(UNIT)
    clock.t += stops.LOOSE_GRACE + blocker.config.kill_timeout + 1
    with capture_logs() as events:
        again.advance()
    assert [e["event"] for e in events] == ["unit-stopped"]
    assert manager.calls.count(f"kill {UNIT} 9") == 2
    assert not again.busy
    assert os.listdir(os.path.join(blocker.config.state, "stopping")) == []


def test_a_blocks_stop_outlives_the_guard_on_its_clock_and_not_past_its_boot(rig):
    """A block's stop clock lived in one guard's memory: a guard restarted while the unit
    settled sent its stop again and waited a whole stop_timeout anew, the loader running
    on meanwhile. The clock is now in the record: the next guard of the same boot goes on
    from the first stop, and a stop of an earlier boot is no stop of this one."""
    blocker, manager, clock, _moves, _mask, _link = rig
    boot = os.path.join(blocker.config.proc, "sys/kernel/random/boot_id")
    os.makedirs(os.path.dirname(boot))
    with open(boot, "w") as f:
        f.write("b00t\n")

    def guard() -> Blocker:
        return Blocker(
            blocker.managers, blocker.config, blocker.log, clock=clock, sleep=clock.sleep
        )

    first = guard()
    first.block(*stop_decision())  # a stop that it does not answer: deactivating
    with open(os.path.join(blocker.config.state, "blocked", f"{REF}.json")) as f:
        record = json.load(f)
    assert record["step"] == "settle" and record["stopping_boot"] == "b00t"
    sent = record["stopping"]["sent"]

    # The guard dies; the next one comes a second before the first stop's timeout.
    clock.t = sent + blocker.config.stop_timeout - 1
    second = guard()
    second.advance()
    assert manager.calls.count(f"stop {UNIT}") == 1 and f"kill {UNIT} 9" not in manager.calls
    clock.t += 1.5
    with capture_logs() as events:
        second.advance()
    assert manager.calls[-1] == f"kill {UNIT} 9"  # on the first stop's clock
    assert [e["event"] for e in events] == ["unit-killed"]

    # A reboot with the unit deactivating again (a new run it did not stop): its stop goes
    # out again, on a clock of this boot.
    with open(boot, "w") as f:
        f.write("n3w\n")
    manager.active[UNIT] = "deactivating"
    third = guard()
    third.advance()
    assert manager.calls.count(f"stop {UNIT}") == 2


# --- the faults of issue 39's review that a stop must survive (each fails on 560a0ad) ---
PID, NEW_PID = 4242, 4343


def cgroup_files(blocker: Blocker, cgroup: str) -> str:
    """The directory the kernel would show for `cgroup`, under the rig's cgroup root."""
    path = os.path.join(blocker.config.cgroup, cgroup.lstrip("/"))
    os.makedirs(path, exist_ok=True)
    return path


def hold(path: str, *pids: int) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("".join(f"{p}\n" for p in pids))


def test_a_mask_gone_while_the_stop_settles_or_verifies_is_laid_again(rig):
    """F1: a reboot (a loader in D state: admins reboot) or her runtime dir removed at
    logout takes the mask while the block waits at settle or verify. Before, the mask was
    laid again only from `blocked`: the unit stayed disabled but not masked (a Wants=, a
    timer or a socket starts it), and verify reloaded its manager every 5 s for ever."""
    blocker, manager, clock, moves, mask, _link = rig
    blocker.block(*stop_decision())  # it takes its time to stop: deactivating
    assert blocker.records[str(REF)].step == S.SETTLE and os.path.lexists(mask)

    os.unlink(mask)  # at settle
    moves.clear()
    with capture_logs() as events:
        blocker.advance()
    assert moves == [(S.SETTLE, S.MASK), (S.MASK, S.SETTLE)]
    assert os.readlink(mask) == NULL
    assert [e["event"] for e in events] == ["block-renewed"]

    # At verify: the mask goes while its manager reloads (a start job got in, or the
    # runtime dir was cleaned): verify reads it not masked and waits for a retry.
    manager.stopped(UNIT)
    manager.on_reload = lambda: os.unlink(mask)
    blocker.advance()
    record = blocker.records[str(REF)]
    assert record.step == S.VERIFY and "LoadState is not masked" in record.problem
    reloads = manager.calls.count("reload")
    clock.t += RETRY_AFTER
    moves.clear()
    blocker.advance()
    assert moves == [(S.VERIFY, S.MASK), (S.MASK, S.SETTLE), (S.SETTLE, S.VERIFY),
                     (S.VERIFY, S.BLOCKED)]  # fmt: skip
    assert os.readlink(mask) == NULL and manager.load[UNIT] == "masked"
    assert manager.calls.count("reload") == reloads + 1
    clock.t += RETRY_AFTER
    blocker.advance()
    assert manager.calls.count("reload") == reloads + 1  # blocked: no reload every pass


def test_an_inactive_unit_with_its_server_left_in_its_cgroup_is_not_settled(rig):
    """F3: KillMode=process (a wrapper whose server is its child) or SendSIGKILL=no: the
    unit reads inactive while its server keeps its memory. Settled means stopped **and**
    nothing left in its cgroup: until then the stop is escalated on its clock."""
    blocker, manager, clock, _moves, _mask, _link = rig
    cgroup = manager.unit_control_group(UNIT)
    here = cgroup_files(blocker, cgroup)
    hold(here, PID)
    blocker.block(*stop_decision())
    manager.stopped(UNIT)  # the wrapper went; its server did not
    with capture_logs() as events:
        blocker.advance()
        assert blocker.records[str(REF)].step == S.SETTLE and blocker.settling
        clock.t += blocker.config.stop_timeout
        blocker.advance()
        assert manager.calls[-1] == f"kill {UNIT} 9"
        manager.stopped(UNIT)  # KillUnit of an inactive unit: its server is still there
        clock.t += blocker.config.kill_timeout
        blocker.advance()
        with open(os.path.join(here, "cgroup.kill")) as f:
            assert f.read() == "1"  # the kernel's kill of the whole cgroup
        assert blocker.records[str(REF)].step == S.SETTLE
        hold(here)  # gone
        blocker.advance()
    assert blocker.records[str(REF)].step == S.BLOCKED
    said = [e["event"] for e in events]
    assert said == ["unit-killed", "unit-killed", "unit-stopped", "unit-blocked"], said


def stop_only_with_its_cgroup(cgroup: str) -> tuple[list[Action], Decision]:
    seen = SeenUnit(REF, pids=(PID,), cgroup=cgroup)
    loader = Loader(seen, evidence=("llama-server",), models=(), expected=None)
    action = Action("stop", REF, Reason.FOOTPRINT, "asked over its API", {}, how="stop-only")
    return [action], Decision(Phase.STEADY, 8, (loader,), (action,))


def test_a_stop_only_stop_never_kills_a_run_it_did_not_stop(rig):
    """F8: StopUnit is answered before its job runs, and a fast Restart= reads `active` at
    every look: the run the stop went to is gone, and the one there now is a new run, a
    new decision's to judge. Before, it was SIGKILLed at the stop timeout."""
    blocker, manager, clock, _moves, _mask, _link = rig
    cgroup = manager.unit_control_group(UNIT)
    here = cgroup_files(blocker, cgroup)
    hold(here, PID)
    blocker.block(*stop_only_with_its_cgroup(cgroup))
    manager.active[UNIT] = "active"  # restarted before any look saw it deactivating
    hold(here, NEW_PID)
    clock.t += blocker.config.stop_timeout
    with capture_logs() as events:
        blocker.advance()
    assert f"kill {UNIT} 9" not in manager.calls
    assert [e["event"] for e in events] == ["unit-stopped"] and not blocker.busy

    # The same stop whose job waits behind another (its run still there): escalated.
    hold(here, PID)
    blocker.block(*stop_only_with_its_cgroup(cgroup))
    manager.active[UNIT] = "active"
    clock.t += blocker.config.stop_timeout
    with capture_logs() as events:
        blocker.advance()
    assert manager.calls[-1] == f"kill {UNIT} 9"
    assert [e["event"] for e in events] == ["unit-killed"]


def test_a_stop_whose_manager_is_gone_does_not_keep_the_loop_busy(rig):
    """F11: her manager went (logout) while her unit's block was under way: nothing can
    start the unit, and nothing is done until her manager is back. Before, the guard took
    a full look every pass, at poll.min, for the whole boot."""
    blocker, manager, clock, _moves, _mask, _link = rig
    blocker.block(*stop_decision())
    assert blocker.busy and blocker.settling
    later = Blocker({}, blocker.config, blocker.log, clock=clock, sleep=clock.sleep)
    later.advance()
    assert later.records[str(REF)].step == S.SETTLE
    assert not later.busy and not later.settling
    back = Blocker({REF.manager: manager}, blocker.config, blocker.log, clock=clock)
    back.advance()
    assert back.busy  # her manager answers: it goes on


def test_a_thaw_that_fails_is_tried_again_until_it_thaws(rig):
    """F2: the brake froze a loader the decision then spared; its manager, silent for a
    moment, fails the thaw. Before, it was never tried again: frozen for good."""
    blocker, manager, clock, _moves, _mask, _link = rig
    thawed = manager.thaw_unit
    fails = [ManagerError("Connection timed out")]

    def thaw(name: str) -> None:
        if fails:
            raise fails.pop()
        thawed(name)

    manager.thaw_unit = thaw
    assert blocker.brake([REF], "test") == [REF]
    with capture_logs() as events:
        blocker.release_brakes()
        assert blocker.braked and f"thaw {UNIT}" not in manager.calls
        blocker.release_brakes()  # too soon: not asked again at every pass
        clock.t += RETRY_AFTER
        blocker.release_brakes()
    assert manager.calls.count(f"thaw {UNIT}") == 1 and not blocker.braked
    assert [e["event"] for e in events] == ["thaw-failed", "brake-released"]


def test_a_freeze_outlives_the_guard_that_made_it_and_is_thawed_by_the_next(rig):
    """F5: the brake froze a loader and the guard was killed (or its pass raised) before
    the decision thawed it. Before, the freeze lived only in that guard's memory: the
    loader stayed frozen for good, its memory held. Now it is written down before the
    freeze, and the next guard of the same boot thaws it after its first decision."""
    blocker, manager, clock, _moves, _mask, _link = rig
    proc, state = blocker.config.proc, blocker.config.state
    os.makedirs(f"{proc}/sys/kernel/random")
    with open(f"{proc}/sys/kernel/random/boot_id", "w") as f:
        f.write("b00t\n")

    def guard() -> Blocker:
        config, log_ = blocker.config, blocker.log
        return Blocker(
            blocker.managers, config, log_, clock=clock, sleep=clock.sleep, adopt_stops=True
        )

    assert guard().brake([REF], "test") == [REF]  # ... and that guard is gone
    assert manager.calls == [f"freeze {UNIT}"]
    assert os.listdir(os.path.join(state, "braked")) == [f"{REF}.json"]
    # A rescue meanwhile does not take the daemon's freezes.
    assert not Blocker(blocker.managers, blocker.config, blocker.log, clock=clock).braked
    second = guard()
    assert second.braked
    with capture_logs() as events:
        second.release_brakes()  # its first decision spared it
    assert manager.calls == [f"freeze {UNIT}", f"thaw {UNIT}"]
    assert [e["event"] for e in events] == ["brake-released"]
    assert os.listdir(os.path.join(state, "braked")) == [] and not guard().braked

    # A freeze the next guard's decision stops is the stop's: not thawed.
    assert guard().brake([REF], "test") == [REF]
    third = guard()
    third.block(*stop_decision())
    third.release_brakes()
    # (one freeze: the brake's, taken by the stop; no thaw)
    assert manager.calls[2:] == [f"freeze {UNIT}", f"stop {UNIT}", f"disable {UNIT}"]
    assert os.listdir(os.path.join(state, "braked")) == []


def test_a_freeze_waits_for_its_manager_and_ends_where_nothing_is_frozen(rig):
    """A freeze is kept while its manager is out of view (a call timed out: the sensor
    drops it until it answers); before, it was forgotten there, the loader left frozen.
    A thaw the manager answers with "not active" (stopped by hand meanwhile) ends it,
    not retried for ever."""
    blocker, manager, _clock, _moves, _mask, _link = rig
    managers = blocker.managers
    assert isinstance(managers, dict)
    assert blocker.brake([REF], "test") == [REF]
    del managers[KEY]
    blocker.release_brakes()
    assert blocker.braked and os.listdir(os.path.join(blocker.config.state, "braked"))
    managers[KEY] = manager
    blocker.release_brakes()
    assert manager.calls == [f"freeze {UNIT}", f"thaw {UNIT}"] and not blocker.braked

    def inactive(name: str) -> None:
        raise ManagerError(f"Unit {name} is not active.")

    assert blocker.brake([REF], "test") == [REF]
    manager.thaw_unit = inactive
    with capture_logs() as events:
        blocker.release_brakes()
    assert not blocker.braked and [e["event"] for e in events] == ["brake-released"]
    assert os.listdir(os.path.join(blocker.config.state, "braked")) == []


def test_a_freeze_of_another_boot_is_forgotten_and_one_not_written_is_not_made(rig):
    """After a reboot no unit is frozen: an earlier boot's file is dropped, nothing is
    thawed. And a freeze that cannot be written down first (a full /var/lib) is not made:
    nothing could undo it if the guard died before its thaw."""
    blocker, manager, clock, _moves, _mask, _link = rig
    state = blocker.config.state
    os.makedirs(os.path.join(state, "braked"))
    with open(os.path.join(state, "braked", f"{REF}.json"), "w") as f:
        f.write(
            json.dumps(
                {
                    "format": 1,
                    "unit": UNIT,
                    "manager": KEY,
                    "cgroup": "",
                    "sent": 1.0,
                    "boot_id": "an-earlier-boot",
                }
            )
        )
    later = Blocker(blocker.managers, blocker.config, blocker.log, clock=clock, adopt_stops=True)
    later.release_brakes()
    assert not later.braked and manager.calls == []
    assert os.listdir(os.path.join(state, "braked")) == []

    os.rmdir(os.path.join(state, "braked"))
    with open(os.path.join(state, "braked"), "w"):
        pass  # a file where the directory goes: every write there fails
    with capture_logs() as events:
        assert later.brake([REF], "test") == []
    assert manager.calls == [] and not later.braked
    assert [(e["event"], e["log_level"]) for e in events] == [("brake-failed", "error")]
    assert "cannot record the freeze" in events[0]["error"]


def test_records_that_cannot_be_listed_are_kept_and_the_stop_still_goes_out(rig):
    """F14: listing blocked/ fails (EIO; here ENOTDIR, a file in its place). Before,
    block() raised: the stop waited 30 s, and the records were never read again. Now the
    stop goes out, nothing is changed on disk that is not on record, and once the store
    can be read and written the block completes."""
    blocker, manager, _clock, _moves, mask, link = rig
    blocked = os.path.dirname(blocker.store.path_of(REF))
    os.makedirs(os.path.dirname(blocked), exist_ok=True)
    with open(blocked, "w") as f:
        f.write("not a directory\n")
    with capture_logs() as events:
        blocker.block(*stop_decision())
    assert f"stop {UNIT}" in manager.calls
    assert f"disable {UNIT}" not in manager.calls and not os.path.lexists(mask)
    assert os.path.lexists(link)
    said = {e["event"] for e in events}
    assert {"record-unreadable", "unit-stop-requested", "block-failed"} <= said, said
    os.unlink(blocked)
    manager.stopped(UNIT)
    blocker.advance()
    record = blocker.store.load(REF)
    assert record is not None and record.step == S.BLOCKED
    assert os.readlink(mask) == NULL and not os.path.lexists(link)


def test_a_freeze_answered_late_is_kept_and_thawed_when_spared(rig):
    """F4: FreezeUnit is answered once the kernel has frozen the cgroup, and a loader in
    an uninterruptible wait (an NVIDIA ioctl) holds that back. The call now gives up
    after FREEZE_TIMEOUT (FreezeLate; the manager is not taken for silent), and the
    freeze, which may still land, is kept on record: the decision spares the loader,
    and it is thawed. Before, a freeze that timed out was forgotten, and landed later on
    a unit nothing would thaw."""
    blocker, manager, _clock, _moves, _mask, _link = rig

    def late(name: str) -> None:
        manager.calls.append(f"freeze {name}")
        raise FreezeLate(f"{KEY}: FreezeUnit: no answer within the deadline; it may still land")

    manager.freeze_unit = late
    with capture_logs() as events:
        assert blocker.brake([REF], "test") == [REF]
        assert os.listdir(os.path.join(blocker.config.state, "braked")) == [f"{REF}.json"]
        blocker.release_brakes()  # the decision spared it
    assert manager.calls == [f"freeze {UNIT}", f"thaw {UNIT}"] and not blocker.braked
    assert [e["event"] for e in events] == ["brake", "brake-released"]


def test_a_containers_stop_only_stop_with_no_engine_known_fails_and_says_so(rig):
    """A container asked over its API whose engine no one knows cannot be stopped: that is
    said at once, and never taken for a unit (no `unit-stopped` for what still runs, no
    KillUnit of a container's name through a manager)."""
    blocker, manager, clock, _moves, _mask, _link = rig
    box = UnitRef(f"user:{UID}", "container:llm") if UID else UnitRef("container", "llm")
    action = Action("stop", box, Reason.FOOTPRINT, "asked over its API", {}, how="stop-only")
    with capture_logs() as events:
        blocker.block([action], Decision(Phase.STEADY, 8, (), (action,)))
        clock.t += 0.1
        blocker.advance()
    said = [(e["event"], e.get("how")) for e in events]
    assert said == [("unit-stop-failed", "no cgroup known")], said
    assert not any(c.startswith("kill") for c in manager.calls) and not blocker.busy


def test_a_new_run_that_starts_while_its_manager_is_asked_is_not_killed(rig, monkeypatch):
    """F8, the executor's side: the run the stop went to exits and a new one starts while
    its manager's answer is on its way. The processes are read after that answer, so the
    new run is seen for what it is; read before it, the old run's processes made the
    stop look pending, and the new run was SIGKILLed at the stop timeout."""
    blocker, manager, clock, _moves, _mask, _link = rig
    cgroup = manager.unit_control_group(UNIT)
    here = cgroup_files(blocker, cgroup)
    hold(here, PID)
    blocker.block(*stop_only_with_its_cgroup(cgroup))
    asked = manager.unit_states

    def restarted_meanwhile(names: list[str]) -> dict[str, object]:
        hold(here, NEW_PID)
        manager.active[UNIT] = "active"
        return asked(names)

    monkeypatch.setattr(manager, "unit_states", restarted_meanwhile)
    clock.t += blocker.config.stop_timeout
    with capture_logs() as events:
        blocker.advance()
    assert f"kill {UNIT} 9" not in manager.calls
    assert [e["event"] for e in events] == ["unit-stopped"] and not blocker.busy
