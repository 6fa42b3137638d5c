"""The guard's state as Prometheus metrics, for node_exporter's textfile collector.

`registry(state, cpu)` turns what the daemon publishes for `spark-guard
status` (statefile.py) into metrics: plain data in, a CollectorRegistry out.
`TextfileWriter` writes it atomically (safefs: temporary file, then rename,
never through a symlink) where node_exporter reads `*.prom` files. Base
units (bytes, seconds) and `_total` for counters, as Prometheus' naming
conventions ask.

prometheus_client is imported only when a textfile directory exists, so a
machine without node_exporter pays nothing for this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .core.snapshot import SYSTEM, manager_uid, parse_ref
from .statefile import PublishedState
from .system.safefs import own_tree

PREFIX = "spark_guard"


def unit_labels(unit: str) -> tuple[str, str, str]:
    """'llama.service' -> (llama.service, system, ""); 'user:1000:x.service' -> (x, user, 1000);
    'container:vllm' -> (vllm, container, ""); 'user:1000:container:vllm' -> (vllm,
    container, 1000)."""
    ref = parse_ref(unit, SYSTEM)
    if ref.manager == SYSTEM:
        return ref.name, "system", ""
    if ref.is_container:  # a user's rootless one names her uid
        uid = "" if ref.engine_owner == 0 else str(ref.engine_owner)
        return ref.container, "container", uid
    return ref.name, "user", str(manager_uid(ref.manager))


def _client() -> Any:
    # The registry is rebuilt for every write, so each counter's *_created series would
    # say "now": noise. Off, before the first import (older clients read the variable).
    os.environ.setdefault("PROMETHEUS_DISABLE_CREATED_SERIES", "True")
    import prometheus_client

    if hasattr(prometheus_client, "disable_created_metrics"):
        prometheus_client.disable_created_metrics()
    return prometheus_client


def _blocked(state: PublishedState) -> int:
    """Every block: state.json lists 32 per manager (statefile.PER_MANAGER), counts the rest."""
    left_out: dict[str, int] = state.get("left_out", {}).get("blocked", {})
    return len(state["blocked"]) + sum(left_out.values())


def registry(state: PublishedState, cpu: Mapping[str, float]) -> Any:
    """A CollectorRegistry holding the state's metrics; cpu: unit -> CPU seconds used."""
    client = _client()
    CollectorRegistry, Counter, Enum, Gauge = (
        client.CollectorRegistry,
        client.Counter,
        client.Enum,
        client.Gauge,
    )

    reg = CollectorRegistry()
    labels = ("unit", "level", "user")

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(f"{PREFIX}_{name}", doc, registry=reg).set(value)

    gauge("up", "1 while the guard publishes (see last_update for how recently)", 1)
    gauge("last_update_timestamp_seconds", "When this file was written", state["written_at"])
    gauge("mem_total_bytes", "MemTotal", state["mem_total"])
    gauge("mem_available_bytes", "MemAvailable when the guard last looked", state["mem_available"])
    gauge("reserve_bytes", "MemAvailable the guard keeps free for a rescue login", state["reserve"])
    gauge(
        "unified_memory", "1 where CPU and GPU share one memory pool (GB10)", int(state["unified"])
    )
    if state["mem_free"] is not None:
        gauge(
            "mem_free_bytes",
            "MemFree: what a GPU allocation gets on unified memory",
            state["mem_free"],
        )
    gauge(
        "page_cache_clean_bytes",
        "Clean page cache the guard can drop to make room",
        state["file_clean"],
    )
    if state["huge_free"] is not None:
        gauge(
            "huge_free_bytes",
            "Free in blocks of 2 MiB and larger (/proc/buddyinfo)",
            state["huge_free"],
        )
    if state["pinned"] is not None:
        gauge("pinned_bytes", "Pinned long-term (FOLL_PIN): no reclaim moves it", state["pinned"])
    gauge(
        "headroom_bytes",
        "The figure the guard judges: MemAvailable, or the device headroom",
        state["headroom"],
    )
    gauge(
        "device_floor_bytes",
        "MemFree the guard keeps free by making room (0: not unified)",
        state["floor"],
    )
    room = Gauge(
        f"{PREFIX}_room_made",
        "Times the guard made room for the GPU since it started, by how",
        ("how",),
        registry=reg,
    )
    for how, times in sorted(state["room_made"].items()):
        if how != "freed_bytes":
            room.labels(how).set(times)
    gauge(
        "room_freed_bytes",
        "MemFree gained by making room since the guard started",
        state["room_made"].get("freed_bytes", 0),
    )
    gauge("dry_run", "1 when the guard only decides and logs", int(state["dry_run"]))
    gauge("config_error", "1 when the config file was refused", int(bool(state["config_error"])))
    gauge("last_decision_timestamp_seconds", "When the guard last decided", state["decided_at"])
    gauge(
        "last_decision_duration_seconds",
        "How long the last sense and decide took",
        state["decision_seconds"],
    )
    gauge(
        "watchdog_last_ping_timestamp_seconds",
        "When the guard last told systemd's watchdog it is alive",
        state["watchdog_at"],
    )
    Enum(
        f"{PREFIX}_phase",
        "strict while boot is not over (rescue units not up for the grace period), then steady",
        states=["strict", "steady"],
        registry=reg,
    ).state(state["phase"])

    expected = Gauge(
        f"{PREFIX}_loader_expected_bytes",
        "What the loader is expected to hold (config or estimate)",
        labels,
        registry=reg,
    )
    used = Gauge(
        f"{PREFIX}_loader_used_bytes", "What the loader holds now (RSS + GPU)", labels, registry=reg
    )
    gpu = Gauge(
        f"{PREFIX}_unit_gpu_bytes", "GPU memory held by the unit (NVML)", labels, registry=reg
    )
    cpu_used = Counter(
        f"{PREFIX}_unit_cpu_seconds", "CPU time the unit's cgroup has used", labels, registry=reg
    )
    for loader in state["loaders"]:
        key = unit_labels(loader["unit"])
        if loader["expected"] is not None:
            expected.labels(*key).set(loader["expected"])
        used.labels(*key).set(loader["rss"] + loader["gpu"])
        gpu.labels(*key).set(loader["gpu"])
        if loader["unit"] in cpu:
            cpu_used.labels(*key).inc(cpu[loader["unit"]])

    starts = Counter(
        f"{PREFIX}_loader_starts", "Loader starts the guard has seen", labels, registry=reg
    )
    for unit, count in state["counts"]["starts"].items():
        starts.labels(*unit_labels(unit)).inc(count)
    actions = Counter(
        f"{PREFIX}_actions",
        "Actions taken since the guard started, by kind",
        ["kind"],
        registry=reg,
    )
    for kind in ("stop", "warn", "dry-run"):
        actions.labels(kind).inc(state["counts"]["actions"].get(kind, 0))

    gauge("blocked_units", "Units the guard holds stopped, masked and disabled", _blocked(state))
    blocked = Gauge(
        f"{PREFIX}_unit_blocked",
        "1 for each blocked unit; phase: the guard's phase when it blocked it (strict: at boot)",
        (*labels, "reason", "phase"),
        registry=reg,
    )
    for record in state["blocked"]:
        blocked.labels(*unit_labels(record["unit"]), record["reason"], record["phase"]).set(1)
    return reg


class TextfileWriter:
    """Writes the registry to one .prom file; silent while its directory does not exist."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.problem = ""  # why the last write did not happen ("" when it did)

    @property
    def wanted(self) -> bool:
        return bool(self.path) and os.path.isdir(os.path.dirname(self.path))

    def write(self, state: PublishedState, cpu: Mapping[str, float]) -> bool:
        if not self.wanted:
            self.problem = f"{os.path.dirname(self.path) or self.path}: no such directory"
            return False
        try:
            client = _client()
        except ImportError:
            self.problem = "python module prometheus_client (python3-prometheus-client) missing"
            return False
        data = client.generate_latest(registry(state, cpu))
        # The temporary name ends in .tmp (node_exporter skips it); 0644: node_exporter
        # runs as its own user. /var/lib/prometheus belongs to prometheus on Debian:
        # any owner on the way, never a symlink (see safefs.Tree's any_owner).
        try:
            own_tree(any_owner=True).write(self.path, data, mode=0o644)
        except OSError as e:
            self.problem = f"{self.path}: {e.strerror or e}"
            return False
        self.problem = ""
        return True
