"""`spark-guard doctor`: gather the evidence (NVML, /dev, sysfs, logs, loaders), judge, print.

Needs no root: where a right is missing (other users' journals, /dev/kmsg,
the NVIDIA devices) it says so in the report and goes on. Exit status by the
worst finding: 0 ok or info, 1 warning, 2 critical; 3 when it cannot run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ... import config as config_mod
from ...core.attribution import unit_of_cgroup
from ...core.classify import expected_footprint
from ...core.config import Config
from ...core.text import printable
from ...foresight.predict import Predictor, parse_environment
from ...jsonout import emit
from ...system import gpu as gpu_mod
from ...system.procfs import ProcError, ProcFS
from ..findings import colours_wanted, label
from ..inventory import Inventory, collect
from . import logscan
from .judge import STEPS, Evidence, LoaderBudget, Report, judge

AUTOSTART = ("enabled", "enabled-runtime", "linked", "alias")


def _nvidia_pci(sysfs: str) -> int:
    root = Path(sysfs) / "bus" / "pci" / "devices"
    count = 0
    try:
        for dev in root.iterdir():
            try:
                if (dev / "vendor").read_text().strip() == "0x10de":
                    count += 1
            except OSError:
                continue
    except OSError:
        return 0
    return count


def _persistenced() -> str:
    # systemctl, over the system bus, not the Manager class: PID 1's private socket is
    # root's, and doctor must work for any user.
    try:
        out = subprocess.run(
            [
                "systemctl",
                "show",
                "-p",
                "LoadState",
                "-p",
                "ActiveState",
                "nvidia-persistenced.service",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    props = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    if props.get("LoadState") == "not-found":
        return "not-found"
    return props.get("ActiveState", "unknown")


def _budgets(inv: Inventory, config: Config, mem_total: int) -> list[LoaderBudget]:
    predictor = Predictor()
    out = []
    for info in inv.loaders:
        own = expected_footprint(info.ref, config)
        expected: int | None
        if own is not None:
            expected, source = own, "[loaders.footprint] in the config"
        else:
            p = predictor.predict(info.exec_start, parse_environment(info.environment), mem_total)
            expected, source = (
                (None, "not a loader command line spark-guard knows")
                if p is None
                else (p.bytes, p.source)
            )
        out.append(LoaderBudget(str(info.ref), expected, source, info.file_state in AUTOSTART))
    return out


def _unit_of_pids(proc: ProcFS, pids: set[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        cgroup = proc.cgroup(pid)
        unit = unit_of_cgroup(cgroup, "/") if cgroup else None
        if unit:
            out[pid] = unit
    return out


def gather(config: Config, since: str, directory: str | None, kmsg: str) -> Evidence:
    facts = gpu_mod.inspect()
    logs = logscan.read(since, kmsg=kmsg, directory=directory)
    inv = collect(config)
    proc = ProcFS(config.proc)
    try:
        mem_total = proc.memory().total
    except ProcError:
        mem_total = 0
    try:
        meminfo = proc.meminfo()
    except ProcError:
        meminfo = {}
    pids = {p.pid for p in facts.processes}
    return Evidence(
        gpu=facts,
        nvidiactl=os.path.exists(os.path.join(config.dev, "nvidiactl")),
        nvidia_pci=_nvidia_pci(config.sysfs),
        persistenced=_persistenced(),
        logs=tuple(logs.lines),
        log_limits=tuple(logs.limits + [e for e in inv.errors if e not in inv.unreached]),
        unreached=tuple(inv.unreached),
        loader_units=frozenset(str(u.ref) for u in inv.loaders),
        loader_names=config.loader_patterns + config.loader_binaries,
        budgets=tuple(_budgets(inv, config, mem_total)),
        mem_total=mem_total,
        reserve=config.reserve_for(mem_total),
        unit_of_pid=_unit_of_pids(proc, pids),
        mem_free=meminfo.get("MemFree", 0),
        mem_available=meminfo.get("MemAvailable", 0),
        file_cache=meminfo.get("Active(file)", 0) + meminfo.get("Inactive(file)", 0),
        huge_free=proc.huge_free(),
        floor=config.floor_for(mem_total),
    )


def _print(report: Report) -> None:
    print(f"classification: {printable(report.kind)}")
    colour = colours_wanted(sys.stdout)
    for step in STEPS:
        findings = [f for f in report.findings if f.step == step]
        if not findings:
            continue
        print(f"\n{step}:")
        for f in findings:
            # Evidence quotes the journal and the kernel log (any user's text), messages name
            # units: all shown inert, one line each.
            print(f"  {label(f.severity, colour=colour)} {printable(f.message)}")
            for line in f.evidence:
                print(f"  {'':8} | {printable(line)}")
            if f.fix:
                print(f"  {'':8} next: {printable(f.fix)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--since",
        default="24h ago",
        help="how far back to read the logs, as journalctl --since takes it",
    )
    parser.add_argument(
        "--directory", help="read the journal files in this directory (a rescued disk's)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON document (--json=short: on one line; schemas in docs/json.md)",
    )


def _bad_argument(args: argparse.Namespace) -> str | None:
    """What is wrong with --directory or --since, before any log is read: a run over a
    journal that is not there, or from a time that is none, is no clean run."""
    if args.directory is not None and not os.path.isdir(args.directory):
        return f"--directory {printable(args.directory)}: no such directory"
    if shutil.which("journalctl") is None:
        return None
    where = ["--directory", args.directory] if args.directory else []
    try:
        probe = subprocess.run(
            ["journalctl", "--no-pager", "-q", "-n", "0", "--since", args.since, *where],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        return None  # the reads say it
    if probe.returncode != 0 and "timestamp" in probe.stderr.lower():
        return (
            f"--since {printable(args.since)}: not a time journalctl reads "
            '(e.g. "24h ago", -1h, "2026-12-01 08:00", yesterday)'
        )
    return None


def run(args: argparse.Namespace) -> int:
    config = config_mod.load_for_command(args.config)
    if config is None:
        return 2
    bad = _bad_argument(args)
    if bad is not None:
        print(f"spark-guard doctor: {bad}", file=sys.stderr)
        return 2
    report = judge(gather(config, args.since, args.directory, config.kmsg))
    if args.json:
        out: dict[str, Any] = {
            "classification": report.kind,
            "worst": report.worst,
            "findings": [f.as_json() for f in report.findings],
        }
        emit(out, args.json)
    else:
        _print(report)
    return report.exit_code
