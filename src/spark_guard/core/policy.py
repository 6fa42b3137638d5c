"""decide(snapshot, config) -> Decision: the guard's whole judgement, with no I/O.

Every rule judges one figure, judged(): MemAvailable, or on unified memory the
room a GPU allocation can be given (MemFree, plus the clean page cache the guard
drops for it when it makes room), whichever is lower. "MemAvailable" below means
that figure.

Strict phase (boot, until the rescue units are up plus a grace period): a loader is
stopped before it can take MemAvailable below the reserve, by its expected
footprint or by the trend. Steady phase: act only once MemAvailable is below
the reserve, and only if the config says 'guard'. In every phase a second
loader of a model that is already loaded is refused: a user's copy of a
model root's unit loads, or else the later started of the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from .argv.engines import COMPOSE
from .classify import (
    SHOWN_PATH_MAX,
    classify,
    is_protected,
    launched_containers,
)
from .config import Config, Steady
from .duplicates import duplicates, start_order
from .leaving import leaving, running
from .quantities import format_size
from .snapshot import (
    CONTAINER,
    Action,
    ActionKind,
    Decision,
    FootprintFrom,
    Loader,
    Memory,
    Phase,
    Reason,
    Snapshot,
    StopHow,
    UnitRef,
    judged,
    server_managers,
)
from .text import printable

STRICT = Phase.STRICT
STEADY = Phase.STEADY

# Below this fall rate (bytes/s) a slope is noise, not a loader at work.
_SLOPE_NOISE = 16 * 1024**2


def phase(snapshot: Snapshot, config: Config) -> Phase:
    """'strict' until every present rescue group is active for `grace`, then 'steady'."""
    if snapshot.boot_over:
        return STEADY
    present = [g for g in snapshot.rescue if g.present]
    if not present:
        # Nothing to wait for: protect the boot for one grace period from our start.
        since = snapshot.guard_started
    elif any(g.active_since is None for g in present):
        return STRICT
    else:
        since = max(g.active_since for g in present if g.active_since is not None)
    return STEADY if snapshot.now - since >= config.grace else STRICT


def slope(history: Iterable[tuple[float, int]], window: float, now: float) -> float:
    """Least-squares slope of MemAvailable over the last `window` seconds (bytes/s)."""
    pts = [(t, float(v)) for t, v in history if now - t <= window]
    if len(pts) < 2:
        return 0.0
    mt = sum(t for t, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    if den == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in pts) / den


def _figures(
    snapshot: Snapshot, reserve: int, loader: Loader, **extra: float
) -> dict[str, int | float]:
    memory = snapshot.memory
    figures: dict[str, int | float] = {
        "mem_available": memory.available,
        "mem_total": memory.total,
        "reserve": reserve,
        "unit_rss": loader.seen.rss,
        "unit_gpu": loader.seen.gpu,
    }
    if loader.expected is not None:
        figures["expected"] = loader.expected
    if snapshot.rule.unified and memory.free is not None:
        figures["mem_free"] = memory.free
        figures["file_clean"] = memory.file_clean
        figures["headroom"] = judged(memory, snapshot.rule)
    figures.update(extra)
    return figures


def _growth(loader: Loader, now: float, config: Config) -> float:
    """Its growth; for a young loader measured once (growth 0: no earlier look to compare
    with), its average since it started, when that is more than noise. Without this the
    reserve rule took an old idle loader, bigger, for a new one that was taking it all."""
    seen = loader.seen
    since = seen.active_since
    if seen.growth == 0 and since is not None and 0 < now - since <= 2 * config.trend_window:
        average = seen.used / (now - since)
        if average > _SLOPE_NOISE:
            return average
    return seen.growth


def remaining(loader: Loader) -> int:
    """What a loader with a known footprint has still to take (0 once it holds it all)."""
    if loader.expected is None:
        return 0
    return max(loader.expected - loader.seen.used, 0)


def admit(
    loaders: Iterable[Loader], available: int, reserve: int
) -> tuple[int, list[tuple[Loader, int]]]:
    """The fit rule of the strict phase, for decide() and `spark-guard preflight` alike.

    Loaders whose footprint is known are admitted oldest first while what each has
    still to take leaves MemAvailable at or above the reserve. Returns what the admitted
    will still take (pending), and each refused loader with the MemAvailable it would
    have left. Loaders of unknown footprint are not judged here: the trend guards them.
    """
    pending = 0
    refused = []
    for loader in sorted(loaders, key=start_order):
        if loader.expected is None:
            continue
        left = available - pending - remaining(loader)
        if left < reserve:
            refused.append((loader, left))
        else:
            pending += remaining(loader)
    return pending, refused


def _server_of(client: Loader, servers: list[Loader]) -> Loader | None:
    """The server a client's load lands in: one of the kind it asks, in its own manager;
    for a system client also in the manager of the user it runs as (root's when it runs
    as root). Never another user's from a user's client: a user's unit cannot make the
    guard refuse someone else's server. None when there is none, or more than one."""
    for manager in server_managers(client.ref.manager, client.seen.runs_as):
        found = [s for s in servers if s.ref.manager == manager and s.serves == client.asks]
        if found:
            return found[0] if len(found) == 1 else None
    return None


