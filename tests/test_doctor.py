"""`spark-guard doctor`: the failure classified, Xid explained, the card and the logs checked.

NVML is faked at the C-library boundary (tests/fake_nvml.py): the real
pynvml binding and the doctor's own code run. /dev and /sys are redirected
to directories the test lays out. The logs are a real systemd-journald's,
started for the test in the user manager's namespace: kernel records reach
it through its /dev/kmsg (a FIFO bound there), and a real unit crashing
under Restart=always makes the restart storm.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pynvml
import pytest

from lab.accounts import unprivileged_user
from lab.harness import UserManager
from spark_guard import config as config_mod
from spark_guard.cli import main
from spark_guard.core.quantities import format_size
from spark_guard.system.gpu import inspect
from spark_guard.system.procfs import PAGE_SIZE
from spark_guard.tools.doctor.cli import gather
from spark_guard.tools.doctor.judge import Evidence, Report, judge
from spark_guard.tools.doctor.logscan import RESTART_SCHEDULED, parse_entry, parse_kmsg
from spark_guard.tools.doctor.xid import CATALOGUE, describe, parse_line
from tests import fake_nvml
from tests.fake_nvml import GB10_CARD, HEALTHY_CARD, FakeNvmlLib

REQUIRED_XIDS = (13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95, 119, 120)


def machine(
    tmp_path: Path, *, nvidiactl: bool = True, pci: bool = True, proc: Path | None = None
) -> Path:
    """A config whose /dev and /sys (and /proc, if given) are directories laid out here;
    no journal, no managers."""
    dev, sysfs = tmp_path / "dev", tmp_path / "sys"
    dev.mkdir()
    if nvidiactl:
        (dev / "nvidiactl").touch()
    gpu = sysfs / "bus" / "pci" / "devices" / "0000:01:00.0"
    gpu.mkdir(parents=True)
    (gpu / "vendor").write_text("0x10de\n" if pci else "0x8086\n")
    (tmp_path / "journal").mkdir()
    config = tmp_path / "guard.toml"
    config.write_text(
        f'[paths]\ndev = "{dev}"\nsysfs = "{sysfs}"\nkmsg = "{tmp_path}/no-kmsg"\n'
        f'system_manager = "{tmp_path}/none"\nuser_runtime = "{tmp_path}/none"\n'
        f'linger = "{tmp_path}/none"\n' + (f'proc = "{proc}"\n' if proc else "")
    )
    return config


def doctor(config: Path, capsys, *extra: str, journal: Path | None = None) -> tuple[int, dict]:
    directory = journal or config.parent / "journal"
    code = main(
        ["doctor", "--json", "--config", str(config), "--directory", str(directory), *extra]
    )
    return code, json.loads(capsys.readouterr().out)


def codes(report: dict) -> dict[str, dict]:
    return {f["code"]: f for f in report["findings"]}


# --- the card, through the real binding ---


def test_a_healthy_gpu_is_classified_healthy_with_its_versions(tmp_path, monkeypatch, capsys):
    fake_nvml.install(monkeypatch, FakeNvmlLib([[(4242, 6 * 2**30)]]))
    code, report = doctor(machine(tmp_path), capsys)
    found = codes(report)
    assert report["classification"] == "healthy" and code == 0
    assert "driver 580.95.05, CUDA 13.0" in found["versions"]["message"]
    assert found["temperature"]["severity"] == "ok"
    assert "45 °C, slowdown at 90 °C" in found["temperature"]["message"]
    assert found["memory"]["message"].endswith("(12%)")
    assert "pcie-width" not in found and "persistence-off" not in found


def test_a_narrowed_pcie_link_is_a_warning_a_slower_generation_is_not(
    tmp_path, monkeypatch, capsys
):
    card = HEALTHY_CARD | {"pcie_width": 4, "pcie_gen": 1}
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]], cards=[card]))
    code, report = doctor(machine(tmp_path), capsys)
    found = codes(report)
    assert found["pcie-width"]["severity"] == "warning"
    assert "x4, the card can do x16" in found["pcie-width"]["message"]
    assert found["pcie-gen"]["severity"] == "info"  # links slow down at idle
    assert code == 1


def test_persistence_off_is_explained_and_when_it_matters(tmp_path, monkeypatch, capsys):
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]], cards=[HEALTHY_CARD | {"persistence": 0}]))
    _, report = doctor(machine(tmp_path), capsys)
    off = codes(report)["persistence-off"]
    assert off["severity"] == "info"  # no loader restarting here
    assert "start and stop often" in off["message"] and "long-running server" in off["message"]
    assert off["fix"] == "systemctl enable --now nvidia-persistenced"


def test_gb10_reports_no_device_memory_and_the_per_process_figures_stand_in(
    tmp_path, monkeypatch, capsys
):
    lib = FakeNvmlLib([[(4242, 37 * 2**30), (4343, 2 * 2**30)]], cards=[GB10_CARD])
    fake_nvml.install(monkeypatch, lib)
    code, report = doctor(machine(tmp_path), capsys)
    gb10 = codes(report)["memory-not-supported"]
    assert "NOT SUPPORTED" in gb10["message"] and "GB10" in gb10["message"]
    assert "39.0GiB in 2 process(es)" in gb10["message"]
    assert any(e.startswith("pid 4242") and "37.0GiB" in e for e in gb10["evidence"])
    assert report["classification"] == "healthy" and code == 0


def test_no_driver_loaded_is_driver_level(tmp_path, monkeypatch, capsys):
    lib = FakeNvmlLib([[]], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    fake_nvml.install(monkeypatch, lib)
    code, report = doctor(machine(tmp_path, nvidiactl=False), capsys)
    first = report["findings"][0]
    assert report["classification"] == "driver-level" and code == 3
    assert "the NVIDIA kernel driver is not loaded" in first["evidence"][0]
    assert "/dev/nvidiactl does not exist" in first["evidence"]
    assert "1 NVIDIA device(s) on the PCI bus" in first["evidence"]


def test_no_library_and_no_nvidia_device_is_not_an_error(tmp_path, monkeypatch, capsys):
    fake_nvml.install(monkeypatch, None)
    code, report = doctor(machine(tmp_path, nvidiactl=False, pci=False), capsys)
    assert report["classification"] == "no-gpu" and code == 0


def test_no_library_on_a_machine_with_an_nvidia_device_is_driver_level(
    tmp_path, monkeypatch, capsys
):
    fake_nvml.install(monkeypatch, None)
    code, report = doctor(machine(tmp_path, nvidiactl=False), capsys)
    assert report["classification"] == "driver-level" and code == 3
    assert "libnvidia-ml.so.1 not found" in report["findings"][0]["evidence"][0]


def test_the_fake_is_read_through_pynvml_not_around_it(monkeypatch):
    fake_nvml.install(monkeypatch, FakeNvmlLib([[(1, 2**30)]], cards=[GB10_CARD]))
    facts = inspect()
    assert facts.state == "ok" and facts.cards[0].name == "NVIDIA GB10"
    assert facts.cards[0].memory_used is None and facts.processes[0].used == 2**30


# --- the Xid catalogue and the lines it reads ---


def test_every_xid_the_issue_names_has_causes_and_a_first_check():
    for code in REQUIRED_XIDS:
        info = CATALOGUE[code]
        assert info.causes and info.first_check and info.severity in ("warning", "critical")
    assert describe(999).origin == "unknown" and "999" in describe(999).first_check


def test_one_severity_order_for_doctor_audit_and_the_xid_catalogue():
    from spark_guard.tools.findings import Finding, Severity, worst, worst_first

    assert [s.value for s in sorted(Severity, key=lambda s: s.rank)] == [
        "ok",
        "info",
        "warning",
        "critical",
    ]
    found = [Finding(Severity(s), s, "") for s in ("info", "critical", "ok", "warning", "info")]
    order = [f.code for f in sorted(found, key=worst_first)]
    assert order == ["critical", "warning", "info", "info", "ok"]
    assert worst(found) is Severity.CRITICAL and worst([]) is Severity.OK
    assert worst([describe(13), describe(79)]) is Severity.CRITICAL  # Xid entries grade alike
    assert Severity.WARNING.at_least(Severity.INFO)
    assert not Severity.INFO.at_least(Severity.WARNING)
    # The values are the text both tools print and their --json carries.
    assert json.dumps([Severity.WARNING, f"{Severity.CRITICAL}"]) == '["warning", "critical"]'


def test_xid_lines_as_drivers_write_them():
    x = parse_line("NVRM: Xid (PCI:0000:01:00): 79, pid=1234, GPU has fallen off the bus.")
    assert x is not None and (x.code, x.device, x.pid) == (79, "0000:01:00", 1234)
    x = parse_line("NVRM: Xid (PCI:000f:01:00): 13, Graphics Exception: ESR 0x404600=0x80000002")
    assert x is not None and (x.code, x.pid) == (13, None)
    assert parse_line("NVRM: GPU at PCI:0000:2b:00: GPU-0b11d014") is None


def test_kmsg_records_with_continuations():
    lines = parse_kmsg(
        ["3,10,2000000,-;NVRM: Xid (PCI:0000:01:00): 48, pid=9, DBE", " SUBSYSTEM=pci", "junk"],
        boot_epoch=1000.0,
    )
    assert [(ln.at, ln.message) for ln in lines] == [
        (1002.0, "NVRM: Xid (PCI:0000:01:00): 48, pid=9, DBE")
    ]


def test_only_application_xids_make_it_app_level():
    from spark_guard.system.gpu import Card, GpuFacts
    from spark_guard.tools.doctor.logscan import LogLine

    card = Card(0, "GPU", True, 4, 4, 16, 16, 40, 90, 50.0, 300.0, 0, 1)
    facts = GpuFacts("ok", "1 device(s)", "580", "13.0", (card,))

    def kind(*codes: int) -> str:
        logs = tuple(
            LogLine(1.0, f"NVRM: Xid (PCI:0000:01:00): {c}, pid=5, x", "", kernel=True)
            for c in codes
        )
        return judge(Evidence(facts, True, 1, "inactive", logs=logs)).kind

    assert kind(13, 43) == "app-level"
    assert kind(13, 94) == "hardware/firmware-level"
    assert kind(119) == "hardware/firmware-level"
    assert kind() == "healthy"


def test_a_missing_nvml_binding_is_cannot_tell_never_a_dead_driver():
    """Driver present (/dev/nvidiactl, a card on the PCI bus) but no pynvml, the normal
    state on Debian 12: doctor said CRIT driver-level, suggested a reboot after Xid 79 and
    exited 2. A missing binding is "cannot tell", with how to install it."""
    from spark_guard.system.gpu import GpuFacts

    facts = GpuFacts("no-module", "python module pynvml (nvidia-ml-py) is not installed")
    report = judge(Evidence(facts, True, 1, "inactive"))
    assert report.kind == "cannot-tell"
    assert report.exit_code == 4
    first = report.findings[0]
    assert "nvidia-ml-py" in first.fix and "reboot" not in first.fix
    assert "driver-level" not in {f.code for f in report.findings}


def test_a_manager_doctor_did_not_reach_is_said_and_never_a_clean_exit():
    """Issue 40, H5: her manager out of view (her socket renamed), doctor listed no loader
    of hers and a healthy GPU exited 0. Each manager it did not reach is a warning of
    its application step: the loaders there were not listed, and audit says what runs."""
    from spark_guard.system.gpu import GpuFacts

    facts = GpuFacts("no-library", "libnvidia-ml.so.1 not found")  # a machine with no GPU
    why = "user:1101: pid 77 on /run/user/1101/systemd/private is not this user's systemd"
    report = judge(Evidence(facts, False, 0, "not-found", unreached=(why,)))
    unreached = [f for f in report.findings if f.code == "manager-unreached"]
    assert [(f.step, f.severity.name) for f in unreached] == [("application", "WARNING")]
    assert why in unreached[0].message and "spark-guard audit" in unreached[0].fix
    assert report.exit_code == 1
    assert judge(Evidence(facts, False, 0, "not-found")).exit_code == 0


def test_a_loaders_cuda_line_is_known_by_its_tag_when_journald_lost_its_unit():
    """A process that prints its CUDA error and exits at once is often gone before journald
    reads its cgroup: the line has no unit, and only its SYSLOG_IDENTIFIER names it."""
    from spark_guard.system.gpu import GpuFacts

    def found(tag: str) -> dict[str, str]:
        entry = {"MESSAGE": "CUDA error: out of memory", "_UID": "0", "SYSLOG_IDENTIFIER": tag}
        line = parse_entry(entry)
        assert line is not None and line.unit == ""
        ev = Evidence(
            GpuFacts("ok", "", "", "", ()),
            True,
            1,
            "active",
            logs=(line,),
            loader_names=("llama-server", "ollama"),
        )
        return {f.code: f.message for f in judge(ev).findings}

    assert found("llama-server")["cuda-out-of-memory"].startswith("llama-server: 1 CUDA out of")
    assert "cuda-out-of-memory" not in found("sh")  # anyone's shell is not a loader


# --- NV_ERR_NO_MEMORY, judged against the memory state now ---

GiB = 2**30
# As the open driver writes them (vllm issues 54200, 56824), and one NVRM line that is not.
NV_NO_MEMORY = (
    "NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] "
    "(0x00000051) returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359",
    "NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] "
    "(0x00000051) returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359",
)
NVRM_LOADED = "NVRM: loading NVIDIA UNIX Open Kernel Module for aarch64  580.95.05"
DMA_ZONE = {8: 1, 9: 1, 10: 3}  # free blocks by order, as in a real buddyinfo's first line


def huge_bytes(*zones: dict[int, int]) -> int:
    """What buddyinfo's zones hold free in blocks of 2 MiB and larger."""
    return sum(
        n * (PAGE_SIZE << o) for z in zones for o, n in z.items() if PAGE_SIZE << o >= 2 * 2**20
    )


