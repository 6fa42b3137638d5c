"""NVML per-process memory through the real pynvml binding over a fake C library."""

import ctypes
import threading
import time

import pytest

from spark_guard.system.gpu import GpuUnavailable, GpuWatch, Nvml
from tests.fake_nvml import FakeNvmlLib, install

GiB = 1024**3


def test_per_process_memory_summed_across_devices(monkeypatch):
    lib = FakeNvmlLib([[(3354, 26899 * 1024**2), (10, GiB)], [(10, 2 * GiB)]])
    install(monkeypatch, lib)
    nv = Nvml()
    assert nv.start() == 2
    got = {p.pid: p.used for p in nv.processes()}
    assert got == {3354: 26899 * 1024**2, 10: 3 * GiB}


def test_not_available_memory_is_none(monkeypatch):
    install(monkeypatch, FakeNvmlLib([[(5, None)]]))
    nv = Nvml()
    nv.start()
    assert [(p.pid, p.used) for p in nv.processes()] == [(5, None)]


def test_driver_without_v3_falls_back_to_v2(monkeypatch):
    install(monkeypatch, FakeNvmlLib([[(7, GiB)]], has_v3=False))
    nv = Nvml()
    nv.start()
    assert [(p.pid, p.used) for p in nv.processes()] == [(7, GiB)]


def test_no_library_is_a_one_line_reason(monkeypatch):
    install(monkeypatch, None)
    with pytest.raises(GpuUnavailable) as e:
        Nvml().start()
    assert str(e.value) == "NVML: libnvidia-ml.so.1 not found (no NVIDIA driver installed)"


def test_driver_not_loaded(monkeypatch):
    install(monkeypatch, FakeNvmlLib([], init_error=9))
    with pytest.raises(GpuUnavailable, match="kernel driver is not loaded"):
        Nvml().start()


def test_gpu_lost_mid_run_turns_accounting_off(monkeypatch):
    lib = FakeNvmlLib([[(1, GiB)]])
    install(monkeypatch, lib)
    nv = Nvml()
    nv.start()
    lib.fail_with = 15  # NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuUnavailable, match="code 15"):
        nv.processes()
    assert not nv.ready and nv.processes() == []


