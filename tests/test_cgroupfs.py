"""The kill of last resort without cgroup.kill (before 5.14, or ProtectControlGroups=):
each listed PID is signalled through a pidfd, and only while it is still in the cgroup."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spark_guard.core.attribution import user_tree
from spark_guard.system import cgroupfs
from spark_guard.system.procfs import ProcFS

STORM = "while :; do sleep 60 & done"  # a shell that forks as fast as it can


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


def test_a_users_job_is_killed_alone_in_a_unit_of_roots(tmp_path):
    """kill_uid: her job in cron.service's cgroup dies; cron itself (root's), her process
    that left the cgroup meanwhile, and the one `spare` names are never signalled; and
    uid 0 is refused outright (root's processes are never a user's group)."""
    procs = {name: subprocess.Popen(["sleep", "60"]) for name in ("cron", "job", "gone", "kept")}
    try:
        unit = tmp_path / "cgroup" / "system.slice" / "cron.service"
        unit.mkdir(parents=True)
        (unit / "cgroup.procs").write_text("".join(f"{p.pid}\n" for p in procs.values()))
        proc = tmp_path / "proc"
        owners = {"cron": 0, "job": 1000, "gone": 1000, "kept": 1000}
        for name, p in procs.items():
            where = "/elsewhere" if name == "gone" else "/system.slice/cron.service"
            (proc / str(p.pid)).mkdir(parents=True)
            (proc / str(p.pid) / "cgroup").write_text(f"0::{where}\n")
            uid = owners[name]
            (proc / str(p.pid) / "status").write_text(f"Name:\tsleep\nUid:\t{uid}\t{uid}\t0\t0\n")
        fs = ProcFS(str(proc))
        kept = procs["kept"].pid
        count = cgroupfs.kill_uid(
            str(tmp_path / "cgroup"),
            "/system.slice/cron.service",
            1000,
            uid_of=fs.uid,
            cgroup_of=fs.cgroup,
            spare=lambda pids: {kept} & set(pids),
        )
        assert count == 1
        assert procs["job"].wait(5) == -9
        assert [procs[n].poll() for n in ("cron", "gone", "kept")] == [None, None, None]
        with pytest.raises(OSError, match="refusing"):
            cgroupfs.kill_uid(
                str(tmp_path / "cgroup"),
                "/system.slice/cron.service",
                0,
                uid_of=fs.uid,
                cgroup_of=fs.cgroup,
            )
        assert procs["cron"].poll() is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_manager_stopped_or_frozen_is_seen_paused_without_a_call():
    """A user's manager that she stopped (SIGSTOP) or froze (the cgroup freezer, on her own
    delegated cgroup) would hold the guard for the bus timeout on the next call, the GIL
    held; the kernel's word in /proc says so first (cgroupfs.paused)."""
    import os
    import signal
    import time
    from pathlib import Path

    import pytest

    from lab.harness import CGROUP_ROOTS
    from spark_guard.system.cgroupfs import paused

    child = subprocess.Popen(["sleep", "60"])
    cgroup = Path(CGROUP_ROOTS[0]) / f"sg-paused-{os.getpid()}"
    try:
        assert paused("/proc", child.pid) == ""
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.1)
        assert paused("/proc", child.pid) == "stopped (SIGSTOP)"
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.1)
        assert paused("/proc", child.pid) == ""
        if os.geteuid() != 0 or not Path(CGROUP_ROOTS[0], "cgroup.procs").exists():
            pytest.skip("no cgroup v2 hierarchy of ours to freeze in")
        cgroup.mkdir()
        (cgroup / "cgroup.procs").write_text(str(child.pid))
        (cgroup / "cgroup.freeze").write_text("1")
        deadline = time.monotonic() + 5
        while "frozen 1" not in (cgroup / "cgroup.events").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert paused("/proc", child.pid) == "frozen (cgroup freezer)"
        (cgroup / "cgroup.freeze").write_text("0")
        time.sleep(0.1)
        assert paused("/proc", child.pid) == ""
    finally:
        child.kill()
        child.wait()
        if cgroup.exists():
            (cgroup / "cgroup.freeze").write_text("0")
            time.sleep(0.05)
            cgroup.rmdir()


@contextlib.contextmanager
def her_tree(uid: int, leaf: str) -> Iterator[tuple[str, str, Path]]:
    """A cgroup of hers below user@UID.service, in our own slice: (the hierarchy's root,
    the cgroup, its directory). Whatever is left in it is killed, then it is removed."""
    from lab.harness import CGROUP_ROOTS, poll

    root = CGROUP_ROOTS[0]
    if os.geteuid() != 0 or not Path(root, "cgroup.procs").exists():
        pytest.skip("no cgroup v2 hierarchy of ours to kill in")
    tree = f"/sg-kill-{os.getpid()}.slice/user@{uid}.service/{leaf}"
    path = Path(root + tree)
    path.mkdir(parents=True)
    try:
        yield root, tree, path
    finally:

        def emptied() -> bool:
            for pid in cgroupfs.pids(root, tree):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return not cgroupfs.pids(root, tree)

        poll(emptied, 30, step=0.05)
        for d in (path, path.parent, path.parent.parent):
            d.rmdir()


