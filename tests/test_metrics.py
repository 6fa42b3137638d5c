"""Prometheus metrics: the file the running guard writes, read back with prometheus_client's parser,
and the shipped alert rules checked and unit-tested with Debian's promtool.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lab.guardunit import GUARD, guard_manager, loader_unit, restart_guard, wait_log, write_config
from spark_guard.core.config import ConfigError, parse
from spark_guard.metrics import unit_labels

REPO = Path(__file__).parent.parent
RULES = REPO / "packaging" / "prometheus" / "spark-guard.rules.yml"
RULE_TESTS = REPO / "tests" / "prometheus" / "spark-guard.rules.test.yml"
MiB = 1024**2


def samples(path: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    values = [
        v for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    assert len(values) == 1, (name, labels, found.get(name))
    return values[0]


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


@pytest.mark.systemd
def test_the_running_guard_writes_metrics_node_exporter_can_read(tmp_path):
    textfile = tmp_path / "node-exporter" / "spark_guard.prom"
    textfile.parent.mkdir()
    with guard_manager() as um:
        write_config(
            um,
            f'[metrics]\ntextfile = "{textfile}"\n'
            '[loaders.footprint]\n"llama-big.service" = "100TiB"\n"llama-ok.service" = "64MiB"\n',
        )
        offset = restart_guard(um)
        loader_unit(um, "llama-ok.service", 32, str(um.base / "models" / "ds4.gguf"))
        um.systemctl("start", "llama-ok.service")
        loader_unit(um, "llama-big.service", 16)
        um.systemctl("start", "llama-big.service")
        wait_log(um, r"^warning unit-blocked: user:0:llama-big.service", after=offset)
        deadline = time.monotonic() + 10
        ok = {"unit": "llama-ok.service", "level": "user", "user": "0"}
        while True:  # the next full pass writes the block, and the loader's 32 MiB once held
            found = samples(textfile) if textfile.exists() else {}
            held = [
                v
                for labels, v in found.get("spark_guard_loader_used_bytes", [])
                if all(labels.get(k) == x for k, x in ok.items())
            ]
            if (
                found.get("spark_guard_blocked_units", [({}, 0)])[0][1] == 1
                and held
                and (held[0] >= 32 * MiB)
            ):
                break
            assert time.monotonic() < deadline, textfile.read_text() if textfile.exists() else ""
            time.sleep(0.2)
        mode = stat.S_IMODE(os.stat(textfile).st_mode)
        leftovers = [p.name for p in textfile.parent.iterdir() if p != textfile]
        guard_active = um.show(GUARD, "ActiveState")["ActiveState"]

    assert mode == 0o644 and leftovers == [] and guard_active == "active"
    total = one(found, "spark_guard_mem_total_bytes")
    assert total == meminfo("MemTotal")
    assert 0 < one(found, "spark_guard_mem_available_bytes") <= total
    assert one(found, "spark_guard_reserve_bytes") == max(8 * 1024**3, int(total * 0.07))
    # Unified memory figures (issue 25): shown on any machine; this one has no GPU, so
    # "auto" says not unified, the headroom judged is MemAvailable and there is no floor.
    assert one(found, "spark_guard_unified_memory") == 0
    assert 0 < one(found, "spark_guard_mem_free_bytes") <= total
    assert one(found, "spark_guard_page_cache_clean_bytes") >= 0
    assert 0 <= one(found, "spark_guard_huge_free_bytes") <= total
    assert one(found, "spark_guard_headroom_bytes") == one(found, "spark_guard_mem_available_bytes")
    assert one(found, "spark_guard_device_floor_bytes") == 0
    assert one(found, "spark_guard_room_freed_bytes") == 0
    assert one(found, "spark_guard_phase", spark_guard_phase="strict") == 1
    assert one(found, "spark_guard_phase", spark_guard_phase="steady") == 0
    assert one(found, "spark_guard_blocked_units") == 1
    big = {"unit": "llama-big.service", "level": "user", "user": "0"}
    assert one(found, "spark_guard_unit_blocked", **big, reason="footprint", phase="strict") == 1
    assert one(found, "spark_guard_actions_total", kind="stop") == 1
    assert one(found, "spark_guard_actions_total", kind="warn") == 0
    assert one(found, "spark_guard_loader_expected_bytes", **ok) == 64 * MiB
    used = one(found, "spark_guard_loader_used_bytes", **ok)
    assert 32 * MiB <= used < 64 * MiB  # RSS of a loader holding 32 MiB (no GPU here)
    assert one(found, "spark_guard_unit_gpu_bytes", **ok) == 0
    assert one(found, "spark_guard_unit_cpu_seconds_total", **ok) > 0
    assert one(found, "spark_guard_loader_starts_total", **ok) == 1
    now = time.time()
    for name in (
        "spark_guard_last_update_timestamp_seconds",
        "spark_guard_last_decision_timestamp_seconds",
        "spark_guard_watchdog_last_ping_timestamp_seconds",
    ):
        assert now - 60 < one(found, name) <= now, name
    assert 0 < one(found, "spark_guard_last_decision_duration_seconds") < 5
    assert not [n for n in found if n.endswith("_created")]


@pytest.mark.systemd
def test_no_textfile_directory_means_no_metrics_and_no_complaint(tmp_path):
    textfile = tmp_path / "absent" / "spark_guard.prom"
    with guard_manager() as um:
        write_config(um, f'[metrics]\ntextfile = "{textfile}"\n')
        offset = restart_guard(um)
        time.sleep(1.5)
        log = (um.log.read_text(errors="replace"))[offset:]
    assert not textfile.parent.exists()
    assert "metrics-off" not in log


def test_textfile_must_be_a_prom_file():
    with pytest.raises(ConfigError, match=r"metrics.textfile: node_exporter reads only \*.prom"):
        parse('[metrics]\ntextfile = "/var/lib/prometheus/node-exporter/guard.txt"\n')
    assert parse('[metrics]\ntextfile = ""\n').metrics_textfile == ""


def test_unit_labels():
    assert unit_labels("llama.service") == ("llama.service", "system", "")
    assert unit_labels("user:1000:ollama.service") == ("ollama.service", "user", "1000")
    assert unit_labels("container:vllm") == ("vllm", "container", "")


def test_alert_rules_are_valid_and_each_fires_and_resolves():
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/deps --test installs Debian's prometheus"
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 5 rules found" in check.stdout, check.stdout
    test = subprocess.run(
        [promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True
    )
    assert test.returncode == 0, test.stdout + test.stderr
    # Every shipped alert has a firing and a resolving case in the unit tests.
    text = RULE_TESTS.read_text()
    for alert in (
        "SparkGuardUnitBlockedAtBoot",
        "SparkGuardReserveBreached",
        "SparkGuardNotReporting",
        "SparkGuardIdleServerHoldsGPU",
        "SparkGuardRestartStorm",
    ):
        assert alert in RULES.read_text()
        assert text.count(f"alertname: {alert}") >= 2, alert
