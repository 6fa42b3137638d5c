"""A stand-in for libnvidia-ml.so.1 at the C boundary, for pynvml.nvmlLib.

The real pynvml binding code runs against it: argument marshalling, error
codes, the 'not available' sentinel mapping to None. Only the C library is
fake, since no GPU exists here.
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import addressof
from typing import Any

import pynvml

NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF


NOT_SUPPORTED = None  # a card figure the device does not report

# A healthy discrete card, as the doctor's checks read it. Override per test.
HEALTHY_CARD = {
    "name": b"NVIDIA RTX 6000 Ada Generation",
    "persistence": 1,
    "pcie_gen": 4,
    "pcie_gen_max": 4,
    "pcie_width": 16,
    "pcie_width_max": 16,
    "temperature": 45,
    "slowdown": 90,
    "power_mw": 80_000,
    "power_limit_mw": 300_000,
    "memory": (48 * 2**30, 6 * 2**30),  # total, used
}
# GB10 (DGX Spark): one memory pool, so no device memory figure.
GB10_CARD = HEALTHY_CARD | {
    "name": b"NVIDIA GB10",
    "memory": NOT_SUPPORTED,
    "pcie_gen": 5,
    "pcie_gen_max": 5,
    "pcie_width": 1,
    "pcie_width_max": 1,
}


def stuck_in_c() -> None:
    """Never return, waiting in a C call with the GIL released (ctypes releases it), as a
    thread in a driver call does: read(2) on a pipe no one writes, again on each EINTR."""
    libc = ctypes.CDLL(None, use_errno=True)
    r, _w = os.pipe()  # the write end stays open: no EOF, ever
    buf = ctypes.create_string_buffer(1)
    while True:
        libc.read(r, buf, 1)


class FakeNvmlLib:
    def __init__(
        self,
        devices: list[list[tuple[int, int | None]]],
        *,
        has_v3: bool = True,
        init_error: int = 0,
        cards: list[dict[str, object]] | None = None,
        driver: bytes = b"580.95.05",
        cuda: int = 13000,
        hang_init: bool = False,
        hang_after: int | None = None,
        calls_file: str | None = None,
        in_driver: bool = False,
    ) -> None:
        self.devices = devices  # per device: (pid, bytes or None)
        # A GPU that fell off the bus: nvmlInit, or the per-process query after `hang_after`
        # answers, never returns, as a C call stuck in the driver (the GIL is released while
        # it waits, as ctypes does) until `release` is set (a test's teardown; never in the
        # guard run by nvml_guard.py).
        self.hang_init = hang_init
        self.hang_after = hang_after
        self.release = threading.Event()
        # As a driver wedged after an Xid 79 does it (nvml_guard.py, where nothing releases
        # it): the hung call waits in C, and every NVML call after it, from any thread,
        # nvmlShutdown included, waits behind it, as behind the driver's lock.
        self.in_driver = in_driver
        self.hung = False
        self.calls: dict[str, int] = {}
        self.calls_file = calls_file  # each call's name appended: seen from another process
        self.cards = cards or [dict(HEALTHY_CARD) for _ in devices]
        self.driver, self.cuda = driver, cuda
        self.init_error = init_error
        self.fail_with = 0
        self._handles = [pynvml.struct_c_nvmlDevice_t() for _ in devices]
        self._by_address = {addressof(h): i for i, h in enumerate(self._handles)}
        if not has_v3:
            self.nvmlDeviceGetComputeRunningProcesses_v3 = None  # type: ignore[assignment]
            del self.nvmlDeviceGetComputeRunningProcesses_v3

    def _called(self, name: str) -> int:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls_file:
            with open(self.calls_file, "a") as f:
                f.write(name + "\n")
        return self.calls[name]

    def __getattribute__(self, name: str) -> Any:
        stuck = name.startswith("nvml") and object.__getattribute__(self, "hung")
        if stuck and object.__getattribute__(self, "in_driver"):
            stuck_in_c()
        return object.__getattribute__(self, name)

    def _hang(self) -> None:
        self.hung = True
        if self.in_driver:
            stuck_in_c()
        self.release.wait()

    def nvmlInitWithFlags(self, _flags):
        self._called("nvmlInit")
        if self.hang_init:
            self._hang()
        return self.init_error

    def nvmlShutdown(self):
        return 0

    def nvmlDeviceGetCount_v2(self, count_ref):
        count_ref._obj.value = len(self.devices)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle_ref):
        # A handle is an opaque pointer: point it at one struct per device.
        handle_ref._obj.contents = self._handles[index.value]
        return 0

    def _procs(self, handle, count_ref, array):
        if array is None:  # pynvml asks for the count first: one query is two C calls
            n = self._called("processes")
            if self.hang_after is not None and n > self.hang_after:
                self._hang()
        if self.fail_with:
            return self.fail_with
        procs = self.devices[self._by_address[addressof(handle.contents)]]
        if array is None:
            if not procs:
                count_ref._obj.value = 0
                return pynvml.NVML_SUCCESS
            count_ref._obj.value = len(procs)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, used) in enumerate(procs):
            array[i].pid = pid
            array[i].usedGpuMemory = NOT_AVAILABLE if used is None else used
        count_ref._obj.value = len(procs)
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count_ref, array):
        return self._procs(handle, count_ref, array)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle, count_ref, array):
        return self._procs(handle, count_ref, array)

    # --- what doctor reads ---

    def _card(self, handle):
        return self.cards[self._by_address[addressof(handle.contents)]]

    def _put(self, ref, value):
        if value is NOT_SUPPORTED:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        ref._obj.value = value
        return pynvml.NVML_SUCCESS

    def nvmlSystemGetDriverVersion(self, buf, _size):
        buf.value = self.driver
        return 0

    def nvmlSystemGetCudaDriverVersion(self, ref):
        return self._put(ref, self.cuda)

    def nvmlDeviceGetName(self, handle, buf, _size):
        buf.value = self._card(handle)["name"]
        return 0

    def nvmlDeviceGetPersistenceMode(self, handle, ref):
        return self._put(ref, self._card(handle)["persistence"])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle, ref):
        return self._put(ref, self._card(handle)["pcie_gen"])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle, ref):
        return self._put(ref, self._card(handle)["pcie_gen_max"])

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle, ref):
        return self._put(ref, self._card(handle)["pcie_width"])

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle, ref):
        return self._put(ref, self._card(handle)["pcie_width_max"])

    def nvmlDeviceGetTemperature(self, handle, _sensor, ref):
        return self._put(ref, self._card(handle)["temperature"])

    def nvmlDeviceGetTemperatureThreshold(self, handle, which, ref):
        if which.value != pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        return self._put(ref, self._card(handle)["slowdown"])

    def nvmlDeviceGetPowerUsage(self, handle, ref):
        return self._put(ref, self._card(handle)["power_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, handle, ref):
        return self._put(ref, self._card(handle)["power_limit_mw"])

    def nvmlDeviceGetMemoryInfo(self, handle, ref):
        memory = self._card(handle)["memory"]
        if memory is NOT_SUPPORTED:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        total, used = memory
        ref._obj.total, ref._obj.used, ref._obj.free = total, used, total - used
        return 0


def install_global(lib: FakeNvmlLib) -> None:
    """Point pynvml at `lib` for the rest of this process (a guard run by nvml_guard.py)."""
    pynvml.nvmlLib = lib
    pynvml._nvmlGetFunctionPointer_cache = {}


def install(monkeypatch, lib: FakeNvmlLib | None) -> None:
    """Point pynvml at `lib`; None means no library at all (CDLL fails)."""
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    if lib is None:

        def no_library(name, *_a, **_k):
            raise OSError(f"{name}: cannot open shared object file")

        monkeypatch.setattr(pynvml, "CDLL", no_library)
