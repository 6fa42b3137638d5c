"""`spark-guard rescue`: for the admin with a shell in the first seconds after boot.

Every model loader on every running manager is stopped, masked and disabled
at once, through the same Blocker and records as the daemon's (so
`spark-guard release` undoes it), all in this one process: no fork per unit.
Then it prints what holds: each loader's state on its level, MemAvailable,
the load average and the GPU holders. Running loader containers of the
configured engines are stopped and their restart policy set to `no` the same
way (block/containers.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .. import config as config_mod
from .. import log as log_mod
from ..block.blocker import Blocker
from ..core.block import Step
from ..core.classify import is_protected
from ..core.quantities import format_size
from ..core.snapshot import CONTAINER, Action, Decision, Phase, Reason, UnitRef
from ..core.text import printable as p
from ..system.engine import Container, Engine, EngineError
from ..system.managers import Manager, ManagerError, discover
from ..system.procfs import ProcError, ProcFS
from .inventory import UnitInfo, collect, collect_containers

RESCUE_LOCK_WAIT = 30.0  # seconds: a daemon's pass holds the lock for well under one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stop-timeout", type=float, default=5.0, help="seconds before SIGKILL (default 5)"
    )


def run(args: argparse.Namespace) -> int:
    config = config_mod.load_for_command(args.config)
    if config is None:
        return 2
    config = dataclasses.replace(config, stop_timeout=args.stop_timeout, kill_timeout=2.0)
    try:
        log_mod.configure("journal")
    except (ImportError, OSError):
        log_mod.configure("console", level="error")
    log = log_mod.get_logger()
    proc = ProcFS(config.proc)
    inv = collect(config)
    loaders = [u for u in inv.loaders if not u.from_files]
    managers: dict[str, Manager] = {}
    for key, sock in discover(config.system_manager, config.user_runtime).items():
        m = Manager(key, sock)
        try:
            m.connect()
            managers[key] = m
        except ManagerError as e:
            print(f"spark-guard: {p(e)}", file=sys.stderr)
    try:
        memory = proc.memory()
        figures: dict[str, int | float] = {"mem_available": memory.available}
        why = "stopped by an admin: spark-guard rescue"
        boxes = collect_containers(config)
        for problem in boxes.errors:
            print(f"spark-guard: {p(problem.socket)}: {p(problem.reason)}", file=sys.stderr)
        running = [
            i.container
            for i in boxes.loaders
            if i.container.running
            and not is_protected(UnitRef(CONTAINER, i.container.name), config)
        ]
        engines = {
            UnitRef(CONTAINER, i.container.name): i.engine
            for i in boxes.loaders
            if i.container in running
        }
        actions = tuple(
            Action("stop", u.ref, Reason.RESCUE, why, figures) for u in loaders
        ) + tuple(Action("stop", ref, Reason.RESCUE, why, figures) for ref in engines)
        # A running daemon may be blocking the same units: rescue waits for the store's
        # lock, and then adopts what the daemon's records say.
        blocker = Blocker(managers, config, log, lock_wait=RESCUE_LOCK_WAIT)
        blocker.advance()  # load what is already recorded: a unit blocked before stays as it is
        todo = tuple(
            a
            for a in actions
            if blocker.records.get(str(a.unit)) is None
            or blocker.records[str(a.unit)].step != Step.BLOCKED
        )
        if todo:
            blocker.block(
                todo, Decision(Phase.RESCUE, config.reserve_for(memory.total), (), todo), engines
            )
            blocker.finish(config.stop_timeout + 2 * config.kill_timeout + 1.0)
        ok = _report(loaders, managers, proc, blocker, running)
        return 0 if ok and not boxes.errors else 1
    except ProcError as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 2
    finally:
        for m in managers.values():
            m.close()


def _report(
    loaders: list[UnitInfo],
    managers: dict[str, Manager],
    proc: ProcFS,
    blocker: Blocker,
    boxes: list[Container],
) -> bool:
    ok = True
    print(f"{'UNIT':40} {'LOAD':10} {'ACTIVE':10} BLOCK")
    for u in loaders:
        m = managers.get(u.ref.manager)
        st = m.unit_states([u.ref.name]).get(u.ref.name) if m else None
        record = blocker.records.get(str(u.ref))
        step = record.step if record else "not recorded"
        held = bool(st and st.load_state == "masked" and st.active_state in ("inactive", "failed"))
        ok = ok and held
        # The unit name and the record's problem can hold a user's text: shown inert.
        print(
            f"{p(u.ref):40} {p(st.load_state) if st else '?':10} "
            f"{p(st.active_state) if st else '?':10} {p(step)}"
            + (f"  ({p(record.problem)})" if record and record.problem else "")
        )
    for c in boxes:
        ref = UnitRef(CONTAINER, c.name)
        record = blocker.records.get(str(ref))
        state = record.container if record else None
        try:
            now = Engine(state.engine).inspect(c.id) if state else None
        except EngineError as e:
            now = None
            print(f"spark-guard: {p(e)}", file=sys.stderr)
        held = bool(now and not now.running and now.restart == "no")
        ok = ok and held
        shown = f"restart {now.policy}" if now else "?"
        print(
            f"{p(ref):40} {shown:10} {(now.status if now else '?'):10} "
            f"{p(record.step) if record else 'not recorded'}"
            + (f"  ({p(record.problem)})" if record and record.problem else "")
        )
    if not loaders and not boxes:
        print("no model loaders found on any running manager or engine")
    memory = proc.memory()
    print(
        f"\nMemAvailable {format_size(memory.available)} of {format_size(memory.total)}; "
        f"load average {proc.loadavg()}"
    )
    holders = _gpu_holders()
    print(
        "GPU holders: "
        + (
            ", ".join(f"pid {p} {format_size(b)}" for p, b in holders)
            if holders
            else "none seen (or no NVML)"
        )
    )
    if loaders or boxes:
        print("undo: spark-guard release --all (or one UNIT)")
    return ok


def _gpu_holders() -> list[tuple[int, int]]:
    from ..system.gpu import GpuUnavailable, Nvml

    nvml = Nvml()
    try:
        nvml.start()
        return sorted(((p.pid, p.used or 0) for p in nvml.processes()), key=lambda h: -h[1])
    except GpuUnavailable:
        return []
    finally:
        nvml.stop()