def charge_clients(
    loaders: tuple[Loader, ...], bases: Mapping[UnitRef, int] | None = None
) -> tuple[Loader, ...]:
    """Each client's load (`lms load`, `ollama run`, a preload) charged to its server.

    The memory of the load appears in the server's unit, so the server is the unit to
    refuse or block: its footprint becomes what it held when the client was first seen
    (`bases`, remembered by step(); now, on that first pass) plus what its clients ask
    it to load, or the admin's figure for it if larger. It carries the clients, named in
    the action, the record and the journal. A charged client carries no footprint of its
    own. A client without a server it could be charged to keeps its own: it is the unit
    refused.
    """
    servers = [ld for ld in loaders if ld.serves]
    charges: dict[UnitRef, list[Loader]] = {}
    for loader in loaders:
        if loader.asks and not loader.serves:
            server = _server_of(loader, servers)
            if server is not None:
                charges.setdefault(server.ref, []).append(loader)
    if not charges:
        return loaders
    charged_to = {c.ref: server for server, cs in charges.items() for c in cs}
    out = []
    for loader in loaders:
        if loader.ref in charges:
            clients = charges[loader.ref]
            asked = [c.expected for c in clients if c.expected is not None]
            if asked:
                base = max((bases or {}).get(c.ref, loader.seen.used) for c in clients)
                loader = replace(
                    loader,
                    expected=max(loader.expected or 0, base + sum(asked)),
                    expected_from=FootprintFrom.CLIENTS,
                )
            loader = replace(loader, clients=tuple(c.ref for c in clients))
        elif loader.ref in charged_to:
            loader = replace(
                loader,
                expected=None,
                expected_from=FootprintFrom.UNKNOWN,
                charged_to=charged_to[loader.ref],
            )
        out.append(loader)
    return tuple(out)


def stop_how(loader: Loader) -> StopHow:
    """How a stop of this loader is done (snapshot.StopHow). A group of a user's processes
    is no unit: killed. A server that loads on request, with no client unit charged to it
    and no load asked by its own unit (ExecStart= or ExecStartPost=: a preload), was asked
    over its API from outside any unit (a curl in an ssh session, anyone's: the API has no
    authentication): the load is the request's, not the unit's, so it is stopped and left
    to start again (loading nothing), never masked or disabled, whoever's server it is."""
    if loader.seen.group:
        return "kill"
    if loader.serves and not loader.asks and not loader.clients:
        return "stop-only"
    return "block"


