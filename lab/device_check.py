"""The guard's GPU claims on a real NVIDIA GPU: one short run, no package registry needed.

    python3 lab/device_check.py            # from a copy of the checkout
    (PYTHONPATH gets src/ and, if present, .venv's pynvml.py: nvidia-ml-py, one file)

It checks, on the machine's real driver:
1. a CUDA allocation made with cuMemAlloc through ctypes (libcuda.so.1: no toolkit, no
   torch) shows in the guard's own per-process NVML figures (system/gpu.GpuWatch), for
   the process that made it, charged to the unit its cgroup names;
2. unified-memory detection (system/gpu.Nvml.unified, and the rule the guard takes on
   `unified = "auto"`): "no" on a discrete card, "yes" on GB10 (NOT_SUPPORTED memory);
3. on unified memory only: the allocation lowers MemFree by about its size, while
   MemAvailable says the same (the field's claim, docs/unified-memory.md).

Prints one line per check and `N passed, N failed`; exit 1 if any failed.
"""

from __future__ import annotations

import ctypes
import glob
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
for found in glob.glob(os.path.join(ROOT, ".venv/lib/python3*/site-packages")):
    if os.path.exists(os.path.join(found, "pynvml.py")):
        sys.path.append(found)

from spark_guard.core.attribution import unit_of_cgroup  # noqa: E402
from spark_guard.system.gpu import GpuWatch, Nvml, probe_unified, unified_memory  # noqa: E402
from spark_guard.system.procfs import ProcFS  # noqa: E402

MiB = 1024**2
ALLOC = 2048 * MiB


def _cuda() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    for name in ("cuInit", "cuDeviceGet", "cuCtxCreate_v2", "cuMemAlloc_v2", "cuMemFree_v2"):
        getattr(cuda, name).restype = ctypes.c_int
    return cuda


def _allocate(ready: Queue[str], done: Event) -> None:
    """In a child: one context, ALLOC bytes of device memory, held until `done`."""
    try:
        cuda = _cuda()
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        for call, args in (
            ("cuInit", (0,)),
            ("cuDeviceGet", (ctypes.byref(dev), 0)),
            ("cuCtxCreate_v2", (ctypes.byref(ctx), 0, dev)),
            ("cuMemAlloc_v2", (ctypes.byref(ptr), ctypes.c_size_t(ALLOC))),
        ):
            rc = getattr(cuda, call)(*args)
            if rc != 0:
                ready.put(f"{call} failed: CUresult {rc}")
                return
        ready.put("ok")
        done.wait(120)
        cuda.cuMemFree_v2(ptr)
    except OSError as e:
        ready.put(f"libcuda.so.1: {e}")


def main() -> int:
    results: list[tuple[bool, str]] = []

    def check(ok: bool, what: str) -> None:
        results.append((ok, what))
        print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)

    nvml = Nvml()
    try:
        devices = nvml.start()
    except Exception as e:
        print(f"FAIL NVML: {e}")
        print("0 passed, 1 failed")
        return 1
    unified = nvml.unified
    nvml.stop()
    check(devices > 0, f"NVML: {devices} device(s)")
    print(f"  unified memory (every device NOT_SUPPORTED for its memory): {unified}")
    probed = probe_unified()
    check(probed == unified, f"probe_unified() agrees: {probed}")
    rule = unified_memory("auto", probed)
    check(rule == bool(unified), f'[memory] unified = "auto" judges unified={rule}')

    proc = ProcFS()
    before = proc.memory()
    ctx = mp.get_context("fork")
    ready: Queue[str] = ctx.Queue()
    done = ctx.Event()
    child = ctx.Process(target=_allocate, args=(ready, done))
    child.start()
    said = ready.get(timeout=120)
    check(said == "ok", f"cuMemAlloc of {ALLOC // MiB} MiB in pid {child.pid}: {said}")
    if said == "ok":
        time.sleep(1)
        after = proc.memory()
        watch = GpuWatch(deadline=10.0)
        figures, news = watch.read(time.monotonic())
        for n in news:
            print(f"  {n.kind}: {n.msg}")
        used = figures.get(child.pid or -1)
        check(
            used is not None and used >= ALLOC,
            f"the guard's NVML figures give pid {child.pid} {None if used is None else used // MiB}"
            f" MiB (at least the {ALLOC // MiB} allocated)",
        )
        cgroup = proc.cgroup(child.pid or -1) or ""
        unit = unit_of_cgroup(cgroup, "/")
        check(bool(unit), f"charged to the unit its cgroup names: {unit} ({cgroup})")
        fell_free = (before.free or 0) - (after.free or 0)
        fell_available = before.available - after.available
        print(
            f"  MemFree fell {fell_free // MiB} MiB, MemAvailable {fell_available // MiB} MiB,"
            f" free in 2 MiB blocks {(before.huge_free or 0) // MiB} -> "
            f"{(after.huge_free or 0) // MiB} MiB"
        )
        if unified:
            check(fell_free >= ALLOC * 0.9, "unified: the allocation came out of MemFree")
        watch.close()
    done.set()
    child.join(30)
    passed = sum(ok for ok, _ in results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
