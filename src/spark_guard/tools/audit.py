"""The audit's judgement: what on this machine can wedge it, each with the command that fixes it.

Pure: an Inventory (and the engines' loader containers), per-unit GPU figures
and /proc/meminfo in, Findings and a memory reconciliation out. `spark-guard
audit` is the front door.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..core.classify import canonical_model, classify, matches_any, model_files
from ..core.config import Config
from ..core.policy import charge_clients
from ..core.quantities import format_size
from ..core.snapshot import (
    STORM_WINDOW,
    SYSTEM,
    Loader,
    Memory,
    MemoryRule,
    SeenUnit,
    UnitRef,
)
from ..core.text import printable
from ..foresight.predict import Prediction
from ..system.engine import DOCKER_SOCKET, PODMAN_SOCKET
from .findings import Finding, Severity
from .harden import rescue_units
from .inventory import INFINITY, ContainerInfo, ContainerInventory, Inventory, UnitInfo


def systemctl(ref: UnitRef, user: str) -> str:
    """The systemctl an admin (root) types for this unit's manager."""
    if ref.manager == SYSTEM:
        return "systemctl"
    return f"systemctl --user -M {user or ref.manager.split(':', 1)[1]}@"


def _models(info: UnitInfo) -> list[str]:
    # Named, not only loaded: the audit reads unit files, not running processes, and a
    # model named twice is worth an admin's look (the guard itself acts on loads only).
    return model_files(info.exec_start)


def loader_findings(inv: Inventory, config: Config) -> list[Finding]:
    out: list[Finding] = []
    by_model: dict[str, list[UnitInfo]] = {}
    for info in inv.loaders:
        for model in dict.fromkeys(canonical_model(m) for m in _models(info)):
            by_model.setdefault(model, []).append(info)
    for model, units in sorted(by_model.items()):
        if len(units) < 2:
            continue
        # As the guard decides: PID 1's unit keeps the model, the fix is for a user's copy.
        keep, *extra = sorted(units, key=lambda u: u.ref.manager != SYSTEM)
        out.extend(
            Finding(
                Severity.CRITICAL,
                "duplicate",
                f"loads {model}, as {keep.ref} does: two copies of one model",
                unit=str(info.ref),
                fix=f"{systemctl(info.ref, info.user)} disable --now {info.ref.name}",
            )
            for info in extra
        )
    rescue = rescue_units(config)
    for info in inv.loaders:
        unit, ctl = str(info.ref), systemctl(info.ref, info.user)
        autostart = info.file_state in ("enabled", "enabled-runtime", "linked", "alias")
        if autostart and info.ref.manager != SYSTEM and info.user:
            out.append(
                Finding(
                    Severity.WARNING,
                    "linger-autostart",
                    f"starts at boot for {info.user} (linger) without anyone logging in",
                    unit=unit,
                    fix=f"{ctl} disable {info.ref.name}   "
                    f"# or: loginctl disable-linger {info.user}",
                )
            )
        if info.memory_max >= INFINITY:
            out.append(
                Finding(
                    Severity.WARNING,
                    "no-memory-max",
                    "no MemoryMax=: nothing bounds its CPU-side memory",
                    unit=unit,
                    fix=f"spark-guard harden {unit}",
                )
            )
        if rescue and not set(info.after) & set(rescue):
            out.append(
                Finding(
                    Severity.WARNING,
                    "not-after-rescue",
                    f"not ordered after {' '.join(rescue[:3])}: it can load before ssh is up",
                    unit=unit,
                    fix=f"spark-guard harden {unit}",
                )
            )
        if info.restart != "no" and (
            info.start_limit_burst == 0 or info.start_limit_interval < STORM_WINDOW
        ):
            limit = (
                "no start limit"
                if info.start_limit_burst == 0
                else f"StartLimitBurst={info.start_limit_burst} in "
                f"{info.start_limit_interval:g}s, shorter than one load cycle"
            )
            out.append(
                Finding(
                    Severity.WARNING,
                    "restart-storm",
                    f"Restart={info.restart} with {limit}: a crashing load restarts forever",
                    unit=unit,
                    fix=f"spark-guard harden {unit}",
                )
            )
    out.extend(
        Finding(
            Severity.WARNING,
            "failed",
            f"{info.ref.name} has failed",
            unit=str(info.ref),
            fix=f"journalctl {'--user-unit' if info.ref.manager != SYSTEM else '-u'} "
            f"{info.ref.name} -b -n 50; {systemctl(info.ref, info.user)} reset-failed "
            f"{info.ref.name}",
        )
        for info in inv.failed
    )
    out.extend(
        Finding(
            Severity.CRITICAL,
            "no-such-unit",
            f"{name}: no such unit on any manager (system, or any user's)",
            unit=name,
            fix="systemctl list-unit-files '*llama*'   # find its real name",
        )
        for name in inv.missing
        if not name.startswith("container:") and inv.managers  # none reached: not looked up
    )
    out.extend(
        Finding(
            Severity.CRITICAL,
            "no-such-container",
            f"{name}: no loader container of that name on any engine in [containers] engines",
            unit=name,
            fix="docker ps -a --format '{{.Names}} {{.Image}}'   # find its real name",
        )
        for name in inv.missing
        if name.startswith("container:")
    )
    out.extend(
        Finding(Severity.WARNING, "unreadable", error, fix="run the audit as root")
        for error in inv.errors
    )
    return out