def spark_proc(
    tmp_path: Path, *, free: int, available: int, cache: int, buddy: dict[int, int] | None
) -> Path:
    """A /proc with a 121 GiB Spark's meminfo and a buddyinfo of `buddy` (order -> free
    blocks in zone Normal; None: no buddyinfo)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    kb = {
        "MemTotal": 121 * GiB,
        "MemFree": free,
        "MemAvailable": available,
        "Buffers": 64 * 2**20,
        "Cached": cache + 2 * GiB,
        "Active(file)": cache // 4,
        "Inactive(file)": cache - cache // 4,
        "Shmem": 2 * GiB,
        "SwapTotal": 0,
    }
    meminfo = "".join(f"{k}:{v // 1024:>16} kB\n" for k, v in kb.items())
    (proc / "meminfo").write_text(meminfo + "HugePages_Total:       0\n")
    if buddy is not None:
        dma, normal = (" ".join(f"{z.get(o, 0):6d}" for o in range(11)) for z in (DMA_ZONE, buddy))
        (proc / "buddyinfo").write_text(
            f"Node 0, zone      DMA {dma} \nNode 0, zone   Normal {normal} \n"
        )
    return proc


def nv_records(count: int, every: float) -> list[str]:
    """/dev/kmsg records: `count` NV_ERR_NO_MEMORY lines `every` seconds apart."""
    lines = [NVRM_LOADED] + [NV_NO_MEMORY[i % 2] for i in range(count)]
    return [f"3,{i},{int(i * every * 1e6)},-;{line}" for i, line in enumerate(lines)]


def doctor_now(
    tmp_path: Path, monkeypatch, records: list[str], **memory
) -> tuple[Evidence, Report]:
    """doctor's gather() on a laid-out /proc, the kernel lines given as /dev/kmsg records."""
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]], cards=[GB10_CARD]))
    tmp_path.mkdir(exist_ok=True)
    config = config_mod.load(machine(tmp_path, proc=spark_proc(tmp_path, **memory)))
    ev = gather(config, "24h ago", str(tmp_path / "journal"), config.kmsg)
    ev = dataclasses.replace(ev, logs=tuple(parse_kmsg(records, time.time() - 3600)))
    return ev, judge(ev)


