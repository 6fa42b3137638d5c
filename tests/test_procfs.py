"""/proc readers against a fixture tree, as earlyoom tests feed a fake /proc."""

import os

import pytest

from spark_guard.core import attribution
from spark_guard.system.procfs import PAGE_SIZE, ProcError, ProcFS

MEMINFO = """MemTotal:       126976000 kB
MemFree:         1000000 kB
MemAvailable:    3500000 kB
Buffers:           10000 kB
"""
PSI = """some avg10=12.50 avg60=3.10 avg300=0.80 total=123456
full avg10=4.00 avg60=1.00 avg300=0.20 total=6543
"""
HYBRID = """12:name=systemd:/system.slice/llama-ds4-0731.service
4:memory:/system.slice/llama-ds4-0731.service
0::/
"""
UNIFIED = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/lmstudio-server.service\n"


def make_proc(root, pids=None):
    root.mkdir(exist_ok=True)
    (root / "meminfo").write_text(MEMINFO)
    (root / "pressure").mkdir()
    (root / "pressure" / "memory").write_text(PSI)
    for pid, files in (pids or {}).items():
        d = root / str(pid)
        d.mkdir()
        for name, text in files.items():
            (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return ProcFS(str(root))


def test_meminfo_and_pressure(tmp_path):
    p = make_proc(tmp_path / "proc")
    m = p.memory()
    assert (m.total, m.available) == (126976000 * 1024, 3500000 * 1024)
    psi = p.pressure()
    assert (psi.some_avg10, psi.full_avg10) == (12.5, 4.0)


def test_missing_meminfo_field_is_a_clear_error(tmp_path):
    p = make_proc(tmp_path / "proc")
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 1 kB\n")
    with pytest.raises(ProcError, match="meminfo: MemTotal or MemAvailable missing"):
        p.memory()


def test_no_psi_is_none(tmp_path):
    p = make_proc(tmp_path / "proc")
    os.remove(tmp_path / "proc" / "pressure" / "memory")
    assert p.pressure() is None


def test_process_cgroup_hybrid_and_unified(tmp_path):
    p = make_proc(
        tmp_path / "proc",
        {
            100: {"cgroup": HYBRID, "statm": "5000 2560 100 1 0 200 0\n"},
            200: {"cgroup": UNIFIED, "statm": "10 3 1 1 0 2 0\n"},
        },
    )
    assert sorted(p.pids()) == [100, 200]
    a = p.process(100)
    assert a.cgroup == "/system.slice/llama-ds4-0731.service"
    assert a.rss == 2560 * PAGE_SIZE
    assert p.process(200).cgroup.endswith("/app.slice/lmstudio-server.service")


def test_vanished_pid_reads_as_none(tmp_path):
    p = make_proc(tmp_path / "proc", {300: {"cgroup": UNIFIED}})  # no statm: gone mid-read
    assert p.process(300) is None
    assert p.process(999) is None
    assert p.cmdline(999) is None and p.mapped_models(999) is None


def test_cmdline_and_mapped_models(tmp_path):
    maps = (
        "7f0000000000-7f0100000000 r--s 00000000 103:02 1234 /srv/models/DeepSeek V4.gguf\n"
        "7f0100000000-7f0200000000 r--s 00000000 103:02 1235 /srv/models/DeepSeek V4.gguf\n"
        "7f0200000000-7f0200001000 r-xp 00000000 103:02 99 /usr/lib/libc.so.6\n"
        "7f0300000000-7f0300001000 rw-p 00000000 00:00 0\n"
    )
    p = make_proc(
        tmp_path / "proc",
        {4242: {"cmdline": b"/opt/llama-server\0-m\0/srv/models/DeepSeek V4.gguf\0", "maps": maps}},
    )
    assert p.cmdline(4242) == ("/opt/llama-server", "-m", "/srv/models/DeepSeek V4.gguf")
    assert p.mapped_models(4242) == ("/srv/models/DeepSeek V4.gguf",)


def test_mapped_models_are_one_path_per_file_and_bounded(tmp_path):
    """64,000 hard links of one file, mapped under long names: one path, not 64,000; and
    at most MAPS_MAX_MODELS distinct files, from the first MAPS_MAX_BYTES of maps."""
    from spark_guard.core.snapshot import MAPS_MAX_BYTES, MAPS_MAX_MODELS, PATH_MAX

    row = "7f{:010x}-7f{:010x} r--s 00000000 103:02 {} /home/m/{}{}.gguf\n"
    links = "".join(row.format(i, i + 1, 777, "x" * 3000, i) for i in range(64_000))
    many = "".join(row.format(i, i + 1, 1000 + i, "y", i) for i in range(100))
    deep = row.format(0, 1, 5, "z" * PATH_MAX, "")
    p = make_proc(
        tmp_path / "proc",
        {1: {"maps": links}, 2: {"maps": deep + many}, 3: {"maps": "x" * MAPS_MAX_BYTES + many}},
    )
    assert p.mapped_models(1) == (f"/home/m/{'x' * 3000}0.gguf",)
    assert p.mapped_models(2) == tuple(f"/home/m/y{i}.gguf" for i in range(MAPS_MAX_MODELS))
    assert p.mapped_models(3) == ()


def test_real_proc_self():
    p = ProcFS()
    assert p.memory().total > 0
    me = p.process(os.getpid())
    assert me is not None and me.rss > 0
    assert p.cmdline(os.getpid())


def test_cmdline_is_read_bounded(tmp_path):
    from spark_guard.core.snapshot import ARGV_MAX_ARGS, ARGV_MAX_BYTES

    huge = b"x" * (1 << 20)
    p = make_proc(
        tmp_path / "proc",
        {
            # llama-server, its model, then a 1 MiB argument: cut at the limit, so left out.
            1: {"cmdline": b"llama-server\0-m\0/m.gguf\0" + huge + b"\0"},
            # 5000 small arguments: the first ARGV_MAX_ARGS.
            2: {"cmdline": b"".join(b"a%d\0" % i for i in range(5000))},
            # An argument that ends right at the limit is kept whole.
            3: {"cmdline": b"a\0" + b"y" * (ARGV_MAX_BYTES - 3) + b"\0tail\0"},
            # One argument longer than the limit: nothing is left.
            4: {"cmdline": huge},
        },
    )
    assert p.cmdline(1) == ("llama-server", "-m", "/m.gguf")
    many = p.cmdline(2)
    assert len(many) == ARGV_MAX_ARGS and many[-1] == f"a{ARGV_MAX_ARGS - 1}"
    assert p.cmdline(3) == ("a", "y" * (ARGV_MAX_BYTES - 3))
    assert p.cmdline(4) == ()


def test_a_units_command_lines_are_held_within_the_argv_budget(tmp_path):
    """300 processes with 64 KiB command lines in one unit were each read and kept (145 MiB
    in the guard): a pass holds ARGV_UNIT_BUDGET per unit and ARGV_OWNER_BUDGET per user,
    the biggest processes first, so the loader among them is the one read."""
    from spark_guard import log
    from spark_guard.core.config import Config
    from spark_guard.core.snapshot import (
        ARGV_MAX_BYTES,
        ARGV_OWNER_BUDGET,
        ARGV_UNIT_BUDGET,
        UnitRef,
    )
    from spark_guard.sense import Sensor
    from spark_guard.sense.caches import PassBudget

    filler = b"sh\0-c\0sleep 1\0" + b"x" * (ARGV_MAX_BYTES - 100) + b"\0"
    loader = b"llama-server\0-m\0/srv/m.gguf\0"
    units = {i: list(range(1000 + 100 * i, 1020 + 100 * i)) for i in range(11)}  # 20 each
    pids = {p: {"cmdline": filler} for group in units.values() for p in group}
    pids[9999] = {"cmdline": loader}
    make_proc(tmp_path / "proc", pids)
    sensor = Sensor(Config(proc=str(tmp_path / "proc")), log.get_logger())
    budget = PassBudget()
    seen = []
    for i in range(10):
        procs: list[tuple[int, int, int | None]] = [(p, 1 << 20, 0) for p in units[i]]
        if i == 0:
            procs.append((9999, 5 << 30, 0))  # the loader, listed last
        ref = UnitRef("user:1000", f"argv-{i}.service")
        seen.append(sensor.units.seen(ref, procs, "active", {}, 1.0, "", budget))
    held = [sum(len(a) + 1 for c in s.cmdlines for a in c) for s in seen]
    assert ("llama-server", "-m", "/srv/m.gguf") in seen[0].cmdlines  # the biggest: read
    assert all(h <= ARGV_UNIT_BUDGET for h in held), held
    assert sum(held) <= ARGV_OWNER_BUDGET, held
    assert held[-1] == 0  # her share of the pass is spent: the rest is not read
    # Root's units have a budget of their own.
    procs = [(p, 1 << 20, 0) for p in units[10]]
    root = sensor.units.seen(UnitRef("system", "x.service"), procs, "active", {}, 1.0, "", budget)
    assert root.cmdlines


def test_a_cgroup_name_with_line_breaks_of_other_kinds_is_read_whole(tmp_path):
    """A user names her own cgroups: \x1c, \r or U+2028 in a name split it under
    str.splitlines(), and every pass raised. Only \n ends a line of /proc/PID/cgroup."""
    name = "/user.slice/user-1000.slice/user@1000.service/a\x1cb\rc\u2028d"
    make_proc(tmp_path / "proc", {7: {"cgroup": f"0::{name}\n"}})
    assert ProcFS(str(tmp_path / "proc")).cgroup(7) == name


def test_a_process_below_user_at_uid_is_hers_by_the_kernels_word():
    """With her manager out of view, a process below user@UID.service is user:UID's (not
    PID 1's protected user@UID.service): the outermost user@UID.service below slices,
    whatever its uid but root's (her subuids run there: rootless containers). A cgroup she
    names user@0.service inside her own subtree names nothing of root's."""
    mine = "/user.slice/user-1000.slice/user@1000.service/app.slice/llama.service"
    nested = (
        "/user.slice/user-1000.slice/user@1000.service/app.slice/x.slice/user@0.service/a.service"
    )
    uids = {1: 1000, 2: 1000, 3: 0, 4: 1000, 5: 101000}  # 3: root's process; 5: her subuid

    def owner(pid: int, cgroup: str) -> tuple[str, str, str] | None:
        found = attribution.out_of_view(cgroup, lambda: uids[pid])
        return None if found is None else (str(found.ref), found.cgroup, found.group)

    unit = "/user.slice/user-1000.slice/user@1000.service/app.slice/llama.service"
    assert owner(1, mine) == ("user:1000:llama.service", unit, "")
    # Her own cgroup named user@0.service is a unit of hers, in her manager, never root's.
    inner = nested.rsplit("/", 1)[0]
    assert owner(2, nested) == ("user:1000:user@0.service", inner, "")
    assert owner(3, mine) is None
    assert owner(5, mine) == ("user:1000:llama.service", unit, "")
    # Her manager's init.scope, and a cgroup of her own that names no unit, are groups of
    # hers: judged at her level, a stop kills them.
    scope = "/user.slice/user-1000.slice/user@1000.service/init.scope"
    assert owner(4, scope) == ("user:1000:init.scope", scope, "her init.scope")
    # In user@UID.service itself (issue 40, H3): a group of hers too, never PID 1's.
    base = "/user.slice/user-1000.slice/user@1000.service"
    assert owner(4, base) == (
        f"user:1000:{base}",
        base,
        "processes in user@1000.service itself",
    )
    hideout = "/user.slice/user-1000.slice/user@1000.service/hideout"
    assert owner(4, hideout + "/deeper") == (
        f"user:1000:{hideout}",
        hideout,
        "a cgroup of her own below user@1000.service",
    )


def test_a_users_process_in_roots_unit_is_hers_by_its_uid(tmp_path):
    """In a service of PID 1's: her crontab's job (uid 1000), one she runs as her subuid
    (101000), a directory user's (70000), and what root's unit runs as a user (`sudo -u
    1001`) are groups of their uids, whether or not a login made them (exim's .forward
    pipe, atd: no loginuid); the unit's own processes (root's), a DynamicUser= process
    (61200) and Debian's system users (libvirt-qemu, 64055) stay the unit's. A PID reused
    by another process is read afresh, not taken for the one before."""
    from spark_guard import log
    from spark_guard.core.config import Config
    from spark_guard.core.snapshot import UnitRef
    from spark_guard.sense import Sensor

    cron = "/system.slice/cron.service"
    status = "Name:\tx\nUid:\t{0}\t{0}\t{0}\t{0}\n"
    procs = {10: 0, 11: 1000, 12: 1001, 13: 61200, 14: 64055, 15: 101000, 16: 70000}
    ref = UnitRef("system", "cron.service")
    groups: dict[UnitRef, list[attribution.Proc]] = {ref: [(pid, 1 << 20, 0) for pid in procs]}
    split, cgroups, what, within = attribution.split_jobs(
        groups, {ref: cron}, lambda p, _: procs[p]
    )
    assert {str(r): [p for p, _, _ in v] for r, v in split.items()} == {
        "cron.service": [10, 13, 14],
        f"user:1000:{cron}": [11],
        f"user:1001:{cron}": [12],
        f"user:101000:{cron}": [15],
        f"user:70000:{cron}": [16],
    }
    assert what[UnitRef("user:1000", cron)] == "uid 1000's job in cron.service"
    assert cgroups[UnitRef("user:1000", cron)] == cron
    assert within[UnitRef("user:1000", cron)] == ref
    make_proc(
        tmp_path / "proc",
        {
            pid: {
                "cgroup": f"0::{cron}\n",
                "status": status.format(uid),
                "stat": f"{pid} (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {pid * 100} 0 0\n",
            }
            for pid, uid in procs.items()
        },
    )
    sensor = Sensor(Config(proc=str(tmp_path / "proc")), log.get_logger())
    for pid in procs:
        sensor.units.fresh(pid, cron, 1 << 20)
    assert sensor.units.uid(11, 1 << 20) == 1000
    # PID 11 is reused by a process of root's service in another cgroup: read afresh.
    other = "/system.slice/llama.service"
    (tmp_path / "proc" / "11" / "cgroup").write_text(f"0::{other}\n")
    (tmp_path / "proc" / "11" / "status").write_text(status.format(0))
    sensor.units.fresh(11, other, 1 << 20)
    assert sensor.units.uid(11, 1 << 20) == 0
    # In the same cgroup, a big one whose start time changed is another process too.
    (tmp_path / "proc" / "16" / "status").write_text(status.format(0))
    (tmp_path / "proc" / "16" / "stat").write_text(
        "16 (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99999 0 0\n"
    )
    sensor.units.fresh(16, cron, 1 << 30)
    assert sensor.units.uid(16, 1 << 30) == 0


def test_a_look_over_thousands_of_processes_tells_the_watchdog_it_goes_on():
    """A fork storm puts tens of thousands of processes in one look (CI saw 17,800); read
    cold on a loaded host that look outlasted WatchdogSec=, and the manager aborted the
    guard. Each PROGRESS_EVERY processes walked is progress: the heartbeat the daemon
    gives the sensor is called within the look, not only after it."""
    import signal
    import subprocess

    from lab.harness import poll
    from spark_guard import log
    from spark_guard.core.config import Config
    from spark_guard.sense import Sensor
    from spark_guard.sense.units import PROGRESS_EVERY

    n = 3 * PROGRESS_EVERY
    crowd = subprocess.Popen(
        ["sh", "-c", f"i=0; while [ $i -lt {n} ]; do sleep 60 & i=$((i+1)); done; wait"],
        start_new_session=True,
    )
    beats: list[int] = []
    try:
        crowded, _ = poll(lambda: sum(name.isdigit() for name in os.listdir("/proc")) >= n, 60)
        assert crowded and crowd.poll() is None
        sensor = Sensor(Config(gpu=False), log.get_logger(), heartbeat=lambda: beats.append(1))
        try:
            sensor.snapshot(rescue=False)
        finally:
            sensor.close()
    finally:
        os.killpg(crowd.pid, signal.SIGKILL)
        crowd.wait()
    assert len(beats) >= 3, len(beats)
