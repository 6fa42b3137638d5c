"""`spark-guard dump`: sense and decide once, print what the guard sees (acts on nothing)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from .. import config as config_mod
from .. import log as log_mod
from ..core.policy import decide
from ..core.quantities import format_size
from ..core.snapshot import Decision, Memory, Pressure, Snapshot
from ..core.text import printable as p
from ..exits import CANNOT_SAY, USAGE
from ..jsonout import emit
from ..sense import Sensor
from ..system.procfs import ProcError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON document (--json=short: on one line; schemas in docs/json.md)",
    )


# One name per figure across the tools' documents: a unit is "unit", and the figures of
# /proc/meminfo are named as status, audit and preflight name them.
_NAMES = {"ref": "unit"}
_MEMORY_NAMES = {"total": "mem_total", "available": "mem_available", "free": "mem_free"}


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "manager") and hasattr(obj, "name"):
            return str(obj)
        names = _MEMORY_NAMES if isinstance(obj, Memory) else _NAMES
        return {
            names.get(f.name, f.name): _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
        }
    if isinstance(obj, list | tuple):
        return [_plain(x) for x in obj]
    if isinstance(obj, set | frozenset):
        return sorted(_plain(x) for x in obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def _with_pressure(snapshot: dict[str, Any], pressure: Pressure | None) -> dict[str, Any]:
    """The snapshot as dump --json has always shown it: memory PSI after the history.

    The guard decides without PSI, so its Snapshot does not carry it; dump reads it here.
    """
    out: dict[str, Any] = {}
    for key, value in snapshot.items():
        out[key] = value
        if key == "history":
            out["pressure"] = _plain(pressure)
    return out


def run(args: argparse.Namespace) -> int:
    config = config_mod.load_for_command(args.config)
    if config is None:
        return USAGE
    log_mod.configure("console", level="warning")
    sensor = Sensor(config, log_mod.get_logger())
    sensor.wait_for_models = True  # a command waits for model headers (up to their deadline)
    try:
        sensor.refresh_managers()
        managers = sorted(sensor.managers)
        snapshot = sensor.snapshot()
        pressure = sensor.proc.pressure()
    except ProcError as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 1
    finally:
        sensor.close()
    decision = decide(snapshot, config)
    if args.json:
        doc = {
            # 2: "unit" for "ref", the mem_* names, and the clock named.
            "format": 2,
            # Every time in the document (now, history, active_since, guard_started, ...).
            "clock": "CLOCK_MONOTONIC seconds",
            "snapshot": _with_pressure(_plain(snapshot), pressure),
            "decision": _plain(decision),
            "managers": managers,
        }
        emit(doc, args.json)
    else:
        _print(snapshot, decision)
    if not managers:
        # What /proc shows is shown; no unit was seen, which is no "nothing to stop".
        why = f"no manager socket at {config.system_manager} or under {config.user_runtime}"
        print(f"spark-guard: no systemd manager reached, no unit seen ({why})", file=sys.stderr)
        return CANNOT_SAY
    return 0


def _print(snapshot: Snapshot, decision: Decision) -> None:
    m = snapshot.memory
    print(
        f"phase {decision.phase}; MemAvailable {format_size(m.available)} of "
        f"{format_size(m.total)}; reserve {format_size(decision.reserve)}; "
        f"GPU accounting {'on' if snapshot.gpu_accounting else 'off'}"
    )
    print(
        f"MemFree {format_size(m.free or 0)}, clean page cache {format_size(m.file_clean)}, "
        f"dirty {format_size(m.dirty)}, shmem {format_size(m.shmem)}, free in 2 MiB blocks "
        + (format_size(m.huge_free) if m.huge_free is not None else "unknown")
        + (f", pinned {format_size(snapshot.pinned)}" if snapshot.pinned is not None else "")
    )
    if decision.rule.unified:
        print(
            f"unified memory: device headroom {format_size(decision.headroom)} is judged "
            f"(floor {format_size(decision.floor)}; "
            + (
                "MemFree and the clean page cache the guard can drop)"
                if decision.rule.make_room
                else "MemFree alone: no room is made)"
            )
        )
    # Unit names, evidence and details can hold a user's text: printed inert.
    for loader in decision.loaders:
        u = loader.seen
        print(
            f"loader {p(loader.ref)}: {p(u.active_state)}, rss {format_size(u.rss)}, "
            f"gpu {format_size(u.gpu)}, expected "
            f"{format_size(loader.expected) if loader.expected else '-'}; "
            f"{p(', '.join(loader.evidence))}"
        )
    for action in decision.actions:
        print(f"would {action.kind} {p(action.unit)}: {p(action.reason)}: {p(action.detail)}")
