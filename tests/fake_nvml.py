"""A stand-in for libnvidia-ml.so.1 at the C boundary, for pynvml.nvmlLib.

The real pynvml binding code runs against it: argument marshalling, error
codes, the 'not available' sentinel mapping to None. Only the C library is
fake, since no GPU exists here.
"""

from __future__ import annotations

from ctypes import addressof

import pynvml

NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF


class FakeNvmlLib:
    def __init__(
        self,
        devices: list[list[tuple[int, int | None]]],
        *,
        has_v3: bool = True,
        init_error: int = 0,
    ) -> None:
        self.devices = devices  # per device: (pid, bytes or None)
        self.init_error = init_error
        self.fail_with = 0
        self._handles = [pynvml.struct_c_nvmlDevice_t() for _ in devices]
        self._by_address = {addressof(h): i for i, h in enumerate(self._handles)}
        if not has_v3:
            self.nvmlDeviceGetComputeRunningProcesses_v3 = None  # type: ignore[assignment]
            del self.nvmlDeviceGetComputeRunningProcesses_v3

    def nvmlInitWithFlags(self, flags):
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


def install(monkeypatch, lib: FakeNvmlLib | None) -> None:
    """Point pynvml at `lib`; None means no library at all (CDLL fails)."""
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    if lib is None:

        def no_library(name, *a, **k):
            raise OSError(f"{name}: cannot open shared object file")

        monkeypatch.setattr(pynvml, "CDLL", no_library)
