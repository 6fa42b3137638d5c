"""`spark-guard rescue`: for the admin with a shell in the first seconds after boot.

Every model loader of PID 1's, and every user's that runs, starts or stops, is
stopped, masked and disabled at once, PID 1's first, through the same Blocker
and records as the daemon's (so `spark-guard release` undoes it), all in this
one process: no fork per unit.
Then it prints what holds: each loader's state on its level, MemAvailable,
the load average and the GPU holders. Running loader containers of the
configured engines are stopped and their restart policy set to `no` the same
way (block/containers.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING

from .. import config as config_mod
from .. import log as log_mod
from ..block.blocker import Blocker
from ..core.attribution import in_her_tree
from ..core.block import Step
from ..core.classify import is_protected
from ..core.config import Config
from ..core.quantities import format_size
from ..core.snapshot import (
    CONTAINER,
    SYSTEM,
    Action,
    Decision,
    Loader,
    Phase,
    Reason,
    UnitRef,
    manager_uid,
)
from ..core.text import printable as p
from ..sense import Sensor
from ..system import cgroupfs
from ..system.connecting import connect_all
from ..system.engine import Container, Engine, EngineError
from ..system.managers import Manager, discover
from ..system.procfs import ProcError, ProcFS
from .inventory import UnitInfo, collect, collect_containers, unlisted

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

RESCUE_LOCK_WAIT = 30.0  # seconds: a daemon's pass holds the lock for well under one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stop-timeout",
        type=_seconds,
        default=5.0,
        help="seconds before SIGKILL, more than 0 (default 5)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be stopped; change nothing"
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text}: must be more than 0 and at most 3600")
    return value


def run(args: argparse.Namespace) -> int:
    config = config_mod.load_for_command(args.config, or_defaults=True)
    if config is None:
        return 2
    config = dataclasses.replace(config, stop_timeout=args.stop_timeout, kill_timeout=2.0)
    if os.geteuid() != 0:
        # Without root nothing can be stopped or masked: no false all-clear.
        print(
            "spark-guard rescue: needs root (it stops units through each manager's private "
            "socket and lays their masks); nothing was checked",
            file=sys.stderr,
        )
        return 1
    try:
        log_mod.configure("journal")
    except (ImportError, OSError):
        log_mod.configure("console", level="error")
    log = log_mod.get_logger()
    proc = ProcFS(config.proc)
    inv = collect(config)
    loaders = sorted((u for u in inv.loaders if _now(u)), key=lambda u: u.ref.manager != SYSTEM)
    # Those that did not answer (or were not believed): what was not checked.
    managers, unreached = connect_all(discover(config.system_manager, config.user_runtime))
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
        # A manager whose units could not all be listed is judged by what the kernel shows.
        listed = [key for key in managers if key in inv.managers]
        unreached += [f"{k}: its units could not all be listed" for k in set(managers) - {*listed}]
        stopped = {u.ref for u in loaders}
        groups = tuple(g for g in _unlisted(config, log, listed) if g.ref not in stopped)
        actions = (
            tuple(Action("stop", u.ref, Reason.RESCUE, why, figures) for u in loaders)
            + tuple(Action("stop", ref, Reason.RESCUE, why, figures) for ref in engines)
            + tuple(Action("stop", g.ref, Reason.RESCUE, why, figures, how="kill") for g in groups)
        )
        if args.dry_run:
            return _dry_run(actions, groups, bool(managers), unreached)
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
            reserve = config.reserve_for(memory.total)
            blocker.block(todo, Decision(Phase.RESCUE, reserve, groups, todo), engines)
            blocker.finish(config.stop_timeout + 2 * config.kill_timeout + 1.0)
        ok = _report(loaders, managers, proc, blocker, running, groups, reached=bool(managers))
        for why in dict.fromkeys(unreached):
            print(f"spark-guard: not reached: {p(why)}", file=sys.stderr)
        return 0 if ok and not boxes.errors and not unreached else 1
    except ProcError as e:
        print(f"spark-guard: {e}", file=sys.stderr)
        return 2
    finally:
        for m in managers.values():
            m.close()


def _unlisted(
    config: Config, log: FilteringBoundLogger, reached: Collection[str]
) -> tuple[Loader, ...]:
    """Loaders no manager reached lists (inventory.unlisted): a user's processes in a
    cgroup of her own, in her scope, her job in a system unit (SeenUnit.group), and the
    units of a user whose manager is out of view. The kernel shows them, as it shows
    the daemon; they are killed in her subtree, the daemon's kill for a manager it
    cannot reach."""
    # What the kernel shows is enough: no NVML, no engines (their containers are asked
    # above), no model read (every loader is stopped, whatever its footprint).
    sensor = Sensor(dataclasses.replace(config, gpu=False, containers=False), log)
    try:
        sensor.refresh_managers()
        snap = sensor.snapshot(rescue=False)
    finally:
        sensor.close()
    return unlisted(snap, config, reached)


def _report(
    loaders: list[UnitInfo],
    managers: dict[str, Manager],
    proc: ProcFS,
    blocker: Blocker,
    boxes: list[Container],
    groups: tuple[Loader, ...] = (),
    *,
    reached: bool = True,
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
    ok = _killed(groups, proc, blocker.kernel.root) and ok
    if not reached:
        ok = False
        print("no systemd manager could be reached: no unit was checked")
    elif not loaders and not boxes and not groups:
        print("no model loaders found on the managers and engines reached")
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
    if any(g.seen.group for g in groups):
        print(
            "killed processes that are no unit: nothing to undo; their owners may start them again"
        )
    for manager in sorted({g.ref.manager for g in groups if not g.seen.group}):
        print(
            f"{p(manager)}: its manager is out of view: its loaders were killed, not masked, "
            "and it may start them again; the guard blocks them once it answers"
        )
    return ok


def _now(unit: UnitInfo) -> bool:
    """A loader rescue stops: every one of PID 1's (only root writes its unit files), and
    a user's that is not inactive or failed (running, starting, stopping). A user's
    unit file that never runs is left to the daemon: her thousands of them were each
    stopped, masked and recorded (issue 40, H9), and rescue ran out of time before her
    running loader."""
    if unit.from_files:
        return False
    return unit.ref.manager == SYSTEM or unit.active_state not in ("inactive", "failed")


def _dry_run(
    actions: tuple[Action, ...], groups: tuple[Loader, ...], reached: bool, unreached: list[str]
) -> int:
    """What rescue would do; 1 when something was not reached or cannot be held."""
    for a in actions:
        would = "stop, mask and disable"
        if a.how == "kill":
            would = f"kill ({_why_unmasked(a.unit, groups)})"
        if a.unit.is_container:
            would = "stop, restart policy no"
        print(f"would {would}: {p(a.unit)}")
    if not reached:
        print("no systemd manager could be reached: no unit was checked")
    elif not actions:
        print("nothing to stop on the managers and engines reached")
    for why in dict.fromkeys(unreached):
        print(f"spark-guard: not reached: {p(why)}", file=sys.stderr)
    out_of_view = any(not g.seen.group for g in groups)
    return 0 if reached and not unreached and not out_of_view else 1


def _killed(groups: tuple[Loader, ...], proc: ProcFS, root: str) -> bool:
    """A row per loader killed, not blocked (no unit to mask, or its manager out of view):
    what of its owner is left in its cgroup. True when none is, and each was a group: a
    unit of a manager out of view is not held, since its manager may run it again."""
    ok = True
    for g in groups:
        uid = manager_uid(g.ref.manager)
        hers = uid is not None and in_her_tree(g.seen.cgroup, uid)
        owners = [proc.uid(pid) for pid in cgroupfs.pids(root, g.seen.cgroup)]
        left = [o for o in owners if o == uid or (hers and o not in (0, None))]
        ok = ok and not left and bool(g.seen.group)
        shown = f"{len(left)} left" if left else "killed"
        kind = "no unit" if g.seen.group else "unreached"
        print(f"{p(g.ref):40} {kind:10} {shown:10} {_why_unmasked(g.ref, groups)}")
    return ok


def _why_unmasked(ref: UnitRef, groups: tuple[Loader, ...]) -> str:
    """Why a loader of `groups` is killed and not masked: what it is, in printable text."""
    seen = next(g.seen for g in groups if g.ref == ref)
    return p(seen.group or "its manager is out of view: no mask until it answers")


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
