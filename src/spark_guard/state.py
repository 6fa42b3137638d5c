"""What the running guard sees, published for `spark-guard status` (which never recomputes it).

The daemon writes <runtime>/state.json after a pass whenever its content
changed, and at least every REFRESH seconds so a reader can tell a live guard
from a dead one: through safefs's atomic writer (readers see the old or the
new, never half).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

from .records import Record
from .safefs import MAKEDIRS, own_tree
from .snapshot import Decision, Snapshot

REFRESH = 60.0  # rewritten at least this often; status also checks the pid
FORMAT = 1


def build(
    decision: Decision,
    snapshot: Snapshot,
    records: Iterable[Record],
    *,
    dry_run: bool,
    last_action: str,
    config_error: str | None,
    counts: dict[str, dict[str, int]] | None = None,
    decided_at: float = 0.0,
    decision_seconds: float = 0.0,
    watchdog_at: float = 0.0,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "pid": os.getpid(),
        "phase": decision.phase,
        "dry_run": dry_run,
        "config_error": config_error,
        "mem_total": snapshot.memory.total,
        "mem_available": snapshot.memory.available,
        "reserve": decision.reserve,
        "slope": round(decision.slope),
        "gpu_accounting": snapshot.gpu_accounting,
        "gpu_stale": snapshot.gpu_stale,
        "loaders": [
            {
                "unit": str(ld.ref),
                "active_state": ld.usage.active_state,
                "starting": ld.usage.starting,
                "expected": ld.expected,
                "expected_from": ld.expected_from or None,
                "prediction": ld.usage.prediction or None,
                "rss": ld.usage.rss,
                "gpu": ld.usage.gpu,
                "evidence": list(ld.evidence),
                "models": list(ld.models),
                "cgroup": ld.usage.cgroup,
            }
            for ld in decision.loaders
        ],
        "pending_actions": [
            {"kind": a.kind, "unit": str(a.unit), "reason": a.reason, "detail": a.detail}
            for a in decision.actions
        ],
        "blocked": [
            {
                "unit": str(r.ref),
                "step": r.step,
                "reason": r.reason,
                "phase": r.phase,
                "detail": r.detail,
                "at": r.at,
                "problem": r.problem or None,
                "history": r.history[-5:],
            }
            for r in sorted(records, key=lambda r: str(r.ref))
        ],
        "last_action": last_action,
        "counts": counts or {"actions": {}, "starts": {}},
        "decided_at": decided_at,
        "decision_seconds": decision_seconds,
        "watchdog_at": watchdog_at,
    }


class Publisher:
    def __init__(self, directory: str, clock: Any = time.monotonic) -> None:
        self.path = os.path.join(directory, "state.json")
        self.clock = clock
        self._last: dict[str, Any] | None = None
        self._at = 0.0

    def publish(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Writes state.json when due; returns what it wrote (None when it was not due)."""
        now = self.clock()
        if state == self._last and now - self._at < REFRESH:
            return None
        written = {**state, "written_at": time.time()}
        # 0644: status runs as any user; parent directories made as needed.
        data = json.dumps(written, indent=1).encode()
        own_tree().write(self.path, data, mode=0o644, create=MAKEDIRS)
        self._last, self._at = state, now
        return written


def read(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, "state.json"), encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data
