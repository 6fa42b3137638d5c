"""step(state, snapshot, config) -> Outcome: one pass of the guard's judgement, pure.

Everything the guard keeps from one pass to the next is one value, GuardState:
the boot latch, the MemAvailable history the trend is taken over, what was
already done (so an action is not repeated), the loaders already told of and
the loader starts counted. step() takes it with a fresh Snapshot and returns
the next state, the Decision, the events to log and the actions to carry out.
No I/O: the daemon senses, calls step(), hands the stops to the blocker and
logs the events (act.py). The tests replay whole boots as transcripts.

What is not here, and why: the sensor's caches (a unit's last reading, for its
growth; a process's command line) are how a reading is taken, not judgement;
the blocks in flight are the blocker's records, which live on disk so that a
restarted guard finishes them (block/records.py holds their table of steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from .config import Config
from .events import Event, EventKind
from .policy import STEADY, decide
from .quantities import format_size
from .snapshot import (
    Action,
    Decision,
    Foreseen,
    Loader,
    MemoryRule,
    Snapshot,
    UnitRef,
    judged,
)

# Samples of MemAvailable kept for the trend: 600 reads is a minute at poll.min.
HISTORY_MAX = 600
# Loaders whose runs are counted (state.json, the metrics) once gone: the most recent ones
# up to this many. A group of a user's processes is named by its cgroup, which she names:
# its count goes with it, or a user making cgroups would grow the guard without bound.
STARTS_KEPT = 256

# (unit, kind, reason, the run of the unit it was taken on): one action, not repeated.
ActionKey = tuple[str, str, str, float | None]


def _nothing() -> Mapping[Any, Any]:
    return MappingProxyType({})  # read-only: a state is never changed, only replaced


@dataclass(frozen=True)
class GuardState:
    """What the guard remembers between passes. A new value each pass, never changed."""

    # Set once the strict phase has ended: boot does not come back.
    boot_over: bool = False
    # (monotonic time, MemAvailable), oldest first: the trend and the brake read it.
    history: tuple[tuple[float, int], ...] = ()
    # When each action was last taken, for `repeat_after`.
    done: Mapping[ActionKey, float] = field(default_factory=_nothing)
    # Loaders the journal was told of (loader-seen) and that are still there.
    told: frozenset[UnitRef] = frozenset()
    # Those of them told with an unknown footprint: told again once it is known (her
    # manager answered, her wrapper exec'd the server), so the journal's last word holds.
    told_unknown: frozenset[UnitRef] = frozenset()
    # Those told while judged by what the kernel shows (their manager out of view): told
    # again once their manager answers, with what it says (or why it could not be read).
    told_unmanaged: frozenset[UnitRef] = frozenset()
    # The loaders of the last decision, and those in it that were not in the one before:
    # the brake freezes a new loader before any growth of it was measured.
    loaders: frozenset[UnitRef] = frozenset()
    new_loaders: frozenset[UnitRef] = frozenset()
    # Those of them that were groups of a user's processes (named by her cgroups): their
    # run counts go as soon as they are gone.
    groups: frozenset[UnitRef] = frozenset()
    # When each loader's current run began, and how many runs were seen (restart storms).
    started_at: Mapping[UnitRef, float] = field(default_factory=_nothing)
    starts: Mapping[str, int] = field(default_factory=_nothing)
    # What each charged client's server held when the client was first seen asking it:
    # its load comes on top (policy.charge_clients).
    charge_bases: Mapping[UnitRef, int] = field(default_factory=_nothing)
    # Actions taken by kind, and the last one, for state.json, the metrics and STATUS=.
    counts: Mapping[str, int] = field(default_factory=_nothing)
    last_action: str = "none"
    # The rule the history was taken under: a new rule (NVML found unified memory, room can
    # no longer be made) is a new figure, and a fall between two figures is no trend.
    rule: MemoryRule = field(default_factory=MemoryRule)


@dataclass(frozen=True)
class Outcome:
    """What one pass decided: the next state, the Decision, what to log, what to do."""

    state: GuardState
    # The Snapshot as judged: with the remembered history and boot latch in it.
    snapshot: Snapshot
    decision: Decision
    events: tuple[Event, ...]
    # The decision's actions that are new (not repeated within repeat_after).
    taken: tuple[Action, ...]
    # The stops among them for the blocker; none in a dry run (the events say them).
    stops: tuple[Action, ...]


def remember(state: GuardState, now: float, available: int, config: Config) -> GuardState:
    """A read of the judged figure (policy.judged) kept for the trend: twice the trend
    window, at most."""
    keep = max(config.trend_window, 1.0) * 2
    history = [(t, v) for t, v in state.history[-(HISTORY_MAX - 1) :] if now - t <= keep]
    history.append((now, available))
    return replace(state, history=tuple(history))


def step(state: GuardState, snapshot: Snapshot, config: Config, *, dry_run: bool) -> Outcome:
    """One pass: remember the reading, decide, say what is new, take what is new."""
    if snapshot.rule != state.rule:
        state = replace(state, history=(), rule=snapshot.rule)
    state = remember(state, snapshot.now, judged(snapshot.memory, snapshot.rule), config)
    # What the guard remembers is part of what it judges: the trend and the boot latch.
    seen = replace(
        snapshot,
        history=state.history,
        boot_over=state.boot_over,
        charge_bases=state.charge_bases,
    )
    decision = decide(seen, config)
    events: list[Event] = []
    if decision.phase == STEADY and not state.boot_over:
        # Once the rescue units have been up for the grace period, boot is over for good.
        state = replace(state, boot_over=True)
        events.append(
            Event(EventKind.PHASE_CHANGED, "info", "boot phase over: steady", {"phase": STEADY})
        )
    state = _note_loaders(state, decision, events)
    state, events, taken, stops = take(
        state, decision, snapshot.now, config, dry_run=dry_run, events=events
    )
    return Outcome(state, seen, decision, tuple(events), taken, stops)


def take(
    state: GuardState,
    decision: Decision,
    now: float,
    config: Config,
    *,
    dry_run: bool,
    events: list[Event] | None = None,
) -> tuple[GuardState, list[Event], tuple[Action, ...], tuple[Action, ...]]:
    """The decision's actions that are new: not taken on this run of the unit within
    `repeat_after` seconds. A unit that Restart= brought back is a new run, acted on at once.

    Returns the next state, the events (`events` with the new ones added), the actions
    taken and the stops among them (none in a dry run: the events say them)."""
    events = [] if events is None else events
    done = {k: t for k, t in state.done.items() if now - t <= config.repeat_after}
    counts = dict(state.counts)
    last = state.last_action
    taken = []
    for action in decision.actions:
        # A stop only said in a dry run is not a stop done: with dry run off (a reload), it
        # is taken at once, not after repeat_after.
        kind = "dry-run" if dry_run and action.kind == "stop" else action.kind
        key: ActionKey = (str(action.unit), kind, action.reason, action.since)
        # A kill of a group holds nothing down: what she starts again in it is killed on the
        # next pass, not after repeat_after (its start time, first seen, does not change).
        if key in done and not (action.how == "kill" and kind == "stop"):
            continue
        done[key] = now
        events.append(_decision_event(decision, action))
        last = f"{action.kind} {action.unit} ({action.reason})"
        counts[kind] = counts.get(kind, 0) + 1
        taken.append(action)
    stops = tuple(a for a in taken if a.kind == "stop")
    if dry_run:
        events.extend(
            Event(
                EventKind.DRY_RUN,
                "warning",
                f"dry run: would {_WOULD[a.how]} {a.unit}",
                {"unit": str(a.unit), "manager": a.unit.manager, "action": "stop"},
            )
            for a in stops
        )
        stops = ()
    state = replace(
        state,
        done=MappingProxyType(done),
        counts=MappingProxyType(counts),
        last_action=last,
    )
    return state, events, tuple(taken), stops


_WOULD = {"block": "stop, mask and disable", "kill": "kill", "stop-only": "stop (not mask)"}


def _note_loaders(state: GuardState, decision: Decision, events: list[Event]) -> GuardState:
    """Tell each loader once (with why its footprint is unknown), count its runs."""
    told = set(state.told)
    unknown = set(state.told_unknown)
    unmanaged = set(state.told_unmanaged)
    for loader in decision.loaders:
        # While its model is read, the trend guards it; it is told once the read has
        # answered, with the footprint or why there is none: a pass later.
        again = (loader.ref in unknown and loader.expected is not None) or (
            loader.ref in unmanaged and not loader.seen.unmanaged
        )
        if (loader.ref not in told or again) and loader.seen.foreseen is not Foreseen.PENDING:
            told.add(loader.ref)
            unknown.discard(loader.ref)
            unmanaged.discard(loader.ref)
            if loader.expected is None and loader.charged_to is None:
                unknown.add(loader.ref)
            if loader.seen.unmanaged:
                unmanaged.add(loader.ref)
            events.extend(_told(loader))
    refs = frozenset(ld.ref for ld in decision.loaders)
    # A client's base is its server's hold on the pass it was first charged: kept while
    # the client is charged, forgotten with it.
    servers = {ld.ref: ld.seen.used for ld in decision.loaders}
    bases = {
        ld.ref: state.charge_bases.get(ld.ref, servers[ld.charged_to])
        for ld in decision.loaders
        if ld.charged_to is not None and ld.charged_to in servers
    }
    started_at = dict(state.started_at)
    starts = dict(state.starts)
    for loader in decision.loaders:
        since = loader.seen.active_since
        if since is not None and started_at.get(loader.ref) != since:
            started_at[loader.ref] = since
            starts[str(loader.ref)] = starts.get(str(loader.ref), 0) + 1
    for ref in state.groups - refs:
        started_at.pop(ref, None)  # a group gone
        starts.pop(str(ref), None)
    if len(started_at) > STARTS_KEPT:
        gone = sorted((t, r) for r, t in started_at.items() if r not in refs)
        for _, ref in gone[: len(started_at) - STARTS_KEPT]:
            del started_at[ref]
            starts.pop(str(ref), None)
    return replace(
        state,
        told=frozenset(told & refs),
        told_unknown=frozenset(unknown & refs),
        told_unmanaged=frozenset(unmanaged & refs),
        charge_bases=MappingProxyType(bases),
        loaders=refs,
        new_loaders=refs - state.loaders,
        groups=frozenset(ld.ref for ld in decision.loaders if ld.seen.group),
        started_at=MappingProxyType(started_at),
        starts=MappingProxyType(starts),
    )


def _told(loader: Loader) -> list[Event]:
    ref, seen = loader.ref, loader.seen
    out = [
        Event(
            EventKind.LOADER_SEEN,
            "info",
            f"model loader {ref}: {', '.join(loader.evidence)}",
            {
                "unit": str(ref),
                "manager": ref.manager,
                "evidence": loader.evidence,
                "models": loader.models,
                "expected": loader.expected,
                "expected_from": loader.expected_from or None,
                "prediction": seen.prediction or None,
                "starting": seen.starting or None,
                "unit_rss": seen.rss,
                "unit_gpu": seen.gpu,
                "pids": seen.pids,
                "charged_to": str(loader.charged_to) if loader.charged_to else None,
                "unmanaged": seen.unmanaged or None,
            },
        )
    ]
    if seen.unmanaged:
        out[0] = replace(
            out[0],
            msg=f"{out[0].msg}; {seen.unmanaged}: judged by what the kernel shows, and "
            "a block pauses its processes until the manager answers",
        )
    if loader.charged_to is not None:
        # A client: its load is the server's, and the server's footprint says it.
        load = f"{format_size(seen.predicted)} " if seen.predicted is not None else ""
        out[0] = replace(
            out[0],
            msg=f"{out[0].msg}; its load {load}lands in {loader.charged_to}, charged there",
        )
    elif loader.expected is None:
        why = seen.prediction or "no model file or size in its command line"
        out.append(
            Event(
                EventKind.FOOTPRINT_UNKNOWN,
                "warning",
                f"footprint of {ref} unknown ({why}); guarded by the trend, and during"
                " boot by [boot] unsized. Give it a size in [loaders.footprint]",
                {"unit": str(ref), "manager": ref.manager, "error": why},
            )
        )
    return out


def _decision_event(decision: Decision, action: Action) -> Event:
    return Event(
        EventKind.DECISION,
        "warning" if action.kind == "stop" else "info",
        f"{action.kind} {action.unit}: {action.detail}",
        {
            "unit": str(action.unit),
            "manager": action.unit.manager,
            "action": action.kind,
            "reason": action.reason,
            "phase": decision.phase,
            "clients": [str(c) for c in action.clients] or None,
            **action.figures,
        },
    )
