"""Under a pids limit no thread can start, and the guard's passes go on (fault F9).

`Thread.start()` raises under a pids limit (TasksMax=, a container's pids.max): before,
the container block's table kept a thread that never ran and raised at every later
pass ("cannot join thread before it is started"), and the NVML worker raised out of
the pass and, holding a thread that never ran, was never asked again. Here a real
process is put in a real pids cgroup limited to the threads it has, then let go.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import os, sys
from tests.fake_nvml import FakeNvmlLib, install_global
from spark_guard.block.containers import Pending
from spark_guard.system.gpu import GpuWatch

cg = sys.argv[1]
install_global(FakeNvmlLib([[(10, 1 << 30)]]))
with open(os.path.join(cg, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))

def limit(n):
    with open(os.path.join(cg, "pids.max"), "w") as f:
        f.write(str(n))

limit(len(os.listdir("/proc/self/task")))  # not one thread more
watch, pending = GpuWatch(deadline=5), Pending()
figures, news = watch.read(0.0)
assert figures == {} and not watch.on and news == [], (figures, news)
pending.start("box", lambda: None)
for _ in range(3):  # each pass: in flight for the loop to ask, an answer, never an exception
    assert "box" in pending
    finished, error = pending.done("box")
    assert finished and "cannot start a thread" in error, error
    pending.start("box", lambda: None)
limit("max")  # the limit is raised: the same objects work
figures, news = watch.read(1.0)
assert figures == {10: 1 << 30} and [n.kind for n in news] == ["gpu-accounting-on"], news
pending.start("box", lambda: None)
assert pending.done("box", wait=5) == (True, ""), pending.done("box")
watch.close()
print("passes went on")
"""


def _pids_parent() -> Path:
    """A pids hierarchy this test may make a cgroup in: v1's, or a v2 root with pids."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _dev, where, kind, options = line.split()[:4]
        if kind == "cgroup" and "pids" in options.split(","):
            return Path(where)
    v2 = Path("/sys/fs/cgroup")
    if "pids" in (v2 / "cgroup.subtree_control").read_text().split():
        return v2
    pytest.skip("no pids controller this test can use")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a pids cgroup")
def test_passes_go_on_when_no_thread_can_start():
    cgroup = _pids_parent() / f"spark-guard-test-pids-{os.getpid()}"
    cgroup.mkdir()
    try:
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(cgroup)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0 and "passes went on" in run.stdout, run.stderr[-3000:]
    finally:
        cgroup.rmdir()
