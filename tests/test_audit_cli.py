"""`spark-guard audit` where no systemd manager answers: it says it audited nothing, and fails."""

import json
import subprocess
import sys


def audit(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nsystem_manager = "{tmp_path}/no-pid1/private"\n'
        f'user_runtime = "{tmp_path}/run-user"\nlinger = "{tmp_path}/linger"\n'
        "[gpu]\nenabled = false\n"
    )
    (tmp_path / "run-user").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "spark_guard", "audit", *args, "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_audit_with_no_manager_says_nothing_was_audited_and_exits_2(tmp_path):
    out = audit(tmp_path)
    assert out.returncode == 2, out
    assert out.stdout.startswith("managers: none reachable\n"), out.stdout
    assert "no findings" not in out.stdout
    assert "CRITICAL nothing-audited" in out.stdout
    assert (
        "no systemd manager reachable, so no running unit was audited (no manager socket at "
        f"{tmp_path}/no-pid1/private or under {tmp_path}/run-user)"
    ) in out.stdout
    assert "fix: run it as root on a machine where systemd is PID 1" in out.stdout


def test_audit_json_with_no_manager_carries_the_finding(tmp_path):
    out = audit(tmp_path, "--json")
    assert out.returncode == 2, out
    report = json.loads(out.stdout)
    assert report["managers"] == []
    assert report["findings"][0]["code"] == "nothing-audited"
    assert report["findings"][0]["severity"] == "critical"
