"""The kill of last resort without cgroup.kill (before 5.14, or ProtectControlGroups=):
each listed PID is signalled through a pidfd, and only while it is still in the cgroup."""

from __future__ import annotations

import subprocess

from spark_guard.system import cgroupfs
from spark_guard.system.procfs import ProcFS


def test_the_fallback_kill_signals_only_processes_still_in_the_cgroup(tmp_path):
    ours = subprocess.Popen(["sleep", "60"])
    # A PID read from cgroup.procs that was recycled since: now someone else's process.
    recycled = subprocess.Popen(["sleep", "60"])
    try:
        unit = tmp_path / "cgroup" / "app.slice" / "llama.service"
        unit.mkdir(parents=True)
        (unit / "cgroup.kill").mkdir()  # no writable cgroup.kill here: the fallback runs
        (unit / "cgroup.procs").write_text(f"{ours.pid}\n{recycled.pid}\n")
        proc = tmp_path / "proc"
        for pid, where in ((ours.pid, "/app.slice/llama.service"), (recycled.pid, "/other")):
            (proc / str(pid)).mkdir(parents=True)
            (proc / str(pid) / "cgroup").write_text(f"0::{where}\n")
        cgroup_of = ProcFS(str(proc)).cgroup
        how = cgroupfs.kill(
            str(tmp_path / "cgroup"), "/app.slice/llama.service", cgroup_of=cgroup_of
        )
        assert how.startswith("SIGKILL to 1 process(es)")
        assert ours.wait(5) == -9
        assert recycled.poll() is None  # never signalled
    finally:
        for p in (ours, recycled):
            p.kill()
            p.wait()