def started_in(path: Path, *argv: str) -> subprocess.Popen[bytes]:
    """`argv` started in the cgroup at `path` (it moves itself there, then execs)."""
    return subprocess.Popen(["sh", "-c", f'echo $$ > {path}/cgroup.procs; exec "$@"', "sh", *argv])


def test_her_fork_storm_and_her_subuids_leave_nothing_of_hers_in_her_tree():
    """In her delegated subtree (any_user) every process but root's is hers, her user
    namespace's subuids too; a loop that forks as fast as it can is listed and killed
    until none is left, not for a fixed number of rounds. Root's process there lives."""
    from lab.harness import poll

    drop = ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups"]
    sub = ["setpriv", "--reuid=104242", "--regid=104242", "--clear-groups"]
    with her_tree(4242, "hideout") as (root, tree, path):
        procs = [
            started_in(path, *argv)
            for argv in (
                [*drop, "sh", "-c", STORM],
                [*sub, "sleep", "60"],
                ["sleep", "60"],  # root's
            )
        ]
        try:
            poll(lambda: len(cgroupfs.pids(root, tree)) >= 50, 5, step=0.02)
            listed = cgroupfs.pids(root, tree)
            assert len(listed) >= 50  # a storm under way
            fs = ProcFS()
            tree_of = user_tree(tree)
            assert tree_of is not None and tree_of[1] == 4242
            count = cgroupfs.kill_uid(
                root, tree, 4242, uid_of=fs.uid, cgroup_of=fs.cgroup, any_user=True
            )
            assert count >= len(listed) - 1  # all of them but root's, and the forks since
            poll(lambda: cgroupfs.pids(root, tree) == [procs[2].pid], 5, step=0.02)
            left = cgroupfs.pids(root, tree)
            assert left == [procs[2].pid], [(p, fs.uid(p)) for p in left]
            assert procs[1].wait(5) == -9
        finally:
            for p in procs:
                p.kill()
                p.wait()


def test_a_fork_storms_parent_is_killed_first_not_at_random_among_its_children():
    """A kill's budget covers a few hundred processes on a loaded host; a storm has
    thousands. Picked at random, its parent outlived every budget (a rescue ended with
    17,800 left); killed oldest first, as the kernel lists them, it goes first. A kill
    whose budget is spent before it starts signals one process: the storm's parent."""
    from lab.harness import poll

    hers = ["setpriv", "--reuid=4243", "--regid=4243", "--clear-groups", "sh", "-c"]
    with her_tree(4243, "storm") as (root, tree, path):
        storm = started_in(path, *hers, STORM)
        try:
            poll(lambda: len(cgroupfs.pids(root, tree)) >= 1000, 20, step=0.05)
            assert len(cgroupfs.pids(root, tree)) >= 1000  # a storm under way
            fs = ProcFS()
            count = cgroupfs.kill_uid(
                root,
                tree,
                4243,
                uid_of=fs.uid,
                cgroup_of=fs.cgroup,
                any_user=True,
                until=time.monotonic(),
            )
            assert count == 1
            assert storm.wait(5) == -signal.SIGKILL
        finally:
            if storm.poll() is None:
                storm.kill()
                storm.wait()


def test_a_deep_or_wide_tree_of_hers_is_walked_within_bounds(tmp_path):
    """She makes cgroups in her delegated subtree: 1,000 levels deep made os.walk raise
    RecursionError (Python 3.11), which escaped the kill and aborted the pass; now the
    walk is a loop, bounded in depth and in cgroups, and finds what is within them. (The
    real 1,000 levels, as her uid: test_hostile_user's `deep`.)"""
    root = tmp_path / "cgroup"
    deep = root / "hideout"
    (deep / "a").mkdir(parents=True)
    (deep / "cgroup.procs").write_text("4242\n")
    (deep / "a" / "cgroup.procs").write_text("4243\n")
    (deep / "a" / ("a/" * 200)).mkdir(parents=True)  # far below WALK_DEPTH
    (deep / "a" / ("a/" * 200) / "cgroup.procs").write_text("9999\n")  # not reached
    assert cgroupfs.pids(str(root), "/hideout") == [4242, 4243]
    wide = root / "wide"
    for i in range(cgroupfs.WALK_CGROUPS + 100):
        (wide / f"c{i}").mkdir(parents=True)
    assert len(cgroupfs._walk(str(wide))) == cgroupfs.WALK_CGROUPS


