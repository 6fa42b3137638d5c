"""NVML per-process memory through the real pynvml binding over a fake C library."""

import pytest

from spark_guard.gpu import GpuUnavailable, Nvml

from fake_nvml import FakeNvmlLib, install

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


def test_real_machine_without_driver():
    # This machine has no NVIDIA driver: the real library load fails cleanly.
    with pytest.raises(GpuUnavailable, match=r"libnvidia-ml\.so\.1 not found"):
        Nvml().start()