def decide(snapshot: Snapshot, config: Config) -> Decision:
    reserve = config.reserve_for(snapshot.memory.total)
    current_phase = phase(snapshot, config)
    loaders = charge_clients(
        tuple(
            loader
            for seen in snapshot.units
            if (loader := classify(seen, config, snapshot.guard_unit)) is not None
            and running(seen, snapshot.stopping)
        ),
        snapshot.charge_bases,
    )
    rate = slope(snapshot.history, config.trend_window, snapshot.now)
    rule = snapshot.rule
    if rule.unified and not rule.make_room:
        # No room is made for it: the model's page cache takes MemFree beside its GPU copy.
        loaders = tuple(
            replace(ld, expected=ld.expected + ld.seen.page_cache)
            if ld.expected is not None
            and ld.expected_from == FootprintFrom.ESTIMATE
            and ld.seen.page_cache
            else ld
            for ld in loaders
        )
    available = judged(snapshot.memory, rule)
    floor = config.floor_for(snapshot.memory.total) if rule.unified else 0
    # The figure's name in what the admin reads: on unified memory it is not MemAvailable.
    figure = "device headroom" if rule.unified else "MemAvailable"
    actions: dict[str, Action] = {}

    def act(loader: Loader, reason: Reason, detail: str, **extra: float) -> None:
        key = str(loader.ref)
        if key not in actions:
            kind: ActionKind = "stop"
            if current_phase == STEADY and config.steady == Steady.WARN:
                kind = "warn"
            if loader.clients:
                detail += "; the load asked by " + ", ".join(printable(c) for c in loader.clients)
            how = stop_how(loader)
            if how == "kill":
                detail += f"; {printable(loader.seen.group)}: no unit to mask, its processes die"
            elif how == "stop-only":
                detail += (
                    "; it loads on request and no unit asked this load: stopped, "
                    "not masked or disabled"
                )
            actions[key] = Action(
                kind,
                loader.ref,
                reason,
                detail,
                _figures(snapshot, reserve, loader, **extra),
                since=loader.seen.active_since,
                clients=loader.clients,
                how=how,
            )

    def decision(acts: tuple[Action, ...]) -> Decision:
        return Decision(current_phase, reserve, loaders, acts, rate, rule, available, floor)

    if current_phase == STEADY and config.steady == Steady.OFF:
        return decision(())

    # The same model loaded twice: root's keeps it, else the first started (duplicates.py).
    for loader, model, first, over in duplicates(loaders, snapshot.units):
        act(
            loader,
            Reason.DUPLICATE,
            f"{printable(model, SHOWN_PATH_MAX)} is already loaded by {printable(first.ref)}"
            + ("; root's unit keeps it over a user's copy" if over else ""),
        )

    if current_phase == STRICT:
        _, refused = admit((ld for ld in loaders if str(ld.ref) not in actions), available, reserve)
        for loader, left in refused:
            assert loader.expected is not None  # admit() judges only known footprints
            act(
                loader,
                Reason.FOOTPRINT,
                f"expects {format_size(loader.expected)}, would leave "
                f"{format_size(left)} {'of device headroom' if rule.unified else 'available'}"
                f" (reserve {format_size(reserve)})",
                remaining=remaining(loader),
            )
        # The trend: at this fall rate the reserve is crossed within the horizon. A loader
        # admitted by its footprint is growing as foreseen and is left alone while it stays
        # within it; the trend is for the ones whose size nobody knows, or that outgrew it.
        projected = available + rate * config.trend_horizon
        if rate < -_SLOPE_NOISE and projected < reserve:
            for loader in loaders:
                foreseen = loader.expected is not None and loader.seen.used <= loader.expected
                if loader.seen.growth > 0 and not foreseen:
                    act(
                        loader,
                        Reason.TREND,
                        f"{figure} falling {format_size(-rate)}/s, "
                        f"{format_size(projected)} in {config.trend_horizon:g}s "
                        f"(reserve {format_size(reserve)}); unit growing "
                        f"{format_size(loader.seen.growth)}/s",
                        slope=rate,
                        projected=projected,
                    )

        # After the trend (a grower that drives the figure down is told so): a loader
        # nobody can size (no model or size on its command line, none in
        # [loaders.footprint], its model still being read) grows to at most `unsized`
        # while the rescue window is not yet open: a 115 GB mmap of an unread model raises
        # no trend (its page cache counts as available) until it is too late to fork. One
        # that holds more and grows no more (a server idle with what it loaded) is left
        # to the reserve rule.
        for loader in loaders:
            if (
                loader.expected is None
                and loader.charged_to is None  # its load is its server's
                and loader.seen.used > config.unsized
                and _growth(loader, snapshot.now, config) > 0
            ):
                why = loader.seen.prediction or "nothing on its command line says its size"
                act(
                    loader,
                    Reason.UNSIZED,
                    f"footprint unknown ({printable(why, SHOWN_PATH_MAX)}), holds "
                    f"{format_size(loader.seen.used)} before the rescue window is open "
                    f"([boot] unsized {format_size(config.unsized)}); give it a size in "
                    "[loaders.footprint]",
                )

    if available < reserve:
        # Below the reserve in any phase: free the deficit, growing and biggest first. What
        # is being freed counts against it: the loaders acted on now, and what is leaving.
        deficit = (
            reserve
            - available
            - leaving(snapshot, lambda seen: classify(seen, config, snapshot.guard_unit))
            - sum(ld.seen.used for ld in loaders if str(ld.ref) in actions)
        )
        now = snapshot.now
        by = lambda ld: (_growth(ld, now, config) <= 0, -ld.seen.used)  # noqa: E731
        for loader in sorted(loaders, key=by):
            if deficit <= 0:
                break
            if str(loader.ref) in actions:
                continue
            act(
                loader,
                Reason.RESERVE,
                f"{figure} {format_size(available)} is below the reserve "
                f"{format_size(reserve)}; unit holds {format_size(loader.seen.used)}",
            )
            deficit -= loader.seen.used

    _tie_launchers(snapshot, config, actions)
    return decision(tuple(actions.values()))