def nv_finding(report: Report) -> dict:
    found = {f.code: f for f in report.findings}
    assert "wedge-signature" in found, report
    wedge = found["wedge-signature"]
    assert wedge.severity == "info" and "ping answers, ssh times out" in wedge.message
    assert "open-gpu-kernel-modules issue 1358" in wedge.message
    f = found["nv-no-memory"]
    assert f.step == "kernel" and f.evidence[0] in NV_NO_MEMORY
    return dataclasses.asdict(f)


def test_nv_no_memory_alone_with_healthy_memory_is_only_info_with_the_caveat(tmp_path, monkeypatch):
    buddy = {9: 3000, 10: 12000}
    ev, report = doctor_now(
        tmp_path,
        monkeypatch,
        nv_records(3, 1.0),
        free=60 * GiB,
        available=100 * GiB,
        cache=40 * GiB,
        buddy=buddy,
    )
    # gather() read the figures from the laid-out /proc
    assert (ev.mem_free, ev.mem_available, ev.file_cache) == (60 * GiB, 100 * GiB, 40 * GiB)
    assert ev.huge_free == huge_bytes(DMA_ZONE, buddy)
    f = nv_finding(report)
    assert f["severity"] == "info" and report.exit_code == 0
    assert "3 NVRM NV_ERR_NO_MEMORY line(s)" in f["message"]
    assert "not a sign" in f["message"] and "vllm issue 56824" in f["message"]
    assert "memory now, not at the time of the line" in f["message"]
    assert "MemFree 60.0GiB" in f["evidence"][1]
    # Healthy memory and no such line: nothing said at all.
    assert "nv-no-memory" not in {x.code for x in judge(dataclasses.replace(ev, logs=())).findings}


