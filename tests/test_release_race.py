"""A container's release while the guard's own threads work on it (faults F6, F7).

The engine is a fake dockerd API on a unix socket (tests/fault_matrix.FakeEngine), each
request served by a thread of its own and its stop held until the test lets it go;
the guard's Blocker, release and engine client are the project's own, unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from spark_guard import log
from spark_guard.block import release as release_mod
from spark_guard.block.blocker import Blocker
from spark_guard.block.boxes import CONTAINER_RECHECK
from spark_guard.block.records import RecordError, RecordStore
from spark_guard.core.block import Step
from spark_guard.core.config import Config
from spark_guard.system.engine import Engine
from tests.fault_matrix import BOX, BOX_ID, FakeEngine, container_decision
from tests.manager_double import Clock

RELEASE_UNDER_WAY = """
import sys
from spark_guard.block.records import RecordStore
from tests.fault_matrix import BOX
RecordStore(sys.argv[1]).mark_releasing(BOX)
print("marked", flush=True)
sys.stdin.readline()
"""


def _until(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def rig(tmp_path):
    config = Config(
        state=str(tmp_path / "state"),
        motd=str(tmp_path / "motd"),
        issue=str(tmp_path / "issue"),
        user_runtime=str(tmp_path / "run-user"),
        cgroup=str(tmp_path / "cgroup"),
        proc=str(tmp_path / "proc"),
    )
    box = FakeEngine(tmp_path / "docker.sock", threaded=True)
    clock = Clock()
    log.configure("console")
    blocker = Blocker({}, config, log.get_logger(), clock=clock, sleep=clock.sleep)
    return blocker, box, clock, RecordStore(config.state)


def _recorded(store: RecordStore) -> bool:
    try:
        record = store.load(BOX)
    except RecordError:
        return False
    return record is not None and record.container is not None


def test_a_release_while_the_block_stops_the_container_stands(rig):
    """F6: the admin releases the container while its block's stop is still out. Before,
    the block thread then set its policy to `no` and wrote the record back, after the
    release had said "put back". Now the release stands, and what the stop undid of it
    (the container ran) is put back."""
    blocker, box, _clock, store = rig
    assert box.stop_gate is not None
    blocker.block(*container_decision(), engines={BOX: box.path})
    assert _until(lambda: _recorded(store))  # its policy on record; the stop is out
    record = store.load(BOX)
    assert record is not None and record.step == Step.STOP
    done = release_mod.release(record, store, "/nonexistent", blocker.config.user_runtime)
    assert done.policy == "unless-stopped" and store.load(BOX) is None
    box.stop_gate.set()  # the engine's stop lands now
    assert blocker.pending.join(10.0)
    blocker.advance()
    assert box.state == ("unless-stopped", 0, True)
    assert store.load(BOX) is None and not blocker.busy


def test_a_recheck_never_reverses_a_release_under_way_however_long_it_takes(rig):
    """F7: a blocked container's policy is read back every 30 s and set to `no` again if
    it changed. Before, under a release older than 120 s by the wall clock (a slow
    engine, a clock stepped forward) the recheck set the policy the release had just put
    back to `no` again. A release's mark now holds for as long as the release runs."""
    blocker, box, clock, store = rig
    assert box.stop_gate is not None
    box.stop_gate.set()
    blocker.block(*container_decision(), engines={BOX: box.path})
    assert blocker.pending.join(10.0)
    blocker.advance()
    record = store.load(BOX)
    assert record is not None and record.step == Step.BLOCKED
    assert box.state == ("no", 0, False)

    # A release under way, in a process of its own.
    admin = subprocess.Popen(
        [sys.executable, "-c", RELEASE_UNDER_WAY, blocker.config.state],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert admin.stdout is not None and admin.stdout.readline() == "marked\n"
    mark = store.path_of(BOX) + ".releasing"
    os.utime(mark, (time.time() - 200, time.time() - 200))
    Engine(box.path).update_restart(BOX_ID, "unless-stopped")  # the release's work
    for _ in range(3):
        clock.t += CONTAINER_RECHECK
        blocker.advance()
        assert blocker.pending.join(10.0)
    assert box.state == ("unless-stopped", 0, False)
    second = RecordStore(blocker.config.state)
    with pytest.raises(RecordError, match="another release of it is under way"):
        second.mark_releasing(BOX)  # nor a second release
    second.clear_releasing(BOX)  # (which takes off no mark but its own)
    assert store.releasing(BOX)

    # The release dies (its process ends, its mark left on disk): guarded again.
    admin.communicate("", timeout=10)
    assert os.path.exists(mark)
    clock.t += CONTAINER_RECHECK
    blocker.advance()
    assert blocker.pending.join(10.0)
    blocker.advance()
    assert box.state == ("no", 0, False)
