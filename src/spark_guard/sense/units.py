"""What is read of each unit and process, and kept from one reading to the next.

A unit's growth is measured against its last reading; its details (ExecStart=,
Environment=) are asked of its manager once per run; a process's argv is read once
and split once, its mapped models now and then, its real uid at first sight. What
one pass may read and hold of what users control is its PassBudget (caches.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..containers import image_evidence
from ..core.argv.engines import COMPOSE_PROJECT_LABEL, project_name
from ..core.classify import CommandLine
from ..core.snapshot import MAPS_MAX_MODELS, SYSTEM, ContainerFacts, SeenUnit, UnitRef
from ..system.engine import Container
from ..system.managers import ManagerError, UnitDetails
from ..system.procfs import ProcFS
from .asking import DETAILS_OWNER_BUDGET, Later, details_size
from .caches import MAPS_MIN_RSS, MAPS_RECHECK, PassBudget, ProcCache, UnitCache

DETAILS_RETRY = 30.0  # seconds before a unit whose details could not be read is asked again
# A process whose argv is still systemd's own, between its fork and the exec of the unit's
# command (its manager's argv, renamed "(llama-server)" before systemd 255; 255's
# systemd-executor): not kept, or its pid would keep it for life.
TRANSIENT_ARGV0 = ("systemd-executor", "systemd", "init")
# A fork storm of hers puts tens of thousands of processes in one pass: reading them is
# progress, told to the watchdog every so many, or a look slower than WatchdogSec= (her
# storm on a loaded host: seen at 10 s) has the manager abort the guard.
PROGRESS_EVERY = 1024


def out_of_view(ref: UnitRef) -> UnitDetails:
    raise KeyError(ref.manager)


def restarted(cache: UnitCache, pids: tuple[int, ...]) -> bool:
    """None of the processes it had a pass ago: a new run, read afresh."""
    return bool(pids and cache.pids and not (cache.pids & set(pids)))


def details_due(cache: UnitCache, now: float, in_view: bool = True) -> bool:
    """Whether its details are asked of its manager now: never read; unreadable, and
    its retry is due; or seen by the kernel alone so far, and its manager is in view."""
    d = cache.details
    return (
        d is None
        or (bool(d.unreadable) and now >= cache.retry_at)
        or (cache.kernel_view and in_view and now >= cache.read_at)
    )


class UnitReader:
    """The caches of units and processes, and the reading of one unit."""

    def __init__(self, proc: ProcFS, progress: Callable[[], None] = lambda: None) -> None:
        self.proc = proc
        self.progress = progress  # called every PROGRESS_EVERY argv read: the watchdog's
        self.units: dict[UnitRef, UnitCache] = {}
        self.procs: dict[int, ProcCache] = {}

    def fresh(self, pid: int, cgroup: str, rss: int) -> None:
        """Forget what was read of `pid` if it is another process now: its cgroup changed,
        or (a big one, whose figures count) its start time did."""
        pc = self.procs.get(pid)
        if pc is not None and pc.cgroup != cgroup:
            pc = None
        if pc is not None and rss >= MAPS_MIN_RSS and self.proc.start_ticks(pid) != pc.start:
            pc = None
        if pc is None:
            # Its start, once: a big process is compared with it every pass.
            self.procs[pid] = ProcCache(cgroup=cgroup, start=self.proc.start_ticks(pid))

    def uid(self, pid: int, rss: int, *, again: bool = False) -> int | None:
        """The process's real uid (ProcCache.uid says when it is read again)."""
        pc = self.procs.setdefault(pid, ProcCache())
        if pc.uid is None or (pc.uid == 0 and (again or rss >= MAPS_MIN_RSS)):
            pc.uid = self.proc.uid(pid)
        return pc.uid

    def known(self, manager: str, groups: dict[UnitRef, Any], now: float) -> frozenset[str]:
        """The units of `manager` whose details are read and not due again in this pass."""
        return frozenset(
            r.name
            for r, c in self.units.items()
            if r.manager == manager
            and not restarted(c, tuple(p for p, _, _ in groups.get(r, ())))
            and not details_due(c, now)
        )

    def budget(self, groups: dict[UnitRef, Any]) -> PassBudget:
        """A pass's budget, with what the caches of the units still there hold (a unit gone
        since the last pass holds nothing of her budget)."""
        budget = PassBudget()
        for r, c in self.units.items():
            if r in groups:
                held = budget.details_held
                held[r.manager] = held.get(r.manager, 0) + c.details_bytes
        return budget

    def forget(self, groups: dict[UnitRef, Any]) -> None:
        """Drop what was kept of units and processes not seen in this pass."""
        for ref in [r for r in self.units if r not in groups]:
            del self.units[ref]
        live = {pid for procs in groups.values() for pid, _, _ in procs}
        for pid in [p for p in self.procs if p not in live]:
            del self.procs[pid]

    def _read_argv(
        self,
        ref: UnitRef,
        procs: list[tuple[int, int, int | None]],
        cache: UnitCache,
        budget: PassBudget,
        now: float,
        group: str,
    ) -> None:
        """Its processes' argv (read once, split once) and mapped models (now and then),
        the biggest first, within the pass's budget."""
        left = budget.unit(ref.manager)
        # Foreseen from argv and no size known: argv read again when it is foreseen again
        # (a wrapper script that exec'd its server keeps its pid and start time).
        foreseen = cache.prediction
        again = bool(
            (group or cache.kernel_view)
            and cache.predicted
            and (foreseen is None or foreseen.bytes is None)
            and now >= cache.retry_at
        )
        # The biggest first: a loader is what grows; a crowd of small processes is not.
        for pid, p_rss, p_gpu in sorted(procs, key=lambda p: -(p[1] + (p[2] or 0))):
            pc = self.procs.setdefault(pid, ProcCache())
            if pc.reread or again:
                pc.cmdline, pc.reread = None, False  # (its size kept: the budget's memo)
            if (p_rss >= MAPS_MIN_RSS or p_gpu) and budget.hold_maps(ref.manager):
                if now - pc.maps_at >= MAPS_RECHECK and budget.maps_scans > 0:
                    budget.maps_scans -= 1
                    pc.maps_at = now
                    pc.models = self.proc.mapped_models(pid) or ()
            else:
                pc.models = ()  # small, or past its owner's share: not held
            if pc.cmdline is None and left > 0 and pc.argv_bytes <= left:
                # Read whole (a cut one would be kept cut for the process's life); its size
                # is remembered, so one that does not fit is not read again each pass.
                argv = self.proc.cmdline(pid) or ()
                budget.argv_reads += 1
                if not budget.argv_reads % PROGRESS_EVERY:
                    self.progress()
                # Still systemd's between fork and exec? Used, and read again next pass
                # (never dropped: her loader run as `exec -a "(x)"` still shows its -m).
                pc.reread = bool(argv) and (
                    argv[0].startswith("(") or os.path.basename(argv[0]) in TRANSIENT_ARGV0
                )
                pc.cmdline = CommandLine(argv)
                pc.argv_bytes = max(1, sum(len(a) + 1 for a in pc.cmdline))
                was = pc.uid
                if was == 0 and self.uid(pid, p_rss, again=True) != was:
                    # Root's a moment ago (cron's child), a user's now that it runs her
                    # command: not this unit's evidence; the next pass counts it as hers.
                    pc.cmdline, pc.argv_bytes = None, 0
                    continue
            if pc.cmdline is not None and pc.argv_bytes > left:
                pc.cmdline = None  # over the budget now: dropped, read again when it fits
            if pc.cmdline is not None:
                left -= pc.argv_bytes
                budget.spend(ref.manager, pc.argv_bytes)

    def seen(
        self,
        ref: UnitRef,
        procs: list[tuple[int, int, int | None]],
        state: str,
        gpu: dict[int, int | None],
        now: float,
        cgroup: str,
        budget: PassBudget,
        group: str = "",
        *,
        protected: bool = False,
        container: tuple[Container, str] | None = None,
        ask: Callable[[UnitRef], UnitDetails] = out_of_view,
    ) -> SeenUnit:
        """One unit (a container, a group of a user's) as read now: its processes' figures,
        growth since its last reading, its details (ExecStart=, asked of its manager once
        per run: `ask`, which raises KeyError when its manager is out of view), and its
        processes' argv and mapped models, within the pass's `budget`. `protected`: never
        acted on (only its figures are read); `container`: what its engine answered."""
        pids = tuple(p for p, _, _ in procs)
        rss = sum(r for _, r, _ in procs)
        gpu_bytes = sum(g or 0 for _, _, g in procs)
        gpu_pids = tuple(p for p in pids if p in gpu)
        cache = self.units.get(ref)
        if cache is None or restarted(cache, pids):
            cache = self.units[ref] = UnitCache()  # new or restarted: read it afresh
        growth = 0.0
        if cache.at and now > cache.at:
            growth = (rss + gpu_bytes - cache.used) / (now - cache.at)
        cache.pids, cache.used, cache.at = frozenset(pids), rss + gpu_bytes, now

        if not cache.since:
            cache.since = now
        interesting = (ref.name.endswith(".service") or ref.is_container or group) and not protected
        if not interesting:
            return SeenUnit(
                ref, state, pids, rss, gpu_bytes, gpu_pids, growth=growth, cgroup=cgroup
            )
        facts = None
        if container is not None:  # (what an engine answered: only containers are)
            facts = _container(ref, *container, cache, now)
        elif group:
            # No unit, no ExecStart=: its processes' command lines say what it runs, and
            # it became active when the guard first saw it. Not its oldest process's start:
            # she can move an old process of hers into it, or exec the fake from an old
            # shell, and be "first" to any model another user loads.
            if cache.details is None:
                cache.details = UnitDetails((), cache.since)
        elif details_due(cache, now, ask is not out_of_view):
            _read_details(ref, cache, budget, now, ask)
        details = cache.details
        assert details is not None  # (every branch above reads or sets them)
        if cache.commands is None:
            cache.commands = tuple(CommandLine(a) for a in details.exec_start)
        self._read_argv(ref, procs, cache, budget, now, group)
        cmdlines: list[CommandLine] = []
        models: list[str] = []
        for pid, _, _ in procs:
            pc = self.procs[pid]
            if pc.cmdline is not None:
                cmdlines.append(pc.cmdline)
            models.extend(pc.models)
        cache.argv = tuple(cmdlines)
        return SeenUnit(
            ref,
            state,
            pids,
            rss,
            gpu_bytes,
            gpu_pids,
            exec_start=cache.commands,
            cmdlines=tuple(cmdlines),
            mapped_models=tuple(dict.fromkeys(models))[:MAPS_MAX_MODELS],
            active_since=details.active_since,
            growth=growth,
            cgroup=cgroup,
            container=facts,
            group=group,
        )