# --- loader containers ------------------------------------------------------------------------

# Restart policies under which the engine starts a container at its own start: at every boot,
# before anyone can log in. Docker (moby's restore, shown on the private dockerd): `always`
# even if stopped by hand, `unless-stopped` unless stopped by hand, neither if never started;
# `on-failure` if it last ended in a failure, as a loader killed at shutdown does.
BOOT_POLICIES = ("always", "unless-stopped")


def engine_cli(socket: str) -> str:
    """The CLI an admin types for the engine on `socket`: `docker` or `podman` (a socket
    with "podman" in its path), told the socket where it is not the CLI's default."""
    if "podman" in socket:
        default = socket in (PODMAN_SOCKET, "/var" + PODMAN_SOCKET)
        return "podman" if default else f"podman --url {shlex.quote('unix://' + socket)}"
    default = socket in (DOCKER_SOCKET, "/var" + DOCKER_SOCKET)
    return "docker" if default else f"docker -H {shlex.quote('unix://' + socket)}"


def container_protected(info: ContainerInfo, config: Config) -> bool:
    """Named in [protected] as `container:NAME` (globs matched against that string)."""
    return matches_any(info.container.ref, config.protected_units)


def unreached_findings(unreached: Sequence[str], step: str = "") -> list[Finding]:
    """A manager that was there and not reached, or not believed (a socket of hers that
    PID 1 does not vouch for): none of its units was audited (doctor: `step`)."""
    return [
        Finding(
            Severity.WARNING,
            "manager-unreached",
            f"not audited: {printable(why)}",
            fix="its users' running loaders are audited by what the kernel shows: "
            "spark-guard audit",
            step=step,
        )
        for why in unreached
    ]


def unlisted_findings(loaders: Sequence[Loader]) -> list[Finding]:
    """Loaders the kernel shows and no manager reached lists (inventory.unlisted): a
    user's processes that are no unit, or a unit of hers whose manager is out of view.
    No unit file says what they are: audited by what runs, never passed over."""
    out = []
    for loader in loaders:
        seen = loader.seen
        held = f"{len(seen.pids)} process(es), {format_size(seen.used)}"
        if seen.group:
            # A loader run from a shell, a scope, a job in root's unit: judged, killed if
            # it threatens, never masked (there is no unit to mask).
            severity, what = Severity.WARNING, f"a model loader that is no unit ({seen.group})"
        else:
            severity, what = Severity.CRITICAL, "a model loader whose manager was not reached"
        out.append(
            Finding(
                severity,
                "unlisted-loader",
                f"{what} runs: {held}; no unit file of it was read",
                unit=str(loader.ref),
                fix="spark-guard rescue kills it in its owner's own subtree",
            )
        )
    return out


