"""Making room on the real kernel: the guard drops clean page cache when MemFree is under
its device floor (issue 25), and says so in one event with the figures before and after.

The guard runs as a Type=notify unit of a harness user manager on this host. The host
has no GPU, so `[memory] unified = "yes"` says what NVML would say on a GB10, and the
floor is set just above this host's MemFree so that a file's page cache puts it under.
The host's cgroup2 tree has no memory controller (hybrid), so no memory.reclaim: the
guard falls back to drop_caches, which is what the record names. The VM test shows
memory.reclaim on a pure cgroup2 kernel.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest

from lab.guardunit import guard_manager, restart_guard, wait_log, write_config
from spark_guard.core.room import RoomPlan
from spark_guard.system.procfs import ProcFS
from spark_guard.system.reclaim import DROP_CACHES, RoomMaker

pytestmark = pytest.mark.systemd

MiB = 1024**2


def fill_cache(path, mib):
    """A file written and synced: its pages stay in the cache, clean."""
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def test_the_guard_reclaims_page_cache_under_the_floor_and_tells_the_figures(tmp_path):
    with guard_manager() as um:
        fill_cache(tmp_path / "model.bin", 600)
        memory = ProcFS().memory()
        assert memory.free is not None and memory.file_clean >= 500 * MiB
        floor = memory.free // MiB + 300  # MemFree is 300 MiB under it
        write_config(
            um,
            f'[memory]\nunified = "yes"\nfloor = "{floor}MiB"\nmake_room_every = "5s"\n'
            "[gpu]\nenabled = false\n[containers]\nenabled = false\n",
            grace="0s",
        )
        offset = restart_guard(um)
        line = wait_log(um, r"^info room-made: made room for the GPU: (.*)$", after=offset)
        said = line.group(1)
        assert f"reclaimed page cache ({DROP_CACHES})" in said, said
        assert "under the device floor" in said
        m = re.search(r"MemFree (\S+) -> (\S+), clean cache (\S+) -> (\S+)", said)
        assert m, said
        after = ProcFS().memory()
        # The file's pages were dropped: the clean cache fell by most of its 600 MiB.
        assert after.file_clean < memory.file_clean - 400 * MiB, (memory, after)
        status = um.systemctl("show", "-p", "StatusText", "spark-guard-test.service").stdout
        assert "MemFree" in status and "floor" in status, status


def test_where_nothing_can_be_written_it_says_why_once_and_no_room_counts(tmp_path):
    proc = ProcFS()
    maker = RoomMaker(proc, str(tmp_path / "cgroup"), str(tmp_path / "sys-vm"))
    memory = proc.memory()
    made = maker.carry_out(RoomPlan(256 * MiB, True, "test"), memory)
    assert made.method == "" and not made.compacted
    # Each way tried, each failure named with its file, and none is tried again.
    assert any("memory.reclaim" in e for e in made.errors), made.errors
    assert any("drop_caches" in e for e in made.errors)
    assert any("compact_memory" in e for e in made.errors)
    assert not maker.reclaim_possible(memory.swap_total)
    again = maker.carry_out(RoomPlan(256 * MiB, True, "test"), memory)
    assert again.errors == ()


def test_memory_reclaim_is_asked_for_file_pages_only_where_there_is_swap(tmp_path):
    # The kernel's file as a plain file: what the guard writes into it is the request.
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.reclaim").write_bytes(b"")
    proc = ProcFS()
    memory = proc.memory()
    maker = RoomMaker(proc, str(cgroup), str(tmp_path / "sys-vm"))
    made = maker.carry_out(RoomPlan(300 * MiB, False, "test"), replace(memory, swap_total=MiB))
    assert made.method == "memory.reclaim swappiness=0"
    assert (cgroup / "memory.reclaim").read_bytes() == f"{300 * MiB} swappiness=0".encode()