def test_nv_no_memory_with_memfree_collapsed_under_cache_is_a_warning_naming_memfree(
    tmp_path, monkeypatch
):
    ev, report = doctor_now(
        tmp_path,
        monkeypatch,
        nv_records(3, 600.0),
        free=2 * GiB,
        available=90 * GiB,
        cache=85 * GiB,
        buddy={10: 256},
    )
    f = nv_finding(report)
    assert f["severity"] == "warning" and report.exit_code == 1
    assert "MemFree has collapsed to 2.0GiB, under the device floor 8.0GiB" in f["message"]
    assert "a GPU allocation gets MemFree, not MemAvailable" in f["message"]
    assert "MemAvailable 90.0GiB counts the page cache (85.0GiB)" in f["message"]
    assert "echo 1 > /proc/sys/vm/drop_caches" in f["fix"]
    assert "spark-guard preflight --make-room UNIT as ExecStartPre=" in f["fix"]
    # MemAvailable as low as MemFree: memory is used, not cached; dropping caches won't help.
    used = judge(dataclasses.replace(ev, mem_available=ev.mem_free))
    assert "is low too: memory is used, not cached" in nv_finding(used)["message"]
    assert "drop_caches" not in nv_finding(used)["fix"]
    # The same collapse without the line: not this finding, which is about the line.
    assert "nv-no-memory" not in {x.code for x in judge(dataclasses.replace(ev, logs=())).findings}


