"""What the running guard sees, published for `spark-guard status` (which never recomputes it).

The daemon writes <runtime>/state.json after a pass whenever its content
changed, and at least every REFRESH seconds so a reader can tell a live guard
from a dead one: through safefs's atomic writer (readers see the old or the
new, never half).
"""

from __future__ import annotations

import grp
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypedDict, TypeVar, cast

from .block.records import Record
from .core.snapshot import Action, Decision, Loader, Snapshot
from .system.safefs import MAKEDIRS, as_user, own_tree

T = TypeVar("T")

REFRESH = 60.0  # rewritten at least this often; status also checks the pid
FORMAT = 1
# Loaders and blocks listed per manager (issue 40, H8): a user's thousand units made a
# state.json of megabytes, rewritten every full look. The biggest loaders are kept; the
# rest of each manager's are counted in left_out.
PER_MANAGER = 32


# The shape of state.json, spelled out so mypy checks every key its readers
# (status_cli, metrics, the daemon's metrics writer) use.


class LoaderEntry(TypedDict):
    """One loader the last decision saw (Decision.loaders)."""

    unit: str
    active_state: str
    starting: bool
    expected: int | None
    expected_from: str | None  # "config" or "estimate"; None: footprint unknown
    prediction: str | None
    rss: int
    gpu: int
    evidence: list[str]
    models: list[str]
    cgroup: str
    restart: str | None  # a container's restart policy; None for a unit
    image: str | None  # a container's image


class ActionEntry(TypedDict):
    """One action the last decision asked for (Decision.actions)."""

    kind: str
    unit: str
    reason: str
    detail: str


class BlockedEntry(TypedDict):
    """One blocked unit, from its record (records.Record)."""

    unit: str
    step: str
    reason: str
    phase: str
    detail: str
    at: str
    problem: str | None
    history: list[tuple[str, str]]  # the last 5 (UTC time, what happened); lists once read
    restart_was: str | None  # a container's restart policy before its block


class Counts(TypedDict):
    actions: dict[str, int]  # action kind -> times taken since the guard started
    starts: dict[str, int]  # unit -> loader starts seen since the guard started


class PassState(TypedDict):
    """What one pass builds; compared with the last one to tell whether it changed."""

    format: int
    pid: int
    phase: str
    dry_run: bool
    config_error: str | None
    mem_total: int
    mem_available: int
    # Unified memory (docs/unified-memory.md): what a GPU allocation can get.
    unified: bool
    mem_free: int | None
    file_clean: int
    huge_free: int | None  # bytes free in blocks of 2 MiB and larger
    pinned: int | None
    headroom: int  # the figure the rules judge (policy.judged)
    floor: int  # the device floor make-room keeps MemFree above (0: not unified)
    room_made: dict[str, int]  # reclaims and compactions by kind, and freed_bytes
    reserve: int
    slope: int
    gpu_accounting: bool
    gpu_stale: bool
    managers: list[str]
    loaders: list[LoaderEntry]
    pending_actions: list[ActionEntry]
    blocked: list[BlockedEntry]
    last_action: str
    counts: Counts
    decided_at: float
    decision_seconds: float
    watchdog_at: float
    left_out: LeftOut


class LeftOut(TypedDict):
    """Per manager, how many of its loaders, blocks and pending actions are past
    PER_MANAGER, not listed."""

    loaders: dict[str, int]
    blocked: dict[str, int]
    actions: dict[str, int]


def _capped(items: Iterable[T], manager: Callable[[T], str]) -> tuple[list[T], dict[str, int]]:
    """The first PER_MANAGER items of each manager, in their order, and per manager how
    many were left out."""
    kept, seen = [], Counter[str]()
    for item in items:
        seen[manager(item)] += 1
        if seen[manager(item)] <= PER_MANAGER:
            kept.append(item)
    return kept, {m: n - PER_MANAGER for m, n in sorted(seen.items()) if n > PER_MANAGER}


def _action(a: Action) -> ActionEntry:
    return {"kind": a.kind, "unit": str(a.unit), "reason": a.reason, "detail": a.detail}


def _listed(
    decision: Decision, records: Iterable[Record]
) -> tuple[list[Loader], list[Record], list[Action], LeftOut]:
    """The loaders (the biggest of each manager, in the decision's order), the blocks and
    the pending actions state.json lists, and how many of each manager's it leaves out."""
    biggest, loaders_out = _capped(
        sorted(decision.loaders, key=lambda ld: (ld.ref.manager, -ld.seen.used, ld.ref.name)),
        lambda ld: ld.ref.manager,
    )
    kept = {id(ld) for ld in biggest}
    blocks, blocks_out = _capped(sorted(records, key=lambda r: str(r.ref)), lambda r: r.manager)
    listed = [ld for ld in decision.loaders if id(ld) in kept]
    actions, actions_out = _capped(decision.actions, lambda a: a.unit.manager)
    left_out: LeftOut = {"loaders": loaders_out, "blocked": blocks_out, "actions": actions_out}
    return listed, blocks, actions, left_out


class PublishedState(PassState):
    """state.json as written: a pass's state, stamped with when it was written: on the
    wall clock (for people and Prometheus), and on the boot clock (CLOCK_BOOTTIME), which
    no NTP step moves, for `status` to judge whether the guard is alive."""

    written_at: float
    written_boot: float


