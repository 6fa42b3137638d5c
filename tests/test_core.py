"""The core is closed: importing it loads the standard library and itself, nothing else.

The judgement (classify, policy, step, what a command line says) must be testable with
plain data and safe to run when memory is nearly gone; an import of a thread pool, a
socket or a file reader would say otherwise. A fresh interpreter, without site hooks,
imports every module of spark_guard.core and lists what got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

PROBE = """
import importlib, json, pkgutil, sys
sys.path.insert(0, sys.argv[1])
import spark_guard.core as core
names = [m.name for m in pkgutil.walk_packages(core.__path__, "spark_guard.core.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules)}))
"""

FORBIDDEN = ("threading", "ctypes", "socket", "pwd", "grp", "select", "subprocess", "ssl")


def _probe() -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", PROBE, str(SRC)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, list[str]] = json.loads(out.stdout)
    return result


def test_core_imports_only_the_standard_library_and_itself():
    result = _probe()
    assert "spark_guard.core.step" in result["imported"]
    assert "spark_guard.core.argv.loadspec" in result["imported"]
    loaded = result["loaded"]
    ours = [m for m in loaded if m == "spark_guard" or m.startswith("spark_guard.")]
    outside = [m for m in ours if m != "spark_guard" and not m.startswith("spark_guard.core")]
    assert outside == [], f"the core reached out of itself: {outside}"
    heavy = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert heavy == [], f"the core loaded I/O machinery: {heavy}"
    third_party = [
        m
        for m in loaded
        if m.split(".")[0] not in (*sys.stdlib_module_names, "spark_guard", "__main__")
    ]
    assert third_party == [], f"the core loaded a dependency: {third_party}"
