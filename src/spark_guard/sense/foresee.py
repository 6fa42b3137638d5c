"""Each loader's footprint before it allocates: from its unit's ExecStart= (or its
processes' argv where it has none to read), its container's command, or its client's
server; the model files read off the loop, with the owner's rights (foresight/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..core.argv.servers import OLLAMA
from ..core.snapshot import Foreseen, SeenUnit, UnitRef
from ..foresight.clients import ServerUnit, predict_client
from ..foresight.containers import predict_container
from ..foresight.predict import Prediction, Predictor, owner_of, parse_environment
from ..system.engine import Container
from .caches import UnitCache, smaller

FORESEE_RETRY = 5.0  # seconds before a footprint found unknown is foreseen again


def _ollama_servers(caches: dict[UnitRef, UnitCache]) -> list[ServerUnit]:
    """The Ollama server units seen: asked only for a unit not yet foreseen (a quiet
    machine's full look, every unit foreseen long ago, never walks the caches for it)."""
    return [
        ServerUnit(
            ref.manager,
            c.argv if c.kernel_view else c.details.exec_start,
            parse_environment(c.details.environment),
            c.details.user,
        )
        for ref, c in caches.items()
        if c.details is not None
        and any(ln.serves == OLLAMA for ln in (c.argv if c.kernel_view else c.commands or ()))
    ]


def foresee(
    units: list[SeenUnit],
    caches: dict[UnitRef, UnitCache],
    containers: dict[UnitRef, tuple[Container, str]],
    predictor: Predictor,
    mem_total: int,
    now: float,
    *,
    wait: bool,
) -> list[SeenUnit]:
    """Each loader's footprint before it allocates, once per run of its ExecStart=
    (the command line and the model's header do not change under it); from its
    processes' argv while it has none to read, again whenever they change. Models are
    read off the loop, with the unit owner's rights (foresight/predict.py): while a
    read is on, the prediction is pending (None: the trend guards the unit, and the
    strict phase's `unsized` bound) and the next pass asks again; the loop
    never waits for it. After every unit of the pass is seen: a client's load
    (foresight/clients.py) is looked up in its Ollama server unit's files."""
    out = []
    memo: list[list[ServerUnit]] = []

    def servers() -> list[ServerUnit]:  # asked at most once a pass, and only if needed
        if not memo:
            memo.append(_ollama_servers(caches))
        return memo[0]

    for seen in units:
        cache = caches.get(seen.ref)
        if cache is None or cache.details is None:
            out.append(seen)
            continue
        if seen.ref in containers:
            box = containers[seen.ref][0]
            _foresee_container(seen.ref, box, cache, predictor, mem_total, now, wait)
        elif cache.details.unreadable:
            # Said where a loader's footprint is: why its unit gave no command line
            # (read again after DETAILS_RETRY, and foreseen again then).
            cache.prediction = Prediction(None, cache.details.unreadable)
            cache.predicted = True
        else:
            _foresee_unit(seen, cache, predictor, mem_total, now, servers, wait)
        out.append(_with(seen, cache.prediction))
    return out


def _with(seen: SeenUnit, p: Prediction | None) -> SeenUnit:
    """The unit with its footprint foreseen (as it was, if none)."""
    if p is None:
        return seen
    foreseen = (
        Foreseen.PENDING
        if p.pending
        else Foreseen.KNOWN
        if p.bytes is not None
        else Foreseen.UNKNOWN
    )
    return replace(
        seen,
        predicted=p.bytes,
        prediction=p.source,
        foreseen=foreseen,
        runs_as=p.runs_as,
        page_cache=p.page_cache,
    )


def _foresee_container(
    ref: UnitRef,
    box: Container,
    cache: UnitCache,
    predictor: Predictor,
    mem_total: int,
    now: float,
    wait: bool,
) -> None:
    """A container's footprint: its command, with the model found through its bind mounts,
    as root reads it (a rootless one's as she does), never through a symlink
    (foresight/containers.py). Unknown: foreseen again, never left for a whole run."""
    p = cache.prediction
    if p is not None and p.bytes is None and now >= cache.retry_at:
        cache.predicted = False
    if not cache.predicted:
        owner = ref.engine_owner or None
        cache.prediction = predict_container(predictor, box, mem_total, wait=wait, owner=owner)
        cache.predicted = cache.prediction is None or not cache.prediction.pending
        cache.retry_at = now + FORESEE_RETRY


def _foresee_unit(
    seen: SeenUnit,
    cache: UnitCache,
    predictor: Predictor,
    mem_total: int,
    now: float,
    servers: Callable[[], list[ServerUnit]],
    wait: bool,
) -> None:
    """A unit's or group's footprint from its ExecStart=, or from its processes' argv
    where it has none to read (a group; a unit whose manager is out of view), or where
    its ExecStart= says no size (a wrapper script). No "unknown" is kept for a whole
    run: foreseen again every FORESEE_RETRY (a client's server seen since, a model
    file laid down after its unit started), and, from argv, whenever they change (a
    wrapper exec'd its server; a process added that names a bigger model: the larger
    figure stands)."""
    argv_only = bool(seen.group) or cache.kernel_view
    argv = tuple(sorted(set(seen.cmdlines)))
    old = cache.prediction
    sized = old is not None and old.bytes is not None
    changed = argv != cache.foreseen_from and (argv_only or not sized)
    unknown = old is not None and old.bytes is None and now >= cache.retry_at
    if changed or unknown:
        cache.predicted = False
    if cache.predicted or not (seen.cmdlines or not argv_only):
        return
    details = cache.details
    assert details is not None
    env = parse_environment(details.environment)

    def predict(lines: tuple[tuple[str, ...], ...]) -> Prediction | None:
        manager = seen.ref.manager
        client = predict_client(
            predictor,
            lines,
            env,
            mem_total,
            manager=manager,
            user=details.user,
            servers=servers(),
            wait=wait,
        )
        return client or predictor.predict(
            lines, env, mem_total, owner=owner_of(manager), wait=wait
        )

    # A group has no ExecStart=, nor has a unit whose manager is out of view yet:
    # its processes' command lines, as read, with its owner's rights.
    new = predict(seen.cmdlines if argv_only else details.exec_start)
    cache.foreseen_from = argv
    if not argv_only and (new is None or new.bytes is None) and seen.cmdlines:
        by_argv = predict(seen.cmdlines)  # ExecStart= a script: what it exec'd says
        if by_argv is not None and (by_argv.bytes is not None or by_argv.pending):
            new = by_argv
    if new is not None and new.pending and old is not None and old.bytes is not None:
        return  # read again: the footprint known stands meanwhile
    if argv_only and new is not None and smaller(new, old):
        new = old  # argv changed: never smaller than what one of them named
    cache.prediction = new
    cache.predicted = new is None or not new.pending
    cache.retry_at = now + FORESEE_RETRY
