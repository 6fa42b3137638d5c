"""Run `spark-guard` with tests/fake_nvml.py in place of libnvidia-ml.so.1.

    python tests/nvml_guard.py SPEC -- run --config FILE ...

For a guard run as a unit (lab/guardunit.py): the fake is put where pynvml
would put the C library it loads (pynvml.nvmlLib), in the guard's own process,
and the rest runs unchanged: the real pynvml binding, the guard's own code,
its main(). SPEC, comma-separated:

- `hang-init`: nvmlInit never returns;
- `hang-after=N`: the per-process query answers N times, then never returns;
- `driver-not-loaded`: nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED;
- `calls=PATH`: each C call's name is appended to PATH (the test counts them);
- `pid=N:BYTES`: a compute process (default: none).

A hung call blocks in C as a stuck driver call would, every NVML call after it waits
behind it (fake_nvml's `in_driver`), and nothing releases it.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run by path (a unit's ExecStart=): sys.path[0] is tests/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout

from tests import fake_nvml


def main() -> int:
    spec, sep, *argv = sys.argv[1:]
    assert sep == "--", "seen: nvml_guard.py SPEC -- ARGS"
    kw: dict[str, object] = {}
    procs: list[tuple[int, int | None]] = []
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name == "hang-init":
            kw["hang_init"] = kw["in_driver"] = True
        elif name == "hang-after":
            kw["hang_after"] = int(value)
            kw["in_driver"] = True
        elif name == "driver-not-loaded":
            kw["init_error"] = 9
        elif name == "calls":
            kw["calls_file"] = value
        elif name == "pid":
            pid, _, used = value.partition(":")
            procs.append((int(pid), int(used)))
        else:
            raise SystemExit(f"nvml_guard.py: unknown {item!r}")
    fake_nvml.install_global(fake_nvml.FakeNvmlLib([procs], **kw))  # type: ignore[arg-type]
    sys.argv = ["spark-guard", *argv]
    from spark_guard.cli import main as guard_main

    return guard_main()


if __name__ == "__main__":
    raise SystemExit(main())
