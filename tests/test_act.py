"""The actuator: what it logs and when it repeats itself, with plain decisions."""

from structlog.testing import capture_logs

from spark_guard import log
from spark_guard.act import Actuator
from spark_guard.block.blocker import Blocker
from spark_guard.block.records import RecordStore
from spark_guard.config import Config
from spark_guard.snapshot import Action, Decision, UnitRef

UNIT = UnitRef("system", "llama-ds4-0731.service")


def decision(since: float) -> Decision:
    a = Action("stop", UNIT, "footprint", "expects 115GiB", {"mem_available": 1}, since=since)
    return Decision("strict", 8, (), (a,))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def blocker(tmp_path) -> Blocker:
    config = Config(
        state=str(tmp_path / "state"),
        motd=str(tmp_path / "motd.d" / "spark-guard"),
        issue=str(tmp_path / "issue"),
    )
    return Blocker({}, config, log.get_logger())


def test_same_run_is_not_repeated_but_a_restart_is_acted_on_at_once(tmp_path):
    log.configure("console")
    clock = Clock()
    act = Actuator(blocker(tmp_path), log.get_logger(), dry_run=True, repeat_after=30, clock=clock)
    with capture_logs() as events:
        assert len(act.apply(decision(since=10.0))) == 1
        clock.t = 1.0
        assert act.apply(decision(since=10.0)) == []  # same run, within repeat_after
        clock.t = 2.0
        assert len(act.apply(decision(since=12.0))) == 1  # Restart= brought it back
        clock.t = 40.0
        assert len(act.apply(decision(since=12.0))) == 1  # still there after 30 s
    kinds = [e["event"] for e in events]
    assert kinds == ["decision", "dry-run"] * 3
    assert act.last == "stop llama-ds4-0731.service (footprint)"


def test_stop_without_a_connected_manager_is_reported_recorded_and_shown(tmp_path):
    log.configure("console")
    act = Actuator(blocker(tmp_path), log.get_logger(), dry_run=False, repeat_after=30)
    with capture_logs() as events:
        act.apply(decision(since=1.0))
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
