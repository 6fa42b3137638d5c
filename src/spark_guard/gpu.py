"""Per-process GPU memory from NVML (module pynvml, distribution nvidia-ml-py).

On GB10 the device-wide memory figure is NOT_SUPPORTED and the per-process
list is the only place GPU-pinned memory shows, so that is all this reads.
No library or driver means GPU accounting is off: the caller is told once,
and everything else works. The guard retries the library now and then,
since the driver may load after the guard (modprobe@nvidia).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used: int | None  # bytes; None where NVML says 'not available'


class GpuUnavailable(RuntimeError):
    """NVML cannot be used here; str() says why, in one line."""


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError as e:
        raise GpuUnavailable(f"python module pynvml (nvidia-ml-py) is not installed: {e}") from None
    return pynvml


class Nvml:
    def __init__(self) -> None:
        self._handles: list[Any] | None = None
        self._v3 = True

    @property
    def ready(self) -> bool:
        return self._handles is not None

    def start(self) -> int:
        """Initialise NVML; returns the device count or raises GpuUnavailable."""
        nv = _nvml()
        try:
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nv.NVMLError as e:
            self._handles = None
            raise GpuUnavailable(f"NVML: {_describe(nv, e)}") from None
        return int(count)

    def stop(self) -> None:
        if self._handles is not None:
            self._handles = None
            nv = _nvml()
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlShutdown()

    def processes(self) -> list[GpuProcess]:
        """Compute processes on every device; a PID on several devices is summed."""
        if self._handles is None:
            return []
        nv = _nvml()
        used: dict[int, int | None] = {}
        try:
            for handle in self._handles:
                for p in self._compute_processes(nv, handle):
                    prev = used.get(p.pid, 0)
                    mem = p.usedGpuMemory
                    used[p.pid] = None if prev is None or mem is None else prev + int(mem)
        except nv.NVMLError as e:
            # Driver gone (GPU fell off the bus, module unloaded): off until restarted.
            self.stop()
            raise GpuUnavailable(f"NVML: {_describe(nv, e)}") from None
        return [GpuProcess(pid, mem) for pid, mem in used.items()]

    def _compute_processes(self, nv: Any, handle: Any) -> list[Any]:
        if self._v3:
            try:
                return list(nv.nvmlDeviceGetComputeRunningProcesses_v3(handle))
            except nv.NVMLError_FunctionNotFound:
                self._v3 = False  # an older driver: its v2 call has the same layout
        return list(nv.nvmlDeviceGetComputeRunningProcesses_v2(handle))


def _describe(nv: Any, e: Exception) -> str:
    code = getattr(e, "value", None)
    hints = {
        nv.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found (no NVIDIA driver installed)",
        nv.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
        nv.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA devices",
    }
    return hints.get(code, f"{e} (code {code})")
