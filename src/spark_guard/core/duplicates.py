"""The same model loaded twice: who keeps it, and who is the second copy.

Root's units (PID 1's, root's own manager's, root's engine's containers) keep a
model over any user's, so that no user who started first takes over the admin's
loader; then a user's job that a service of root's runs for her by name (H11 of
issue 40: `ExecStart=runuser -u bob -- llama-server -m X`, the admin's server run
as a login-range uid, is split off its unit as bob's job, and lost its model to a
user's earlier copy); then everyone else. Within each, the one started first.
Loaded means mapped, or given to a known loader: a path merely named (`sleep
infinity /srv/models/x.gguf`) is no load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .attribution import ROOTS
from .classify import command_line, loaded_models
from .snapshot import CONTAINER, Loader, SeenUnit, UnitRef

# Words before the loader on a line of root's unit that runs it as a user (`sudo -u bob
# -E --`, `runuser -u bob --`, `setpriv --reuid=... --`): looked at up to this many.
_WRAPPER_WORDS = 8


def start_order(loader: Loader) -> tuple[float, str]:
    since = loader.seen.active_since
    return (since if since is not None else float("inf"), str(loader.ref))


def roots(loader: Loader) -> bool:
    """A loader of root's: a unit of PID 1 or of root's own manager, or a container of an
    engine of root's (its peer is checked, system/engine.py). A user's rootless
    container is hers."""
    return loader.ref.manager in (CONTAINER, *ROOTS)


def _run_by_root(loader: Loader, model: str, units: Mapping[UnitRef, SeenUnit]) -> bool:
    """A user's job that a service of root's runs by name: a line of its ExecStart= gives
    this model to a known loader behind a command that changes user."""
    within = loader.seen.within
    host = units.get(within) if within is not None else None
    if host is None or host.ref.manager not in ROOTS:
        return False
    return any(
        command_line(line[k:]).loads == model
        for line in host.exec_start
        for k in range(1, min(len(line), _WRAPPER_WORDS + 1))
    )


def duplicates(
    loaders: Iterable[Loader], units: Iterable[SeenUnit]
) -> list[tuple[Loader, str, Loader, bool]]:
    """Each second copy: (the loader, the model, who keeps it, whether it is kept as
    root's over a user's). Ranked per model: a job root's unit runs by name ranks with
    root's for that model only, not for another it is asked to load (over its API)."""
    by_ref = {u.ref: u for u in units}
    claims: dict[str, list[tuple[int, tuple[float, str], Loader]]] = {}
    for loader in loaders:
        for model in loaded_models(loader.seen):
            tier = 0 if roots(loader) else 1 if _run_by_root(loader, model, by_ref) else 2
            claims.setdefault(model, []).append((tier, start_order(loader), loader))
    out = []
    for model, ranked in claims.items():
        ranked.sort(key=lambda c: (c[0], c[1]))
        kept_tier, _, keeper = ranked[0]
        out += [(ld, model, keeper, kept_tier < tier) for tier, _, ld in ranked[1:]]
    return out