def container_findings(found: ContainerInventory, config: Config) -> list[Finding]:
    """A loader container its engine brings back by itself is a boot risk; a protected one
    is never flagged. An engine that failed is one line, and is no risk of the machine's."""
    out: list[Finding] = []
    for info in found.loaders:
        if container_protected(info, config):
            continue
        c = info.container
        name = c.ref.removeprefix("container:")  # NAME, or the id where the name is not one
        fix = f"{engine_cli(info.engine)} update --restart=no {name}"
        if c.restart in BOOT_POLICIES:
            when = "its engine starts it at every boot, before anyone can log in"
            if c.status == "created":  # never started: Docker starts none such at its start
                when = f"not started yet, so not at boot; once started, {when}"
            elif c.status == "exited" and c.restart == "unless-stopped":  # stopped by hand
                when = f"stopped by hand, so not at boot until started again; then {when}"
            elif c.status == "exited":
                when = f"stopped now, but {when}"
            out.append(
                Finding(
                    Severity.WARNING,
                    "container-at-boot",
                    f"restart policy {c.policy}: {when}; spark-guard blocks it at boot only "
                    f'if its footprint is known ([loaders.footprint] "{c.ref}" = "SIZE") '
                    "or foreseeable",
                    unit=c.ref,
                    fix=fix,
                )
            )
        elif c.restart == "on-failure":
            times = f"up to {c.max_retries} times" if c.max_retries else "with no limit"
            out.append(
                Finding(
                    Severity.INFO,
                    "container-restart",
                    f"restart policy {c.policy}: its engine starts it again after it fails, "
                    f"an OOM kill among them ({times}), and at boot if shutdown killed it",
                    unit=c.ref,
                    fix=fix,
                )
            )
    out.extend(
        Finding(
            Severity.INFO,
            "engine-unreachable",
            f"container engine failed, so its containers were not all audited: {problem.reason}",
            unit=problem.socket,
            fix="start the engine, or take its socket out of [containers] engines",
        )
        for problem in found.errors
    )
    return out


@dataclass(frozen=True)
class Reconciliation:
    """Where MemTotal - MemAvailable went, and the part nothing accounts for."""

    total: int
    used: int
    rss: int
    gpu: int
    kernel: int  # slab, page tables, kernel stacks, shmem/tmpfs
    gap: int
    gpu_accounting: bool

    @property
    def large(self) -> bool:
        """Worth an admin's look: more than 1 GiB and 5 % of the memory."""
        return self.gap > max(2**30, self.total * 0.05)

    @property
    def probably(self) -> str:
        if not self.large and not self.gpu_accounting:
            # No NVML: a GPU's memory would be in the gap, so small as it is, it is no proof.
            return "GPU memory not counted (no NVML): the figures are RSS and kernel only"
        if not self.large:
            return "nothing large: the figures add up"
        if not self.gpu_accounting:
            return (
                "GPU memory: NVML is not available, and device memory taken by cudaMalloc "
                "shows in no RSS or cgroup figure"
            )
        return (
            "memory no process owns: the driver's own reservations, or GPU memory of "
            "processes NVML does not report (other containers, exited but not freed)"
        )


def reconcile(
    meminfo: Mapping[str, int], rss: int, gpu: int, gpu_accounting: bool
) -> Reconciliation:
    used = meminfo["MemTotal"] - meminfo["MemAvailable"]
    kernel = sum(meminfo.get(k, 0) for k in ("SUnreclaim", "PageTables", "KernelStack", "Shmem"))
    gap = max(used - rss - gpu - kernel, 0)
    return Reconciliation(meminfo["MemTotal"], used, rss, gpu, kernel, gap, gpu_accounting)


def memory_findings(r: Reconciliation, holders: Sequence[tuple[str, int]]) -> list[Finding]:
    out = []
    if r.large:
        out.append(
            Finding(
                Severity.WARNING,
                "unaccounted-memory",
                f"{format_size(r.gap)} used by nothing /proc or NVML shows: probably {r.probably}",
                fix="spark-guard audit --json   # and nvidia-smi "
                "--query-compute-apps=pid,used_memory --format=csv",
            )
        )
    for unit, held in holders:
        out.append(
            Finding(
                Severity.INFO,
                "gpu-holder",
                f"holds {format_size(held)} of GPU memory",
                unit=unit,
                fix=f"spark-guard preflight {unit}",
            )
        )
    return out


