"""`spark-guard audit [UNIT...]`: the whole machine, every level, and what to do about it.

Exit 0: nothing worse than info; 1: a warning or worse; 2: nothing could be
audited (no systemd manager answered: PID 1 is not systemd here, or no right
to its socket) or an error.

Each loader's footprint is shown with the rule it comes from (the prediction's
source: the command line and model read, the defaults taken; or the admin's
[loaders.footprint]), and a client unit with the server its load is charged to.

Loader containers are listed from every engine in `[containers]
engines` (a socket that is not there is passed over; one that fails is one
info line): their restart policy, state and evidence; `always` and
`unless-stopped` are a boot risk, `on-failure` a lesser one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from .. import config as config_mod
from .. import log as log_mod
from ..containers import is_ref
from ..core.quantities import format_size
from ..core.snapshot import Snapshot
from ..core.text import printable as p
from ..exits import CANNOT_SAY
from ..jsonout import emit
from .audit import (
    Footprint,
    container_findings,
    container_protected,
    engine_cli,
    footprints,
    loader_findings,
    memory_findings,
    reconcile,
    unified_findings,
    unlisted_findings,
    unreached_findings,
)
from .findings import Finding, Severity, colours_wanted, label, worst, worst_first
from .inventory import (
    INFINITY,
    ContainerInfo,
    ContainerInventory,
    Inventory,
    collect,
    collect_containers,
    foresee,
    unlisted,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("units", nargs="*", metavar="UNIT", help="also check these units by name")
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON document (--json=short: on one line; schemas in docs/json.md)",
    )


def run(args: argparse.Namespace) -> int:
    from ..sense import sense_once
    from ..system.procfs import ProcError, ProcFS

    config = config_mod.load_for_command(args.config)
    if config is None:
        return 2
    log_mod.configure("console", level="error")
    # container:NAME picks loader containers; the other names are units.
    boxes = [n for n in args.units if is_ref(n)]
    inv = collect(config, [n for n in args.units if not is_ref(n)])
    found = collect_containers(config)
    if boxes:
        listed = {str(i.container.ref) for i in found.loaders}
        found.loaders = [i for i in found.loaders if str(i.container.ref) in boxes]
        inv.missing += [n for n in boxes if n not in listed]
    try:
        snapshot, _, _ = sense_once(config, log_mod.get_logger())
        proc = ProcFS(config.proc)
        meminfo, rss = proc.meminfo(), proc.rss_total()
    except ProcError as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 2
    feet = footprints(inv, foresee(inv, meminfo["MemTotal"]), config)
    holders = sorted(((str(u.ref), u.gpu) for u in snapshot.units if u.gpu), key=lambda h: -h[1])
    gpu_total = sum(u.gpu for u in snapshot.units)
    memory = reconcile(meminfo, rss, gpu_total, snapshot.gpu_accounting)
    findings = (
        loader_findings(inv, config)
        + unlisted_findings(unlisted(snapshot, config, inv.managers))
        + unreached_findings(inv.unreached)
        + container_findings(found, config)
        + memory_findings(memory, holders)
        + unified_findings(snapshot.memory, snapshot.rule, config)
    )
    if not inv.managers:
        # No unit was read: "no findings" would be a clean bill for a machine never examined.
        why = "; ".join(inv.errors) or (
            f"no manager socket at {config.system_manager} or under {config.user_runtime}"
        )
        findings.insert(
            0,
            Finding(
                Severity.CRITICAL,
                "nothing-audited",
                f"no systemd manager reachable, so no running unit was audited ({why})",
                unit="",  # the machine as a whole: null in --json
                fix="run it as root on a machine where systemd is PID 1",
            ),
        )
    if args.json:
        report = _json(inv, findings, memory, holders, feet, found, config)
        report.update(_memory_json(snapshot, config))
        report["format"] = 2  # 2: loaders' "unit", "accounting", the mem_* figures
        emit(report, args.json)
    else:
        _print(inv, findings, memory, holders, feet, found, config, snapshot)
    if not inv.managers:
        return CANNOT_SAY  # nothing was audited: no clean bill, and no usage error either
    return 1 if worst(findings).at_least(Severity.WARNING) else 0


def _memory_json(snapshot: Snapshot, config: config_mod.Config) -> dict[str, Any]:
    """The figures the guard judges, under the names status and preflight give them."""
    m = snapshot.memory
    return {
        "mem_total": m.total,
        "mem_available": m.available,
        "unified": snapshot.rule.unified,
        "make_room": snapshot.rule.make_room,
        "mem_free": m.free,
        "file_clean": m.file_clean,
        "huge_free": m.huge_free,
        "pinned": snapshot.pinned,
        "floor": config.floor_for(m.total) if snapshot.rule.unified else 0,
    }


def _footprint(f: Footprint | None) -> dict[str, Any] | None:
    if f is None:
        return None
    return {
        "bytes": f.bytes,
        "source": f.source,
        "kind": f.kind,
        "rule": f.rule,
        "notes": list(f.notes),
        "charged_to": str(f.charged_to) if f.charged_to else None,
        "clients": [str(c) for c in f.clients],
    }


def _json(
    inv: Inventory,
    findings: list[Finding],
    memory: Any,
    holders: Any,
    feet: dict[Any, Footprint] | None = None,
    found: ContainerInventory | None = None,
    config: config_mod.Config | None = None,
) -> dict[str, Any]:
    def unit(u: Any) -> dict[str, Any]:
        d = {"unit": str(u.ref), **dataclasses.asdict(u)}
        del d["ref"]
        d["memory_max"] = None if u.memory_max >= INFINITY else u.memory_max
        return d

    def loader(u: Any) -> dict[str, Any]:
        return {**unit(u), "footprint": _footprint((feet or {}).get(u.ref))}

    return {
        "managers": inv.managers,
        "loaders": [loader(u) for u in inv.loaders],
        "failed": [unit(u) for u in inv.failed],
        "lingering": [dataclasses.asdict(x) for x in inv.lingering],
        "missing": inv.missing,
        "findings": [f.as_json() for f in findings],
        # What the memory in use is made of (MemTotal - MemAvailable, by whom).
        # (MemTotal is mem_total, beside it: one name per figure.)
        "accounting": {
            **{k: v for k, v in dataclasses.asdict(memory).items() if k != "total"},
            "probably": memory.probably,
        },
        "gpu_holders": [{"unit": u, "bytes": b} for u, b in holders],
        "containers": [
            _container(c, config or config_mod.Config()) for c in (found.loaders if found else [])
        ],
    }


def _container(info: ContainerInfo, config: config_mod.Config) -> dict[str, Any]:
    c = info.container
    return {
        "unit": p(c.ref),
        "engine": p(info.engine),
        "id": c.id,
        "name": p(c.name),
        "image": p(c.image),
        "restart": p(c.policy),
        "running": c.running,
        "status": p(c.status),
        "command": c.shown_command(),
        "evidence": [p(e) for e in info.evidence],
        "protected": container_protected(info, config),
    }


def _table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _print(
    inv: Inventory,
    findings: list[Finding],
    memory: Any,
    holders: Any,
    feet: dict[Any, Footprint] | None = None,
    found: ContainerInventory | None = None,
    config: config_mod.Config | None = None,
    snapshot: Snapshot | None = None,
) -> None:
    # Unit names, states, model paths and the findings built from them can hold a user's
    # text: everything shown goes through p(), so nothing of theirs acts on the terminal.
    print(f"managers: {p(', '.join(inv.managers) or 'none reachable')}")
    if inv.lingering:
        print(
            "linger: "
            + ", ".join(
                f"{p(x.user)} ({'manager running' if x.running else 'manager not running'})"
                for x in inv.lingering
            )
        )
    if inv.loaders:
        print("\nmodel loaders:")
        rows = [["UNIT", "ENABLED", "ACTIVE", "MemoryMax", "Restart", "MODEL"]]
        for u in inv.loaders:
            from ..core.classify import model_files

            models = model_files(u.exec_start)
            rows.append(
                [
                    p(u.ref) + (" (files)" if u.from_files else ""),
                    p(u.file_state or "-"),
                    p(u.active_state),
                    "-" if u.memory_max >= INFINITY else format_size(u.memory_max),
                    p(u.restart),
                    p(models[0]) if models else "-",
                ]
            )
        _table(rows)
        _print_footprints(inv, feet or {})
    if found is not None:
        _print_containers(found, config or config_mod.Config())
    print(
        f"\nmemory: used {format_size(memory.used)} = processes' RSS {format_size(memory.rss)}"
        + (
            f" + GPU (NVML) {format_size(memory.gpu)}"
            if memory.gpu_accounting
            else " + GPU (not counted: no NVML)"
        )
        + f" + kernel {format_size(memory.kernel)}"
        f" + unaccounted {format_size(memory.gap)} ({memory.probably})"
    )
    if snapshot is not None and snapshot.rule.unified and snapshot.memory.free is not None:
        m = snapshot.memory
        print(
            f"unified memory: a GPU allocation gets MemFree {format_size(m.free or 0)}; "
            f"clean page cache {format_size(m.file_clean)}; free in 2 MiB blocks "
            + (format_size(m.huge_free) if m.huge_free is not None else "unknown")
            + f"; device floor {format_size((config or config_mod.Config()).floor_for(m.total))}"
        )
    if holders:
        print("GPU holders: " + ", ".join(f"{p(u)} {format_size(b)}" for u, b in holders))
    if not findings:
        print("\nno findings")
        return
    print(f"\nfindings ({len(findings)}):")
    colour = colours_wanted(sys.stdout)
    for f in sorted(findings, key=worst_first):
        print(
            f"  {label(f.severity, colour=colour)} {f.code:18} {p(f.unit or '-')}: {p(f.message)}"
        )
        print(f"  {'':8} {'':18} fix: {p(f.fix)}")


def _print_footprints(inv: Inventory, feet: dict[Any, Footprint]) -> None:
    """One line per loader: what the guard would expect of it, and the rule it comes from."""
    print("\nfootprints (what the guard expects, and by which rule):")
    rows = []
    for u in inv.loaders:
        f = feet.get(u.ref)
        if f is None:
            continue
        if f.charged_to is not None:
            size = "-"
            said = f"charged to {f.charged_to}, whose process the load lands in: {f.source}"
        else:
            size = format_size(f.bytes) if f.bytes is not None else "unknown"
            said = f.source
            if f.clients:
                said += "; with the loads of " + ", ".join(str(c) for c in f.clients)
        if f.rule and f.rule not in f.source:
            said += f" [rule: {f.rule}]"
        rows.append([p(u.ref), size, p(said)])
    for row in rows:
        print(f"  {row[0]}  {row[1]}  {row[2]}")


def _print_containers(found: ContainerInventory, config: config_mod.Config) -> None:
    """Each engine that answered: its loader containers, or that it has none."""
    for socket in found.engines + [e.socket for e in found.errors]:
        loaders = [c for c in found.loaders if c.engine == socket]
        where = f"{engine_cli(socket).split()[0]} at {p(socket)}"
        if not loaders:
            if socket in found.engines:
                print(f"\nloader containers ({where}): none")
            continue
        print(f"\nloader containers ({where}):")
        rows = [["CONTAINER", "IMAGE", "RESTART", "STATE", "EVIDENCE"]]
        for info in loaders:
            c = info.container
            rows.append(
                [
                    p(c.ref) + (" (protected)" if container_protected(info, config) else ""),
                    p(c.image or "-"),
                    p(c.policy),
                    p(c.status or ("running" if c.running else "stopped")),
                    p(" ".join(info.evidence)),
                ]
            )
        _table(rows)