def test_nv_no_memory_with_no_free_2mib_blocks_is_a_warning_naming_fragmentation(
    tmp_path, monkeypatch
):
    # 30 GiB free, nearly all of it in blocks of 4..32 KiB (4 KiB pages).
    ev, report = doctor_now(
        tmp_path,
        monkeypatch,
        nv_records(2, 30.0),
        free=30 * GiB,
        available=60 * GiB,
        cache=30 * GiB,
        buddy={0: 1_000_000, 1: 500_000, 2: 500_000, 3: 350_000},
    )
    f = nv_finding(report)
    assert f["severity"] == "warning"
    only = format_size(huge_bytes(DMA_ZONE))
    assert ev.huge_free == huge_bytes(DMA_ZONE)
    assert f"free memory is fragmented: MemFree 30.0GiB, but only {only}" in f["message"]
    assert "blocks of 2 MiB or larger" in f["message"]
    assert "echo 1 > /proc/sys/vm/compact_memory" in f["fix"]


def test_many_nv_no_memory_lines_in_a_minute_with_a_collapse_are_critical(tmp_path, monkeypatch):
    memory = dict(free=GiB, available=80 * GiB, cache=75 * GiB, buddy={10: 100})
    _, report = doctor_now(tmp_path / "a", monkeypatch, nv_records(12, 2.0), **memory)
    f = nv_finding(report)
    assert f["severity"] == "critical" and report.exit_code == 3
    assert "12 NVRM NV_ERR_NO_MEMORY line(s)" in f["message"]
    assert "at most 12 within a minute" in f["message"]
    # As many lines, spread over 22 minutes: a warning.
    _, spread = doctor_now(tmp_path / "b", monkeypatch, nv_records(12, 120.0), **memory)
    assert nv_finding(spread)["severity"] == "warning"


