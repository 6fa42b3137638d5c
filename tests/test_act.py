"""act(): what a pass said is logged, what it stopped reaches the blocker and is recorded.

When an action is repeated is step()'s judgement: tests/test_step.py."""

from structlog.testing import capture_logs

from spark_guard import log
from spark_guard.act import act
from spark_guard.block.blocker import Blocker
from spark_guard.block.records import RecordStore
from spark_guard.core.config import Config
from spark_guard.core.snapshot import Action, Decision, Memory, Phase, Reason, Snapshot, UnitRef
from spark_guard.core.step import GuardState, Outcome, take

UNIT = UnitRef("system", "llama-ds4-0731.service")
SNAPSHOT = Snapshot(now=5.0, memory=Memory(16 * 2**30, 2**30))


def decision(since: float) -> Decision:
    a = Action("stop", UNIT, Reason.FOOTPRINT, "expects 115GiB", {"mem_available": 1}, since=since)
    return Decision(Phase.STRICT, 8, (), (a,))


def blocker(tmp_path) -> Blocker:
    config = Config(
        state=str(tmp_path / "state"),
        motd=str(tmp_path / "motd.d" / "spark-guard"),
        issue=str(tmp_path / "issue"),
    )
    return Blocker({}, config, log.get_logger())


def test_stop_without_a_connected_manager_is_reported_recorded_and_shown(tmp_path):
    log.configure("console")
    d = decision(since=1.0)
    state, said, taken, stops = take(GuardState(), d, 5.0, Config(), dry_run=False)
    assert stops == taken == d.actions and state.last_action.startswith("stop ")
    with capture_logs() as events:
        act(
            Outcome(state, SNAPSHOT, d, tuple(said), taken, stops),
            blocker(tmp_path),
            log.get_logger(),
        )
    assert [e["event"] for e in events][:1] == ["decision"]  # said before it is done
    failed = [e for e in events if e["event"] == "unit-stop-failed"]
    assert failed and failed[0]["error"] == "system manager is not connected"
    # Not lost: recorded as still to stop, with the problem, and said at login.
    (record,), errors = RecordStore(str(tmp_path / "state")).all()
    assert not errors
    assert (record.unit, record.step, record.reason) == (UNIT.name, "stop", "footprint")
    assert record.problem == "stop: system manager is not connected"
    motd = (tmp_path / "motd.d" / "spark-guard").read_text()
    assert "llama-ds4-0731.service  blocking (stop)" in motd
    assert "spark-guard release" in motd