def unified_findings(memory: Memory, rule: MemoryRule, config: Config) -> list[Finding]:
    """Unified memory (GB10): what a GPU allocation can get now, and why it may not.

    A load gets MemFree; page cache counts in MemAvailable but the driver cannot take it
    (docs/unified-memory.md). Nothing here on a discrete card."""
    if not rule.unified or memory.free is None:
        return []
    out = []
    floor = config.floor_for(memory.total)
    free, cache = memory.free, memory.file_clean
    if free < floor:
        out.append(
            Finding(
                Severity.WARNING,
                "memfree-low",
                f"MemFree {format_size(free)} is under the device floor {format_size(floor)} "
                f"with {format_size(cache)} of clean page cache and MemAvailable "
                f"{format_size(memory.available)}: a GPU allocation gets MemFree, and a load "
                "now may fail (NV_ERR_NO_MEMORY) or wedge the host",
                unit="",  # the machine as a whole: null in --json
                fix="spark-guard preflight --make-room UNIT   # as root: drops clean cache, "
                "compacts, then judges",
            )
        )
    huge = memory.huge_free
    if huge is not None and huge < floor <= free:
        out.append(
            Finding(
                Severity.WARNING,
                "fragmented",
                f"only {format_size(huge)} of MemFree {format_size(free)} is in free blocks of "
                "2 MiB or larger: the driver's large allocations fail on a fragmented pool",
                unit="",  # the machine as a whole: null in --json
                fix="echo 1 > /proc/sys/vm/compact_memory   # the guard does it when it makes room",
            )
        )
    if not rule.make_room:
        out.append(
            Finding(
                Severity.INFO,
                "no-make-room",
                "the guard makes no room on this unified-memory machine ([memory] make_room "
                "is false, or no way of dropping page cache works): it judges MemFree alone",
                unit="",  # the machine as a whole: null in --json
                fix="[memory] make_room = true in /etc/spark-guard.toml",
            )
        )
    return out


@dataclass(frozen=True)
class Footprint:
    """What the guard would expect of a loader, and by which rule."""

    bytes: int | None
    source: str  # Prediction.source, "[loaders.footprint] in the config", or why none
    kind: str = ""  # "config", or the spec's kind ("llama.cpp", "ollama", "lmstudio", ...)
    rule: str = ""  # the spec's rule: the defaults it took
    notes: tuple[str, ...] = ()
    # A client's load is charged to its server (policy.charge_clients), and a server
    # carries the clients charged to it.
    charged_to: UnitRef | None = None
    clients: tuple[UnitRef, ...] = ()


def footprints(
    inv: Inventory, predictions: Mapping[UnitRef, Prediction | None], config: Config
) -> dict[UnitRef, Footprint]:
    """Each loader's footprint and its rule: the admin's figure ([loaders.footprint]) over
    the prediction, as classify() takes it; clients charged to their servers as the guard
    charges them (policy.charge_clients), against every loader the inventory lists."""
    loaders = []
    for u in inv.loaders:
        got = predictions.get(u.ref)
        seen = SeenUnit(
            u.ref,
            u.active_state,
            exec_start=u.exec_start,
            predicted=got.bytes if got is not None else None,
            runs_as=got.runs_as if got is not None else None,
        )
        loader = classify(seen, config)
        if loader is not None:
            loaders.append(loader)
    charged = {ld.ref: ld for ld in charge_clients(tuple(loaders))}
    out = {}
    for u in inv.loaders:
        got = predictions.get(u.ref)
        ld = charged.get(u.ref)
        if ld is not None and ld.expected_from == "config":
            fp = Footprint(ld.expected, "[loaders.footprint] in the config", "config")
        elif got is None and ld is not None and ld.clients:
            fp = Footprint(ld.expected, "the loads its clients ask of it", "clients")
        elif got is None:
            fp = Footprint(None, "no rule reads its command line: give it [loaders.footprint]")
        else:
            spec = got.spec
            fp = Footprint(
                got.bytes,
                got.source,
                spec.kind if spec else "",
                spec.rule if spec else "",
                spec.notes if spec else (),
            )
        if ld is not None:
            fp = replace(fp, charged_to=ld.charged_to, clients=ld.clients)
        out[u.ref] = fp
    return out