# --- a real journald and a real crashing unit ---

CRASHER = (
    "[Unit]\nDescription=a llama-server that dies at once\nStartLimitIntervalSec=0\n"
    "[Service]\n"
    # As llama-server's own lines are tagged: a shell that exits at once is often gone
    # before journald reads its cgroup, and then the tag is all that names the loader.
    "SyslogIdentifier=llama-server\n"
    'ExecStart=/bin/sh -c \'echo "CUDA error: out of memory" >&2; '
    'echo "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected" >&2;'
    " exit 1'\n"
    "Restart=always\nRestartSec=200ms\n"
)


@pytest.mark.journald
@pytest.mark.systemd
def test_real_journal_xid_lines_and_a_restart_storm(tmp_path, monkeypatch, capsys):
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]]))
    config = machine(tmp_path)
    with UserManager(journald=True) as um:
        um.write_unit("llama-crash.service", CRASHER)
        um.systemctl("start", "llama-crash.service", check=False)
        with open(um.kmsg, "w") as kmsg:  # journald holds it open: this does not block
            for seq, line in enumerate(
                (
                    "NVRM: Xid (PCI:0000:01:00): 79, pid=1234, GPU has fallen off the bus.",
                    "NVRM: Xid (PCI:0000:01:00): 13, pid=77, Graphics Exception",
                    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,"
                    "mems_allowed=0,global_oom,task_memcg=/system.slice/llama-a.service,"
                    "task=llama-server,pid=4321,uid=0",
                    "Out of memory: Killed process 4321 (llama-server) total-vm:9000kB",
                ),
                start=1,
            ):
                kmsg.write(f"3,{seq},{seq * 1000},-;{line}\n")
                kmsg.flush()
                time.sleep(0.2)  # one record per read(), as /dev/kmsg gives them
        deadline = time.monotonic() + 30
        while int(um.show("llama-crash.service", "NRestarts")["NRestarts"]) < 4:
            assert time.monotonic() < deadline, um.log.read_text()[-2000:]
            time.sleep(0.2)
        um.systemctl("stop", "llama-crash.service", check=False)
        time.sleep(0.5)  # journald writes what it got
        code, report = doctor(config, capsys, "--since", "10min ago", journal=um.journal_dir)
        later = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() + 2))
        time.sleep(2.5)
        _, quiet = doctor(config, capsys, "--since", later, journal=um.journal_dir)

    found = codes(report)
    assert report["classification"] == "hardware/firmware-level" and code == 3
    assert found["xid-79"]["severity"] == "critical"
    assert "fallen off the bus" in found["xid-79"]["message"]
    assert found["xid-79"]["evidence"][0].endswith("pid=1234, GPU has fallen off the bus.")
    assert "catalogue: https://docs.nvidia.com/deploy/xid-errors/" in found["xid-79"]["evidence"][1]
    assert found["xid-13"]["severity"] == "warning"
    storm = found["restart-storm"]
    assert storm["severity"] == "critical"  # a loader, by its name
    assert "user:0:llama-crash.service: restarted" in storm["message"]
    assert found["oom-kill"]["message"].startswith("llama-a.service: killed")
    assert "CUDA out of memory" in found["cuda-out-of-memory"]["message"]
    assert "no CUDA-capable device" in found["cuda-init"]["evidence"][0]
    # --since: nothing after that moment
    assert quiet["classification"] == "healthy", quiet
    assert not [f for f in quiet["findings"] if f["code"].startswith(("xid-", "restart"))]