def build(
    decision: Decision,
    snapshot: Snapshot,
    records: Iterable[Record],
    *,
    dry_run: bool,
    last_action: str,
    config_error: str | None,
    counts: Counts | None = None,
    decided_at: float = 0.0,
    decision_seconds: float = 0.0,
    watchdog_at: float = 0.0,
    room_made: dict[str, int] | None = None,
    managers: list[str] | None = None,
) -> PassState:
    memory = snapshot.memory
    loaders, blocks, actions, left_out = _listed(decision, records)
    return {
        "format": FORMAT,
        "pid": os.getpid(),
        "phase": decision.phase,
        "dry_run": dry_run,
        "config_error": config_error,
        "mem_total": memory.total,
        "mem_available": memory.available,
        "unified": decision.rule.unified,
        "mem_free": memory.free,
        "file_clean": memory.file_clean,
        "huge_free": memory.huge_free,
        "pinned": snapshot.pinned,
        "headroom": decision.headroom,
        "floor": decision.floor,
        "room_made": dict(room_made or {}),
        "reserve": decision.reserve,
        "slope": round(decision.slope),
        "gpu_accounting": snapshot.gpu_accounting,
        "gpu_stale": snapshot.gpu_stale,
        # The managers that answered this pass (none: no unit seen, none stoppable).
        "managers": list(managers or []),
        "loaders": [
            {
                "unit": str(ld.ref),
                "active_state": ld.seen.active_state,
                "starting": ld.seen.starting,
                "expected": ld.expected,
                "expected_from": ld.expected_from or None,
                "prediction": ld.seen.prediction or None,
                "rss": ld.seen.rss,
                "gpu": ld.seen.gpu,
                "evidence": list(ld.evidence),
                "models": list(ld.models),
                "cgroup": ld.seen.cgroup,
                "restart": ld.seen.container.policy if ld.seen.container else None,
                "image": ld.seen.container.image if ld.seen.container else None,
            }
            for ld in loaders
        ],
        "pending_actions": [_action(a) for a in actions],
        "blocked": [
            {
                "unit": str(r.ref),
                "step": str(r.step),
                "reason": r.reason,
                "phase": r.phase,
                "detail": r.detail,
                "at": r.at,
                "problem": r.problem or None,
                "history": r.history[-5:],
                "restart_was": r.container.policy if r.container else None,
            }
            for r in blocks
        ],
        "left_out": left_out,
        "last_action": last_action,
        "counts": counts or {"actions": {}, "starts": {}},
        "decided_at": decided_at,
        "decision_seconds": decision_seconds,
        "watchdog_at": watchdog_at,
    }


# state.json names what every user loads, and the prediction text can name folders in a
# user's 0700 tree: it is root's and group adm's (the admins' group on Debian and Ubuntu).
STATE_MODE = 0o640
READERS = "adm"


def readers_gid(group: str = READERS) -> int:
    """The group that may read state.json (root's, 0, where there is no such group). Looked
    up once, at start: a lookup may go through NSS, never on the loop's path."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return 0


class Publisher:
    def __init__(self, directory: str, clock: Any = time.monotonic, gid: int | None = None) -> None:
        self.path = os.path.join(directory, "state.json")
        self.clock = clock
        self.gid = readers_gid() if gid is None else gid
        self._last: PassState | None = None
        self._at = 0.0

    def publish(self, state: PassState) -> PublishedState | None:
        """Writes state.json when due; returns what it wrote (None when it was not due)."""
        now = self.clock()
        if state == self._last and now - self._at < REFRESH:
            return None
        written: PublishedState = {
            **state,
            "written_at": time.time(),
            "written_boot": time.clock_gettime(time.CLOCK_BOOTTIME),
        }
        # Parent directories made as needed; the group given before the file is in place
        # (an admin's `status` between a write and a chown was refused).
        data = json.dumps(written, indent=1).encode()
        with as_user(0, self.gid):  # the file is made with the group, no chown after
            own_tree().write(self.path, data, mode=STATE_MODE, create=MAKEDIRS)
        self._last, self._at = state, now
        return written


# What `status` reads of every state.json, with the types it reads them as: a file of
# another shape (another version's, a hand-edited one) is refused, never a KeyError.
_SHAPE: dict[str, type | tuple[type, ...]] = {
    "format": int,
    "pid": int,
    "phase": str,
    "mem_total": int,
    "mem_available": int,
    "reserve": int,
    "loaders": list,
    "blocked": list,
    "pending_actions": list,
    "last_action": str,
    "counts": dict,
}


def read(directory: str) -> PublishedState:
    """state.json as the daemon wrote it, its shape checked (the daemon is its only writer,
    but another version's, or a file edited by hand, is not this one's): ValueError naming
    what is wrong."""
    with open(os.path.join(directory, "state.json"), encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, this spark-guard reads {FORMAT}")
    for key, kind in _SHAPE.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):  # (JSON's true is an int)
            raise ValueError(f"{key!r} missing or not {getattr(kind, '__name__', kind)}")
    return cast(PublishedState, data)
