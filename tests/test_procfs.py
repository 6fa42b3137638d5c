"""/proc readers against a fixture tree, as earlyoom tests feed a fake /proc."""

import os

import pytest

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