@pytest.mark.journald
@pytest.mark.systemd
def test_real_journal_nv_no_memory_burst_with_memfree_collapsed(tmp_path, monkeypatch, capsys):
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]], cards=[GB10_CARD]))
    proc = spark_proc(tmp_path, free=GiB, available=80 * GiB, cache=75 * GiB, buddy={10: 100})
    config = machine(tmp_path, proc=proc)
    with UserManager(journald=True) as um:
        with open(um.kmsg, "w") as kmsg:  # journald holds it open: this does not block
            for record in nv_records(12, 0.05):
                kmsg.write(record + "\n")
                kmsg.flush()
                time.sleep(0.05)  # one record per read(), as /dev/kmsg gives them
        time.sleep(0.5)  # journald writes what it got
        code, report = doctor(config, capsys, "--since", "10min ago", journal=um.journal_dir)
    f = codes(report)["nv-no-memory"]
    assert f["severity"] == "critical" and code == 3, report
    assert "12 NVRM NV_ERR_NO_MEMORY line(s)" in f["message"]
    assert "MemFree has collapsed to 1.0GiB" in f["message"]
    assert codes(report)["wedge-signature"]["severity"] == "info"


def test_the_text_report_follows_the_admins_order(tmp_path, monkeypatch, capsys):
    card = HEALTHY_CARD | {"pcie_width": 8, "temperature": 88}
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]], cards=[card]))
    config = machine(tmp_path)
    code = main(["doctor", "--config", str(config), "--directory", str(tmp_path / "journal")])
    out = capsys.readouterr().out
    assert out.startswith("classification: healthy\n")
    steps = [line for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    # The journal directory here has no journal file: said, not left out (issue 30 §1).
    assert steps == ["classify:", "kernel:", "driver:", "card:"]
    assert "journal: no journal files in it" in out.replace(str(tmp_path / "journal"), "journal")
    assert "  WARNING  GPU 0 (NVIDIA RTX 6000 Ada Generation): PCIe link x8" in out
    assert "  WARNING  GPU 0 (NVIDIA RTX 6000 Ada Generation): 88 °C, slowdown at 90 °C" in out
    assert "next: reseat the card or riser" in out
    assert code == 1


def test_a_directory_with_no_journal_in_it_is_said(tmp_path, monkeypatch, capsys):
    """`doctor --directory` pointed at a directory with no journal file (a rescued disk's
    wrong folder): journalctl reads nothing and, quiet, says nothing, so the run looked
    clean. Now the kernel step says no log was read."""
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]], cards=[HEALTHY_CARD]))
    config = machine(tmp_path)
    empty = tmp_path / "rescued"
    (empty / "var-log").mkdir(parents=True)  # one level down, no *.journal either
    main(["doctor", "--config", str(config), "--directory", str(empty)])
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert steps[:2] == ["classify:", "kernel:"], out
    assert f"{empty}: no journal files in it" in out and "no log was read" in out