def _tie_launchers(snapshot: Snapshot, config: Config, actions: dict[str, Action]) -> None:
    """A container stopped while a unit runs it in the foreground (`docker run --rm
    --name X` under Restart=always) comes back with the unit's next start, as a new
    container of its name: the unit is stopped and blocked with it, for the same reason."""

    # A stop-only container is not blocked: its unit's next start makes one that loads
    # nothing by itself, so the unit is left as it is too.
    # Keyed by whose engine ("" for root's, which any unit's client may drive; a user's
    # manager for her rootless one, which only her own units drive) and name.
    def whose(ref: UnitRef) -> str:
        return "" if ref.manager == CONTAINER else ref.manager

    stopped = {
        (whose(a.unit), a.unit.container): a
        for a in actions.values()
        if a.unit.is_container and a.how == "block"
    }
    if not stopped:
        return
    # A unit that runs `docker compose up` launches every container of its project.
    for seen in snapshot.units:
        action = stopped.get((whose(seen.ref), seen.ref.container))
        if seen.container is not None and seen.container.project and action is not None:
            stopped.setdefault((whose(seen.ref), COMPOSE + seen.container.project), action)
    for seen in snapshot.units:
        if seen.ref.is_container or str(seen.ref) in actions or seen.group:
            continue
        if not seen.ref.name.endswith(".service") or is_protected(
            seen.ref, config, snapshot.guard_unit
        ):
            continue
        for name in launched_containers(seen):
            action = stopped.get(("", name)) or stopped.get((seen.ref.manager, name))
            if action is None:
                continue
            actions[str(seen.ref)] = replace(
                action,
                unit=seen.ref,
                detail=f"it runs {action.unit}, stopped: {action.detail}",
                since=seen.active_since,
                how="block",
                clients=(),
            )
            break


# How fast memory can be filled, as earlyoom assumes it for RAM (6000 MiB/s): a quiet guard
# reads MemAvailable again before a loader this fast, starting on a quiet machine, could
# have taken the headroom and FILL_SLACK of the reserve. On a Spark with 100 GiB free that
# is poll.max; in a 2 GiB VM with 450 MiB free above a 200 MiB reserve, poll.min.
FILL_RATE = 6000 * 1024**2
# The share of the reserve such a loader may take before the next read sees it. The
# reserve is kept for a rescue (sshd, a shell: a few MiB each), not spent at its first
# byte: half of it left is still a machine that answers. Without it, a Spark that holds
# its model 600 MiB above its 8.5 GiB reserve was read ten times a second (poll.min) all
# day, about 0.5 % of a core; with it, about once a second (docs/benchmarks.md). Once the
# figure falls, the fall rate sets the wait and the brake takes over; below the reserve
# every read comes at poll.min, as before.
FILL_SLACK = 0.5


def _fill_wait(figure: int, line: int) -> float:
    """Seconds a loader at FILL_RATE needs to take `figure` past FILL_SLACK of `line`: none
    once the figure is below the line."""
    return (figure - line * (1 - FILL_SLACK)) / FILL_RATE if figure >= line else 0.0


