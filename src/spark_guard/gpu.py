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


# --- `spark-guard doctor`: the card's own state, read once ---


@dataclass(frozen=True)
class Card:
    index: int
    name: str
    persistence: bool | None  # None: the card does not say (NOT_SUPPORTED)
    pcie_gen: int | None
    pcie_gen_max: int | None
    pcie_width: int | None
    pcie_width_max: int | None
    temperature: int | None  # °C
    temperature_slowdown: int | None
    power: float | None  # W
    power_limit: float | None
    memory_used: int | None  # bytes; None on GB10: only per-process figures exist
    memory_total: int | None


@dataclass(frozen=True)
class GpuFacts:
    state: str  # ok | no-library | no-driver | no-permission | lost | error
    detail: str
    driver_version: str | None = None
    cuda_version: str | None = None
    cards: tuple[Card, ...] = ()
    processes: tuple[GpuProcess, ...] = ()


def _state_of(nv: Any, e: Exception) -> str:
    code = getattr(e, "value", None)
    return {
        nv.NVML_ERROR_LIBRARY_NOT_FOUND: "no-library",
        nv.NVML_ERROR_DRIVER_NOT_LOADED: "no-driver",
        nv.NVML_ERROR_NO_PERMISSION: "no-permission",
        nv.NVML_ERROR_GPU_IS_LOST: "lost",
    }.get(code, "error")


def inspect() -> GpuFacts:
    """Everything doctor asks NVML, once: init, read, shut down. Never raises."""
    try:
        nv = _nvml()
    except GpuUnavailable as e:
        return GpuFacts("no-library", str(e))
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        return GpuFacts(_state_of(nv, e), f"NVML: {_describe(nv, e)}")
    try:

        def ask(fn: Any, *args: Any) -> Any:
            # NOT_SUPPORTED (GB10's memory figure) and friends: the card does not say.
            try:
                return fn(*args)
            except nv.NVMLError as e:
                if getattr(e, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                    raise
                return None

        driver = ask(nv.nvmlSystemGetDriverVersion)
        cuda = ask(nv.nvmlSystemGetCudaDriverVersion)
        cards = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = ask(nv.nvmlDeviceGetMemoryInfo, h)
            power = ask(nv.nvmlDeviceGetPowerUsage, h)
            limit = ask(nv.nvmlDeviceGetEnforcedPowerLimit, h)
            persistence = ask(nv.nvmlDeviceGetPersistenceMode, h)
            cards.append(
                Card(
                    index=i,
                    name=str(ask(nv.nvmlDeviceGetName, h) or f"GPU {i}"),
                    persistence=None if persistence is None else persistence == 1,
                    pcie_gen=ask(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                    pcie_gen_max=ask(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                    pcie_width=ask(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                    pcie_width_max=ask(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
                    temperature=ask(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                    temperature_slowdown=ask(
                        nv.nvmlDeviceGetTemperatureThreshold,
                        h,
                        nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
                    ),
                    power=None if power is None else power / 1000,
                    power_limit=None if limit is None else limit / 1000,
                    memory_used=None if mem is None else int(mem.used),
                    memory_total=None if mem is None else int(mem.total),
                )
            )
        reader = Nvml()  # NVML counts inits: this one is shut down by reader.stop()
        reader.start()
        procs = tuple(reader.processes())
        reader.stop()
        version = None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}"
        return GpuFacts("ok", f"{len(cards)} device(s)", driver, version, tuple(cards), procs)
    except (nv.NVMLError, GpuUnavailable) as e:
        return GpuFacts("lost", f"NVML: {e}")
    finally:
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()