def test_the_real_library_is_used_as_this_machine_has_it():
    """The real pynvml against the real dynamic loader, no fake: where libnvidia-ml.so.1
    cannot be loaded (no driver: this CI machine) start() says so in one clean line;
    where it can (a GPU box, a Spark), start() answers and processes() reads."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        with pytest.raises(GpuUnavailable, match=r"^NVML: libnvidia-ml\.so\.1 not found"):
            Nvml().start()
        return
    nvml = Nvml()
    problem, count = "", -1
    try:
        count = nvml.start()
    except GpuUnavailable as e:  # a driver installed, but no device or its module not loaded
        problem = str(e)
    if problem:
        assert problem.startswith("NVML: ") and "\n" not in problem
        return
    try:
        assert count >= 0 and isinstance(nvml.processes(), list)
    finally:
        nvml.stop()


# --- GpuWatch: the guard's loop never waits on NVML past its deadline ---


@pytest.fixture
def hanging(monkeypatch):
    """A fake library whose calls may block for good; released at teardown so no thread stays."""
    libs = []

    def make(*args, **kw):
        lib = FakeNvmlLib(*args, **kw)
        install(monkeypatch, lib)
        libs.append(lib)
        return lib

    yield make
    for lib in libs:
        lib.release.set()


def nvml_threads():
    """The guard's NVML threads alive (another test's may still be ending: compare sets)."""
    return {t for t in threading.enumerate() if t.name == "spark-guard nvml"[:15]}


def timed(watch, now):
    t = time.monotonic()
    figures, news = watch.read(now)
    return figures, [(n.kind, n.msg) for n in news], time.monotonic() - t


def test_a_hung_query_leaves_the_last_figures_stale_with_one_event(hanging):
    lib = hanging([[(10, GiB)]], hang_after=1)
    watch = GpuWatch(deadline=0.2)
    figures, news, _ = timed(watch, 0.0)
    assert figures == {10: GiB} and [k for k, _ in news] == ["gpu-accounting-on"]
    assert not watch.stale
    threads = nvml_threads()
    # The second query blocks in the C library: the caller waits the deadline, no longer.
    figures, news, took = timed(watch, 1.0)
    assert 0.2 <= took < 1.0
    assert figures == {10: GiB} and watch.stale and watch.on
    assert [k for k, _ in news] == ["gpu-hung"]
    assert "nvmlDeviceGetComputeRunningProcesses within 0.2s" in news[0][1]
    # While it hangs: no wait at all, no new call, no second thread, nothing more said.
    for now in range(2, 12):
        figures, news, took = timed(watch, float(now))
        assert figures == {10: GiB} and news == [] and took < 0.05
    assert lib.calls["processes"] == 2
    assert not nvml_threads() - threads and threads  # no second thread was started
    # It answers at last: said once, figures current, and the next read asks afresh.
    lib.hang_after = None
    lib.devices = [[(10, 2 * GiB)]]
    lib.release.set()
    deadline = time.monotonic() + 5
    while lib.calls["processes"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    figures, news, _ = timed(watch, 12.0)
    assert not watch.stale and figures == {10: 2 * GiB}
    assert [k for k, _ in news] == ["gpu-accounting-on"]
    assert "GPU figures current again (NVML answered after" in news[0][1]
    watch.close()


def test_a_hung_init_is_named_and_taken_when_it_answers(hanging):
    lib = hanging([[(3, GiB)]], hang_init=True)
    watch = GpuWatch(deadline=0.1)
    figures, news, took = timed(watch, 0.0)
    assert figures == {} and not watch.on and watch.stale and took < 1.0
    assert [k for k, _ in news] == ["gpu-hung"] and "nvmlInit within 0.1s" in news[0][1]
    lib.release.set()
    deadline = time.monotonic() + 5
    while not watch.on and time.monotonic() < deadline:
        time.sleep(0.01)
    figures, news, _ = timed(watch, 1.0)
    assert [k for k, _ in news] == ["gpu-accounting-on"] and figures == {3: GiB}
    assert "GPU accounting on: 1 device(s) (NVML answered after" in news[0][1]
    watch.close()


def test_missing_driver_is_retried_and_said_once(hanging):
    lib = hanging([], init_error=9)
    watch = GpuWatch(retry=1.0, deadline=1.0)
    said = []
    for now in range(0, 10):
        said += [k for k, _ in timed(watch, now * 0.5)[1]]
    assert lib.calls["nvmlInit"] == 5  # every 1 s of the 5 s
    assert said == ["gpu-accounting-off"]
    watch.close()


def test_close_does_not_wait_on_a_hung_call(hanging):
    hanging([[(1, GiB)]], hang_after=0)
    watch = GpuWatch(deadline=0.05)
    watch.read(0.0)
    assert watch.stale
    t = time.monotonic()
    watch.close()
    assert time.monotonic() - t < 0.05


# --- unified memory: which machine this is (issue 25) ---


def test_gb10_is_unified_a_discrete_card_is_not(monkeypatch):
    from spark_guard.system.gpu import probe_unified, unified_memory
    from tests.fake_nvml import GB10_CARD, HEALTHY_CARD

    install(monkeypatch, FakeNvmlLib([[(5, GiB)]], cards=[dict(GB10_CARD)]))
    nv = Nvml()
    nv.start()
    assert nv.unified is True
    assert probe_unified() is True
    assert unified_memory("auto", True) and not unified_memory("no", True)
    install(monkeypatch, FakeNvmlLib([[(5, GiB)]], cards=[dict(HEALTHY_CARD)]))
    assert probe_unified() is False
    assert not unified_memory("auto", False) and unified_memory("yes", False)
    # A discrete card beside an integrated one: not one pool for every GPU.
    two = FakeNvmlLib([[], []], cards=[dict(GB10_CARD), dict(HEALTHY_CARD)])
    install(monkeypatch, two)
    assert probe_unified() is False


def test_no_driver_says_nothing_about_unified_memory(monkeypatch):
    from spark_guard.system.gpu import probe_unified, unified_memory

    install(monkeypatch, None)
    assert probe_unified() is None
    assert not unified_memory("auto", None)
    watch = GpuWatch(deadline=2.0)
    watch.read(time.monotonic())
    assert watch.unified is None
    watch.close()