def poll_interval(
    decision: Decision | None,
    snapshot: Snapshot | None,
    config: Config,
    memory: Memory | None = None,
    spent: float = 0.0,
) -> float:
    """Seconds to the next look: a quarter of the time MemAvailable needs to reach
    the reserve at its current fall rate, and no longer than FILL_RATE would need to
    take the headroom and FILL_SLACK of the reserve (on unified memory with make-room,
    also MemFree and FILL_SLACK of the device floor), within [poll.min, poll.strict or
    poll.max]. `memory`: the latest read, when newer than the snapshot's; `spent`: the
    seconds since it was read (a full look's), which the FILL_RATE bound counts."""
    if decision is None or snapshot is None:
        return config.poll_max
    longest = (
        config.poll_max if decision.phase == STEADY else min(config.poll_strict, config.poll_max)
    )
    latest = snapshot.memory if memory is None else memory
    current = judged(latest, decision.rule)
    headroom = max(current - decision.reserve, 0)
    fill = _fill_wait(current, decision.reserve)
    if decision.rule.unified and config.make_room and latest.free is not None:
        # make-room keeps MemFree above the floor (room.py): it needs a read before a
        # page-cache flood as fast could take MemFree that far, whatever the headroom.
        fill = min(fill, _fill_wait(latest.free, decision.floor))
    longest = min(longest, max(fill - spent, config.poll_min))
    if decision.slope >= 0:
        return longest
    return min(max(headroom / -decision.slope / 4, config.poll_min), longest)


FULL_LOOK_EVERY = 60.0  # seconds: the longest a steady guard goes without a full look
_FULL_LOOK_DROP = 256 * 1024**2


def full_look_due(
    memory: Memory, last: Snapshot | None, reserve: int, now: float, *, busy: bool
) -> bool:
    # (MemAvailable below: the judged figure, with the rule of the last look.)
    """Whether this pass must read every process, unit and GPU, or MemAvailable is enough.

    At boot every pass is a full one. After boot a quiet machine costs one read of
    /proc/meminfo per pass: the full look comes back every FULL_LOOK_EVERY seconds, at
    once when MemAvailable fell by a step since the last one, and while a block is
    unfinished (`busy`). A pressure event always brings it. Below twice the reserve
    the step is a quarter of the headroom the last look saw: a machine that holds its
    model near the reserve is read often (FILL_RATE: every poll.min before FILL_SLACK),
    and a full look on each read cost 4 % of a core here, one a second 0.73 %. Nothing
    that did not move brings one (the brake watches each read between looks, and a
    loader that starts must allocate to matter, which moves the figure).
    """
    if last is None or not last.boot_over or busy:
        return True
    if now - last.now >= FULL_LOOK_EVERY:
        return True
    before, current = judged(last.memory, last.rule), judged(memory, last.rule)
    fell = before - current
    if fell >= max(_FULL_LOOK_DROP, memory.total // 100):
        return True
    if current >= 2 * reserve:
        return False
    if current < reserve or before < reserve:
        return True  # below the reserve there is no headroom left to lose: every read
    return fell >= (before - reserve) // 4


# Seconds of MemAvailable the brake takes its fall rate over: the last look or two, so a
# loader that just began is not averaged away by the quiet seconds before it.
BRAKE_WINDOW = 1.0


def brake(
    memory: Memory,
    now: float,
    history: Iterable[tuple[float, int]],
    last: Decision,
    config: Config,
    lookahead: float,
    new: frozenset[UnitRef] = frozenset(),
) -> tuple[UnitRef, ...]:
    """Loaders to freeze at once, on the pass that only read memory, before the full
    look decides: the judged figure (MemAvailable, or the device headroom) is below the
    reserve, or at its fall rate of the last BRAKE_WINDOW it will be within `lookahead`
    seconds (until the guard next reads it).

    The loaders of the last decision that were growing, or that were new in it (no growth
    measured yet). A freeze is no judgement: the full look that follows decides, and what
    it does not block is thawed. None where the decision could not stop anything (the
    steady phase with `steady` other than 'guard').
    """
    if last.phase == STEADY and config.steady != Steady.GUARD:
        return ()
    reserve = config.reserve_for(memory.total)
    available = judged(memory, last.rule)
    if available >= reserve:
        # Over the window, or over the lookahead where reads are further apart than it
        # (a quiet wait near the reserve can be longer than BRAKE_WINDOW: FILL_SLACK), so
        # the read before this one is always in it.
        rate = slope([*history, (now, available)], max(BRAKE_WINDOW, lookahead), now)
        if rate >= -_SLOPE_NOISE or available + rate * lookahead >= reserve:
            return ()
    # A group of a user's processes is no unit a manager can freeze: the full look kills it.
    return tuple(
        ld.ref for ld in last.loaders if (ld.seen.growth > 0 or ld.ref in new) and not ld.seen.group
    )