# --- who may speak of units in the journal ---


def test_only_root_and_a_users_own_manager_speak_of_units():
    """Anyone can send MESSAGE_ID= and UNIT= (`logger --journald`); journald's own fields
    (_UID, _COMM, _SYSTEMD_UNIT) say who did."""
    forged = {
        "MESSAGE": "llama.service: Scheduled restart job",
        "MESSAGE_ID": RESTART_SCHEDULED,
        "UNIT": "ssh.service",
        "_UID": "1000",
        "_COMM": "logger",
        "_SYSTEMD_UNIT": "session-3.scope",
    }
    line = parse_entry(forged)
    assert line is not None and line.message_id == "" and line.unit == "session-3.scope"
    # Her manager, in her user@1000.service, of her own unit: believed, as hers.
    hers = forged | {"USER_UNIT": "llama.service", "_COMM": "systemd"}
    hers |= {"_SYSTEMD_UNIT": "user@1000.service"}
    line = parse_entry(hers)
    assert line is not None and line.message_id == RESTART_SCHEDULED
    assert line.unit == "user:1000:llama.service"
    # The same process name elsewhere is not her manager.
    line = parse_entry(hers | {"_SYSTEMD_UNIT": "session-3.scope"})
    assert line is not None and line.message_id == "" and line.unit == "session-3.scope"
    # PID 1 (root): its UNIT= is PID 1's unit.
    pid1 = forged | {"_UID": "0", "_PID": "1", "_COMM": "systemd", "_SYSTEMD_UNIT": "init.scope"}
    line = parse_entry(pid1)
    assert line is not None and line.message_id == RESTART_SCHEDULED and line.unit == "ssh.service"


@pytest.mark.journald
@pytest.mark.systemd
def test_a_users_forged_restart_storm_is_not_believed(tmp_path, monkeypatch, capsys):
    """As a real uid, into a real journald: systemd's restart MESSAGE_ID with UNIT=ssh.service,
    twenty times. doctor reports no restart storm of PID 1's ssh.service."""
    fake_nvml.install(monkeypatch, FakeNvmlLib([[]]))
    config = machine(tmp_path)
    with unprivileged_user() as mallory, UserManager(journald=True) as um:
        assert um.proc is not None
        one = (
            "MESSAGE=ssh.service: Scheduled restart job, restart counter is at $i.\\n"
            f"MESSAGE_ID={RESTART_SCHEDULED}\\nUNIT=ssh.service\\n"
        )
        cmd = f'for i in $(seq 20); do printf "{one}" | logger --journald; done'
        ns = ["nsenter", "-t", str(um.proc.pid), "-m", "setpriv", f"--reuid={mallory.uid}"]
        ns += [f"--regid={mallory.gid}", "--clear-groups", "sh", "-c", cmd]
        subprocess.run(ns, check=True, timeout=30)
        time.sleep(0.5)  # journald writes what it got
        rows = subprocess.run(
            ["journalctl", "--directory", str(um.journal_dir), "-o", "json", "UNIT=ssh.service"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.splitlines()
        _, report = doctor(config, capsys, "--since", "10min ago", journal=um.journal_dir)
    assert rows, "the forged entries did not reach the journal"
    assert all(json.loads(r)["_UID"] == str(mallory.uid) for r in rows)
    assert "restart-storm" not in codes(report), report