def test_a_process_that_does_not_die_is_signalled_once_and_not_waited_on(tmp_path):
    """A process in uninterruptible sleep (what an Xid 79 leaves) stays listed after
    SIGKILL. kill_uid counted it alive and listed again until its budget was spent, on
    every pass for ever. Here killed children that are not reaped stay listed, as such a
    process would: a call signals each once and stops listing when nothing new shows; the
    next call, told what the first signalled, signals nothing; a PID that now names a new
    process (another start) is new. A process the bounded walk does not reach (`also`,
    from the snapshot) is killed too."""
    stuck = subprocess.Popen(["sleep", "60"])
    deep = subprocess.Popen(["sleep", "60"])
    try:
        unit = tmp_path / "cgroup" / "user.slice" / "hers.scope"
        unit.mkdir(parents=True)
        (unit / "cgroup.procs").write_text(f"{stuck.pid}\n")  # a static file: stays listed
        proc = tmp_path / "proc"
        for p, where in ((stuck, "/user.slice/hers.scope"), (deep, "/user.slice/hers.scope/a")):
            (proc / str(p.pid)).mkdir(parents=True)
            (proc / str(p.pid) / "cgroup").write_text(f"0::{where}\n")
            (proc / str(p.pid) / "status").write_text("Name:\tsleep\nUid:\t1000\t1000\t0\t0\n")
        fs = ProcFS(str(proc))
        looked: list[int] = []

        def cgroup_of(pid: int) -> str | None:
            looked.append(pid)
            return fs.cgroup(pid)

        starts = {stuck.pid: 111, deep.pid: 222}
        signalled: dict[int, tuple[int | None, float]] = {}

        def kill() -> int:
            return cgroupfs.kill_uid(
                str(tmp_path / "cgroup"),
                "/user.slice/hers.scope",
                1000,
                uid_of=fs.uid,
                cgroup_of=cgroup_of,
                start_of=starts.get,
                also=[deep.pid],
                signalled=signalled,
                until=time.monotonic() + 60,  # a spin would last this long
            )

        assert kill() == 2
        # Each looked at once to be killed and once to be kept in the account: no spin.
        assert sorted(looked) == sorted([stuck.pid, deep.pid] * 2)
        assert {p: s for p, (s, _) in signalled.items()} == {stuck.pid: 111, deep.pid: 222}
        looked.clear()
        assert kill() == 0 and sorted(looked) == sorted([stuck.pid, deep.pid] * 2)
        starts[stuck.pid] = 444  # its PID now names a new process
        assert kill() == 1
        assert {p: s for p, (s, _) in signalled.items()} == {stuck.pid: 444, deep.pid: 222}
        assert stuck.wait(5) == -9 and deep.wait(5) == -9
        # Reaped: gone from the kernel's view, and from the account (`also` still names it).
        assert kill() == 0 and signalled == {}
    finally:
        for p in (stuck, deep):
            p.kill()
            p.wait()


def test_on_pure_cgroup_v1_a_kill_goes_through_the_named_systemd_hierarchy(tmp_path):
    """F15: on a pure cgroup v1 host the cgroups systemd names live in its `name=systemd`
    hierarchy; a kill looked for them under /sys/fs/cgroup itself and did nothing,
    silently. Where the root is found, on each layout; then a real process in a real
    cgroup of this host's named v1 hierarchy, killed through it."""
    for n, (layout, root) in enumerate(
        [
            (["systemd/cgroup.procs", "memory/cgroup.procs"], "systemd"),  # pure v1
            (["systemd/cgroup.procs", "unified/cgroup.controllers"], "unified"),  # hybrid
            (["cgroup.controllers", "cgroup.procs"], ""),  # pure v2
        ]
    ):
        base = tmp_path / f"layout-{n}"
        for name in layout:
            (base / name).parent.mkdir(parents=True, exist_ok=True)
            (base / name).touch()
        assert cgroupfs.v2_root(str(base)) == str(base / root).rstrip("/"), layout

    named = "/sys/fs/cgroup/systemd"
    if not os.path.exists(f"{named}/cgroup.procs"):
        pytest.skip("this host has no name=systemd cgroup v1 hierarchy")
    group = f"/spark-guard-test-{os.getpid()}"
    os.mkdir(named + group)
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        with open(f"{named}{group}/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        assert ProcFS().cgroup(sleeper.pid) == group
        assert cgroupfs.pids(named, group) == [sleeper.pid]
        how = cgroupfs.kill(named, group, cgroup_of=ProcFS().cgroup)
        assert how == f"SIGKILL to 1 process(es) listed in {named}{group}"  # no cgroup.kill
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
        os.rmdir(named + group)
