"""The README's first command, ./demo/run, as a newcomer runs it: it ends with the guard having
blocked what it should, says so, and leaves nothing running or lying around.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from pathlib import Path

import pytest

from lab.harness import CGROUP_ROOTS

pytestmark = pytest.mark.nspawn

REPO = Path(__file__).parent.parent


def _ours() -> set[str]:
    """Processes and leftovers of the demo: containers' cgroups, their trees, nspawn."""
    found = {p for root in CGROUP_ROOTS for p in glob.glob(f"{root}/sg-ns-*")}
    found |= set(glob.glob("/var/tmp/sg-ns.*"))
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "systemd-nspawn" in cmd and "sg-ns." in cmd:
            found.add(f"pid {pid}: {cmd}")
    return found


def test_demo_run_shows_the_guard_blocking_and_cleans_up():
    before = _ours()
    out = subprocess.run(
        [str(REPO / "demo" / "run")], capture_output=True, text=True, timeout=900, cwd="/"
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    # What the admin was shown, in order.
    for needle in (
        "==> booting it",
        "$ systemctl status spark-guard",
        'Status: "',
        "$ journalctl SG_EVENT=unit-blocked -o verbose   (their fields)",
        "SG_UNIT=",
        "$ spark-guard status",
        "$ spark-guard audit",
        "$ systemctl is-active ssh\n  active",
        "==> releasing one unit",
        "result: as expected",
    ):
        assert needle in text, (needle, text[-6000:])
    assert re.search(r"\n  llama-deepseek.service +masked inactive masked-runtime restarts=0", text)
    # The incident's own case: the model that cannot fit on both levels, alice's copy too.
    assert re.search(
        r"user:1000:llama-deepseek.service +masked inactive masked-runtime restarts=0", text
    )
    summary = text[text.index("==> summary") :]
    assert "stop llama-deepseek.service: expects" in summary
    assert "stop user:1000:llama-deepseek.service: expects" in summary
    assert "is already loaded by" in summary  # the duplicate, with its reason
    # What the summary claims, it checked: nothing said "NOT", both checks named.
    assert "NOT" not in summary, summary
    assert "  disabled (checked: no wants link left for llama-deepseek.service, " in summary
    assert "release` undid a block exactly (checked: every loader's unit file" in summary
    assert _ours() - before == set()
