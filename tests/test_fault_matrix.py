"""The fault matrix: a full disk, a read-only disk, or a kill at every point where a block or
a release touches the world, a unit's or a container's, and after each the guard alive,
every change on record, and, once the admin has released it, the files byte for byte and
the container's restart policy exactly as before.

tests/fault_matrix.py runs the cases (its docstring says how), in a private mount
namespace where it mounts its small tmpfs disks. It needs root, and says so: in a user
namespace the real root's directories (/, /tmp) show as the overflow uid, and the
guard, rightly, writes nothing through a directory that is neither root's nor its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("full", "read-only", "kill")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.skip("the fault matrix mounts its disks as root (see the module's docstring)")
    base = tmp_path_factory.mktemp("faults")
    unshare = ["unshare", "--mount", "--propagation", "private"]
    run = subprocess.run(
        [*unshare, sys.executable, "-m", "tests.fault_matrix", str(base)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    points: dict[str, list[str]] = {}
    cases: list[dict[str, Any]] = []
    for line in run.stdout.splitlines():
        item = json.loads(line)
        if "points" in item:
            points[item["pipeline"]] = item["points"]
        else:
            cases.append(item)
    return {"points": points, "cases": cases}


def test_the_points_are_every_change_a_block_and_a_release_make(matrix):
    """The points are found by a clean run, so they follow the code; this says they still
    reach every kind of change, and that each has its three faults."""
    block, release = matrix["points"]["block"], matrix["points"]["release"]
    for wanted in (
        "manager StopUnit llama.service",
        "manager GetUnitFileLinks llama.service",
        "manager DisableUnitFiles llama.service",
        "os.symlink null llama.service",  # the mask, to /dev/null
        "os.rename .user:0:llama.service.json.TMP user:0:llama.service.json",  # the record
        "os.rename .motd.TMP motd",  # the login note
        "manager Reload",
    ):
        assert wanted in block, (wanted, block)
    for wanted in ("os.remove llama.service", "os.symlink llama.service llama.service"):
        assert wanted in release, (wanted, release)  # the mask off, the link back
    assert any(p.startswith("os.remove user:0:llama.service.json") for p in release), release
    # A container's: every engine call (stop, the policy set to no, and back, the start),
    # and its record written before the policy changes.
    box = matrix["points"]["container-block"]
    calls = [p.split("/")[-1] for p in box if p.startswith("engine ")]
    assert calls[:4] == ["json", "stop", "json", "update"] or calls[:5] == [
        "json",
        "stop",
        "json",
        "json",
        "update",
    ], box
    update = next(i for i, p in enumerate(box) if p.endswith("/update"))
    assert any("container:vllm.json" in p and "rename" in p for p in box[:update]), box
    back = [p.split("/")[-1] for p in matrix["points"]["container-release"] if "engine" in p]
    assert "update" in back and "start" in back, back
    for pipeline, points in matrix["points"].items():
        for fault in FAULTS:
            ran = [c for c in matrix["cases"] if (c["pipeline"], c["fault"]) == (pipeline, fault)]
            assert [c["at"] for c in ran] == list(range(len(points))), (pipeline, fault)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("pipeline", ["block", "release", "container-block", "container-release"])
def test_a_fault_at_any_point_leaves_the_guard_guarding_and_loses_nothing(matrix, pipeline, fault):
    ran = [c for c in matrix["cases"] if (c["pipeline"], c["fault"]) == (pipeline, fault)]
    assert ran
    failed = [
        f"{fault} at point {c['at']} ({c['point']}):\n    " + "\n    ".join(c["problems"])
        for c in ran
        if c["problems"]
    ]
    assert not failed, "\n".join(failed)
