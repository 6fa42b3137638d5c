"""The shipped unit: valid for systemd, and ordered to be up before any model loader."""

import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent / "units" / "spark-guard.service"


def unit_settings() -> dict[str, list[str]]:
    # Unit files repeat keys (After= twice), which configparser refuses: read by hand.
    values: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values.setdefault(f"{section}.{key}", []).extend(value.split())
    return values


@pytest.mark.root
def test_systemd_analyze_verify_is_clean(tmp_path):
    # The binary is not installed here; point ExecStart at one that exists.
    text = UNIT.read_text().replace("ExecStart=/usr/bin/spark-guard", "ExecStart=/bin/true")
    copy = tmp_path / "spark-guard.service"
    copy.write_text(text.replace("Documentation=man:spark-guard(8)\n", ""))
    # In a private mount namespace: verify leaves a marker in /run/systemd otherwise.
    script = f"mount -t tmpfs tmpfs /run/systemd && exec systemd-analyze verify {copy}"
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_ordered_before_every_default_dependency_service_and_not_after_dbus():
    s = unit_settings()
    assert s["Unit.DefaultDependencies"] == ["no"]
    assert "basic.target" in s["Unit.Before"]
    assert "sysinit.target" in s["Unit.After"]
    related = s["Unit.After"] + s.get("Unit.Requires", []) + s.get("Unit.Wants", [])
    assert not any(u.startswith("dbus") for u in related)
    assert s["Service.Type"] == ["notify"]
    assert s["Service.WatchdogSec"] and s["Service.ExecReload"]
    assert int(s["Service.OOMScoreAdjust"][0]) < 0


def test_the_guard_is_never_failed_for_good_and_never_waited_on_long():
    s = unit_settings()
    # No start limit: after any number of restarts the guard comes back.
    assert s["Unit.StartLimitIntervalSec"] == ["0"] and s["Service.Restart"] == ["always"]
    # A guard stuck in the kernel (an NVML call in D state) is given up on in seconds,
    # not the default 90 s, so its restart is not held behind it.
    for key in ("Service.TimeoutStopSec", "Service.TimeoutAbortSec"):
        assert s[key][0].endswith("s") and 0 < int(s[key][0][:-1]) <= 10, key
