"""Per-process GPU memory from NVML (module pynvml, distribution nvidia-ml-py).

On GB10 the device-wide memory figure is NOT_SUPPORTED and the per-process
list is the only place GPU-pinned memory shows, so that is all this reads.
No library or driver means GPU accounting is off: the caller is told once,
and everything else works. The guard retries the library now and then,
since the driver may load after the guard (modprobe@nvidia).

The guard's loop never calls NVML itself (GpuWatch): a GPU that fell off the
bus (Xid 79) is exactly when an NVML call can hang for minutes, or for good,
and a hung loop is a watchdog kill, a restart and the same hang. One worker
thread makes the calls; the loop waits for an answer at most a deadline, and
a late one leaves the last known figures in place, marked stale.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.events import Event, EventKind
from .worker import spawn


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
        # CPU and GPU share one memory pool: every device has no memory figure of its own
        # (GB10 answers NOT_SUPPORTED; a discrete card gives its framebuffer). None: unknown.
        self.unified: bool | None = None

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
            self.unified = bool(self._handles) and all(
                _no_memory_figure(nv, h) for h in self._handles
            )
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


# --- the guard's loop: NVML off the loop, within a deadline ---

RETRY = 60.0  # seconds between attempts to find a driver that was missing
DEADLINE = 2.0  # seconds the loop waits for NVML's answer; later, the figures are stale


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    submitted: float
    done: threading.Event = field(default_factory=threading.Event)
    started: float | None = None
    finished: float = 0.0
    result: Any = None


class _Worker:
    """One thread, one call at a time: the caller never submits while a call is out.

    A call that never returns keeps the thread; no second one is started (NVML
    serialises inside, a second thread would wait on the same lock), so the guard
    holds at most one thread for the GPU, ever.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next: _Call | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> _Call | None:
        """The call handed over; None where no thread can be started (a later one tries)."""
        call = _Call(fn, time.monotonic())
        with self._cond:
            if self._thread is None:
                self._thread = spawn(self._run, "spark-guard nvml")
                if self._thread is None:
                    return None
            self._next = call
            self._cond.notify()
        return call

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._closed:
                    self._cond.wait()
                if self._next is None:
                    return
                call, self._next = self._next, None
            call.started = time.monotonic()
            try:
                call.result = call.fn()
            except Exception as e:  # GpuWatch._ask catches everything; this is for the rest
                call.result = e
            call.finished = time.monotonic()
            call.done.set()

    def close(self) -> None:
        """The thread ends once idle; one stuck in a call is left to it (a daemon thread)."""
        with self._cond:
            self._closed = True
            self._cond.notify()


@dataclass(frozen=True)
class _Answer:
    devices: int | None  # NVML was started by this call: that many devices
    figures: dict[int, int | None] | None  # None: no reading (NVML off, or lost)
    error: str = ""