def _container(
    ref: UnitRef, box: Container, engine: str, cache: UnitCache, now: float
) -> ContainerFacts:
    """What its engine answered of a container, as the decision reads it; its command as
    its ExecStart=."""
    facts = ContainerFacts(
        box.id,
        box.image,
        engine,
        box.restart,
        box.max_retries,
        image_evidence(box.image) or "",
        box.mounts,
        project_name(dict(box.labels).get(COMPOSE_PROJECT_LABEL, "")),
    )
    # Its command as its ExecStart=; it became active when its engine says it
    # started (a guard restarted since must not make it the newer of a duplicate),
    # else when first seen running.
    if cache.details is None:  # once per run: two clocks read each pass would drift
        since = cache.since
        # (Her own engine's word is hers: a StartedAt of 1970 would make her the
        # first to load any model, and another's loader the duplicate stopped.)
        if box.started_at is not None and not ref.engine_owner:
            since = min(since, now - max(0.0, time.time() - box.started_at))
        cache.details = UnitDetails((box.command,), since)
    return facts


def _read_details(
    ref: UnitRef,
    cache: UnitCache,
    budget: PassBudget,
    now: float,
    ask: Callable[[UnitRef], UnitDetails],
) -> None:
    """Its details, asked of its manager, within what the pass may hold of its owner's."""
    held = budget.details_held.get(ref.manager, 0)
    was_kernel_view = cache.kernel_view
    try:
        if ref.manager != SYSTEM and held >= DETAILS_OWNER_BUDGET:
            raise ManagerError(
                f"{ref.manager}: the command lines and environment of its units"
                f" held already are over {DETAILS_OWNER_BUDGET >> 10} KiB: not read"
            )
        answer = ask(ref)
    except Later as e:
        # Her turn in this pass was over (sense/asking.py): asked in the next one.
        if cache.details is None:
            cache.details = UnitDetails((), None, unreadable=str(e))
        cache.retry_at = cache.read_at = now
        return
    except KeyError:
        # Out of view: no ExecStart= to read yet; its processes' argv stand in
        # for it (foresee.py) until its manager answers and it is read again. When
        # it became active is not known until its manager says: it comes after
        # every loader whose start is known (admitted last, the duplicate of any).
        cache.details, cache.kernel_view = UnitDetails((), None), True
    except ManagerError as e:
        # Asked again later (its manager paused or slow, her budget spent): a
        # unit read at a bad moment is not left unread for its whole run. One
        # seen by the kernel so far, its footprint known from its argv, stays
        # so: they go on standing in (else, why is what its footprint says).
        cache.retry_at = cache.read_at = now + DETAILS_RETRY
        known = cache.prediction is not None and cache.prediction.bytes is not None
        if not (was_kernel_view and known):
            cache.details = UnitDetails((), None, unreadable=str(e))
            cache.kernel_view = False
    else:
        if cache.details is not None:  # read again: foreseen again from it
            # (what was foreseen stands until then: a loader admitted by its
            # argv's footprint is never "unknown for now" when its manager answers)
            cache.commands, cache.predicted, cache.foreseen_from = None, False, ()
        cache.details, cache.kernel_view = answer, False
    d = cache.details
    assert d is not None  # (kept from the kernel's view when the read failed)
    cache.details_bytes = details_size(d)
    budget.details_held[ref.manager] = held + cache.details_bytes
