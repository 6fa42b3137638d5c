"""The RoomKeeper: what clean page cache is worth while room is being made (F13).

The worker's write really hangs here: `memory.reclaim` is a FIFO, whose open blocks in
the kernel until someone reads it (as a reclaim stuck behind a locked page blocks on a
real host). Time is what the keeper is told (`now`), beside the worker's own clock.
"""

from __future__ import annotations

import os
import threading
import time

from structlog.testing import capture_logs

from spark_guard import log
from spark_guard.core.config import Config
from spark_guard.core.room import ROOM_DEADLINE
from spark_guard.core.snapshot import Decision, Memory, MemoryRule, Phase
from spark_guard.roomkeeper import RoomKeeper
from spark_guard.system.procfs import ProcFS
from spark_guard.system.reclaim import RoomMaker

GiB = 1024**3
# A GB10 under a page-cache flood: MemFree under the floor, 40 GiB of clean cache.
FLOOD = Memory(total=121 * GiB, available=60 * GiB, free=2 * GiB, file_clean=40 * GiB)
# The last decision: on unified memory, no loader in it (none loading).
DECIDED = Decision(Phase.STRICT, 8 * GiB, (), (), rule=MemoryRule(unified=True, make_room=True))


def kinds(events):
    return [(e["event"], e["log_level"]) for e in events]


def test_a_hung_reclaim_stops_the_cache_counting_as_room_until_it_answers(tmp_path):
    log.configure("console")
    cgroup, vm = tmp_path / "cgroup", tmp_path / "vm"
    cgroup.mkdir()
    vm.mkdir()
    os.mkfifo(cgroup / "memory.reclaim")  # an open for writing waits for a reader
    (vm / "compact_memory").write_bytes(b"")
    answered = threading.Event()
    maker = RoomMaker(ProcFS(), str(cgroup), str(vm), on_done=answered.set)
    changes: list[int] = []
    keeper = RoomKeeper(
        maker, Config(floor=8 * GiB), log.get_logger(), on_change=lambda: changes.append(1)
    )
    t0 = time.monotonic()
    assert keeper.view(t0).counts
    with capture_logs() as events:
        keeper.tick(FLOOD, DECIDED, (), t0)
    assert maker.busy and events == [] and changes == []  # handed over; no wait on it
    # Within the deadline the cache still counts: a reclaim of 40 GiB takes a moment.
    assert keeper.view(t0 + ROOM_DEADLINE / 2).counts
    # Past it, nothing is dropping the cache: it is no room, said once, whatever the passes.
    late = t0 + ROOM_DEADLINE + 1
    with capture_logs() as events:
        for i in range(5):
            keeper.tick(FLOOD, DECIDED, (), late + i)
    assert not keeper.view(late).counts
    assert kinds(events) == [("room-failed", "warning")]
    assert changes == [1]  # the loop is told to judge again now, once
    assert "has not answered" in events[0]["msg"]
    # It answers (the FIFO is read): said, and the cache counts again.
    fd = os.open(cgroup / "memory.reclaim", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert answered.wait(10)
        # What it was to write: two floors above MemFree, file pages only.
        assert os.read(fd, 100) == f"{14 * GiB} swappiness=0".encode()
    finally:
        os.close(fd)
    with capture_logs() as events:
        keeper.tick(None, DECIDED, (), late + 6)  # (no next plan: none hangs)
    assert kinds(events) == [("room-made", "info"), ("room-made", "info")]
    assert "answered after" in events[0]["msg"] and "made room for the GPU" in events[1]["msg"]
    assert keeper.view(late + 6).counts and not maker.busy and changes == [1, 1]
    keeper.close()