class GpuWatch:
    """Per-process GPU memory for the guard's loop: never waits on NVML past `deadline`.

    read() asks the worker for a fresh reading and waits up to `deadline`. A call
    still out after that is a hang (named once in the journal, gpu-hung): read()
    returns the last known figures, `stale` is true, and no new call is made until
    that one comes back, whenever that is. Its answer is then taken and said
    (gpu-accounting-on, or -off with the error), and the next read asks afresh.
    """

    def __init__(self, *, retry: float = RETRY, deadline: float = DEADLINE) -> None:
        self.nvml = Nvml()
        self.retry = retry
        self.deadline = deadline
        self.figures: dict[int, int | None] = {}
        self.figures_at: float | None = None  # monotonic, when the figures were read
        self.stale_since: float | None = None  # monotonic, when the call that hangs began
        self._worker = _Worker()
        self._call: _Call | None = None
        self._doing = ""  # the NVML call the worker is in, for the journal
        self._next_try = 0.0
        self._warned = False

    @property
    def on(self) -> bool:
        """NVML answered and accounting is on (its figures may be stale)."""
        return self.nvml.ready

    @property
    def stale(self) -> bool:
        return self.stale_since is not None

    @property
    def unified(self) -> bool | None:
        """Whether NVML found one memory pool shared with the CPU; None until it answered."""
        return self.nvml.unified

    def read(self, now: float) -> tuple[dict[int, int | None], list[Event]]:
        """(pid -> GPU bytes, what to tell the journal). Waits at most `deadline`."""
        news: list[Event] = []
        call = self._call
        if call is not None:
            if not call.done.is_set():
                return self.figures, news  # still hung: said when it began
            self._call = None
            self._take(call, news)
        if not self.nvml.ready:
            if now < self._next_try:
                return self.figures, news
            self._next_try = now + self.retry
        call = self._worker.submit(self._ask)
        if call is None:  # no thread for NVML now (a pids limit): the next read tries again
            self._next_try = 0.0
            return self.figures, news
        if call.done.wait(self.deadline):
            self._take(call, news)
            return self.figures, news
        self._call = call
        self.stale_since = call.started or call.submitted
        age = "" if self.figures_at is None else f" from {now - self.figures_at:.0f}s ago"
        news.append(
            Event(
                EventKind.GPU_HUNG,
                "warning",
                f"NVML has not answered {self._doing or 'a call'} within {self.deadline:g}s "
                "(a GPU that fell off the bus, Xid 79, can hold NVML for minutes): GPU figures"
                f" are stale, the last known ones{age} stand; MemAvailable and memory pressure"
                " keep guarding",
                {"call": self._doing or None, "seconds": self.deadline},
            )
        )
        return self.figures, news

    def _ask(self) -> _Answer:
        """In the worker: start NVML if it is not, then read. Never raises."""
        devices = None
        try:
            if not self.nvml.ready:
                self._doing = "nvmlInit"
                try:
                    devices = self.nvml.start()
                except GpuUnavailable as e:
                    return _Answer(None, None, str(e))
            self._doing = "nvmlDeviceGetComputeRunningProcesses"
            try:
                procs = self.nvml.processes()
            except GpuUnavailable as e:
                return _Answer(devices, None, str(e))
            return _Answer(devices, {p.pid: p.used for p in procs})
        except Exception as e:  # the worker must outlive any binding's surprise
            return _Answer(devices, None, f"NVML: {e}")

    def _take(self, call: _Call, news: list[Event]) -> None:
        answer: _Answer = call.result
        late = ""
        if self.stale_since is not None:
            late = f" (NVML answered after {call.finished - self.stale_since:.1f}s)"
            self.stale_since = None
        if answer.devices is not None:
            self._warned = False
            news.append(
                Event(
                    EventKind.GPU_ACCOUNTING_ON,
                    "info",
                    f"GPU accounting on: {answer.devices} device(s){late}",
                    {"devices": answer.devices},
                )
            )
        if answer.figures is not None:
            if late and answer.devices is None:
                news.append(
                    Event(EventKind.GPU_ACCOUNTING_ON, "info", f"GPU figures current again{late}")
                )
            self.figures, self.figures_at = answer.figures, call.finished
            return
        self.figures, self.figures_at = {}, None
        # Missing at start: said once (the guard retries quietly). Lost while on: said each time.
        if answer.devices is not None or not self._warned or late:
            self._warned = True
            news.append(
                Event(
                    EventKind.GPU_ACCOUNTING_OFF,
                    "warning",
                    f"GPU accounting off: {answer.error}{late}",
                    {"error": answer.error},
                )
            )

    def close(self) -> None:
        """Shut NVML down unless a call still hangs in it; never waits past the deadline."""
        if self._call is None and self.nvml.ready:
            call = self._worker.submit(self.nvml.stop)
            if call is not None:
                call.done.wait(self.deadline)
        self._worker.close()


def _no_memory_figure(nv: Any, handle: Any) -> bool:
    """The device reports no memory of its own (NOT_SUPPORTED): an integrated GPU, one
    memory pool with the CPU (GB10). Any other error says nothing either way: raised."""
    try:
        nv.nvmlDeviceGetMemoryInfo(handle)
    except nv.NVMLError as e:
        if getattr(e, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED:
            return True
        raise
    return False


def _describe(nv: Any, e: Exception) -> str:
    code = getattr(e, "value", None)
    hints = {
        nv.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found (no NVIDIA driver installed)",
        nv.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
        nv.NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA devices",
    }
    return hints.get(code, f"{e} (code {code})")


def probe_unified() -> bool | None:
    """For a command: NVML asked once whether the GPUs share the CPU's memory (GB10).
    None where NVML cannot say (no driver, no device)."""
    nvml = Nvml()
    try:
        nvml.start()
    except GpuUnavailable:
        return None
    except Exception:  # a binding's surprise: no answer, not a crash of the command
        return None
    try:
        return nvml.unified
    finally:
        nvml.stop()


def unified_memory(wanted: str, nvml_says: bool | None) -> bool:
    """The config's `[memory] unified` ("yes", "no", "auto") against what NVML found."""
    return wanted == "yes" or (wanted == "auto" and nvml_says is True)


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
    state: str  # ok | no-module | no-library | no-driver | no-permission | lost | error
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
        # The Python binding, not the driver: nothing can be told of the card from here.
        return GpuFacts("no-module", str(e))
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
