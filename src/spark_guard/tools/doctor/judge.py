"""Doctor's judgement: the order admins follow when a model server dies or the GPU "falls off".

1. classify the failure (app, driver, hardware/firmware);
2. the kernel's NVIDIA messages (Xid, explained from NVIDIA's catalogue;
   NV_ERR_NO_MEMORY, judged against the memory state now);
3. the driver's state (versions, persistence mode);
4. the card (PCIe link, temperature, power, memory);
5. the application's side: restart storms, OOM kills, CUDA errors, memory budgets, and
   managers whose loaders could not be listed. Pure: Evidence (plain data, gathered by
   doctor_cli) in, a Report out.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ...core.quantities import format_size
from ...core.snapshot import STORM_WINDOW
from ...exits import CANNOT_SAY, CRITICAL
from ...system.gpu import GpuFacts
from ..audit import unreached_findings
from ..findings import Finding, Severity, worst
from .logscan import OOM_KILL, OOM_TASK, RESTART_SCHEDULED, UNIT_OOM_KILLED, LogLine
from .xid import CATALOGUE_URL, XidEvent, describe, parse_line

STEPS = ("classify", "kernel", "driver", "card", "application")
STORM_COUNT = 3
CUDA_OOM = re.compile(
    r"out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|failed to allocate", re.I
)
CUDA_INIT = re.compile(
    r"no CUDA-capable device|cudaErrorInitializationError|CUDA_ERROR_NOT_INITIALIZED|"
    r"CUDA_ERROR_NO_DEVICE|failed to initiali[sz]e CUDA|cuInit|ggml_cuda_init: failed|"
    r"CUDA driver version is insufficient",
    re.I,
)
CUDA_ERROR = re.compile(r"CUDA error|cuda.*(error|fail)", re.I)
NV_NO_MEMORY = re.compile(r"NVRM:.*NV_ERR_NO_MEMORY")
# Many a minute is a failing start: vllm issue 54200 logged 75 in one engine start.
NV_NO_MEMORY_BURST = 10
NV_NO_MEMORY_WINDOW = 60.0


@dataclass(frozen=True)
class LoaderBudget:
    unit: str
    expected: int | None
    source: str  # how the figure was found, or why there is none
    autostart: bool


@dataclass(frozen=True)
class Evidence:
    gpu: GpuFacts
    nvidiactl: bool  # /dev/nvidiactl exists
    nvidia_pci: int  # NVIDIA devices on the PCI bus (sysfs)
    persistenced: str  # ActiveState of nvidia-persistenced.service, or "not-found"
    logs: tuple[LogLine, ...] = ()
    log_limits: tuple[str, ...] = ()
    unreached: tuple[str, ...] = ()  # managers not reached or not believed (inventory)
    loader_units: frozenset[str] = frozenset()
    loader_names: tuple[str, ...] = ()  # name patterns and binaries that mark a loader
    budgets: tuple[LoaderBudget, ...] = ()
    mem_total: int = 0
    reserve: int = 0
    unit_of_pid: dict[int, str] = field(default_factory=dict)
    # Memory now (/proc/meminfo, bytes): on unified memory the GPU allocates from MemFree.
    mem_free: int = 0
    mem_available: int = 0
    file_cache: int = 0  # Active(file) + Inactive(file)
    huge_free: int | None = None  # free in blocks of 2 MiB and larger; None: no buddyinfo
    # The MemFree a unified-memory GPU allocation needs (config.floor_for: the field's 8 GiB
    # on a 121 GiB Spark).
    floor: int = 0


@dataclass(frozen=True)
class Report:
    kind: str  # healthy | app-level | driver-level | hardware/firmware-level | no-gpu | cannot-tell
    findings: tuple[Finding, ...]

    @property
    def worst(self) -> Severity:
        return worst(self.findings)

    @property
    def exit_code(self) -> int:
        """exits.py's scheme: 0 healthy, 1 a warning, 3 critical, 4 cannot tell."""
        if self.kind == "cannot-tell":
            return CANNOT_SAY
        return {Severity.CRITICAL: CRITICAL, Severity.WARNING: 1}.get(self.worst, 0)


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "?"


def _is_loader(unit: str, ev: Evidence, identifier: str = "") -> bool:
    if unit and unit in ev.loader_units:
        return True
    name = unit.rsplit(":", 1)[-1].lower()
    return any(p.lower() in name or p.lower() == identifier.lower() for p in ev.loader_names)


def _xids(ev: Evidence) -> list[XidEvent]:
    return [x for line in ev.logs if line.kernel if (x := parse_line(line.message, line.at))]


def _cuda_lines(ev: Evidence) -> list[tuple[str, LogLine]]:
    out = []
    for line in ev.logs:
        if line.kernel or line.message_id or not _is_loader(line.unit, ev, line.identifier):
            continue
        if CUDA_INIT.search(line.message):
            out.append(("init", line))
        elif CUDA_OOM.search(line.message):
            out.append(("out-of-memory", line))
        elif CUDA_ERROR.search(line.message):
            out.append(("error", line))
    return out


def classify(ev: Evidence, xids: list[XidEvent], cuda: list[tuple[str, LogLine]]) -> Finding:
    gpu = ev.gpu
    hardware = [x for x in xids if describe(x.code).origin != "app"]
    app = [x for x in xids if describe(x.code).origin == "app"]
    if gpu.state == "no-library" and not ev.nvidia_pci and not ev.nvidiactl:
        return Finding(
            Severity.INFO,
            "no-gpu",
            "no NVIDIA GPU and no driver here: GPU checks skipped",
            step="classify",
            evidence=(gpu.detail,),
            fix="nothing to do, unless this machine should have one (lspci | grep -i nvidia)",
        )
    if gpu.state == "no-module":
        # The binding is missing (the normal state on Debian 12): no word on the driver.
        return Finding(
            Severity.WARNING,
            "cannot-tell",
            "cannot tell the GPU's state: the NVML Python binding (nvidia-ml-py) is not "
            "installed, so the driver was not asked",
            step="classify",
            evidence=(gpu.detail,),
            fix="pip install nvidia-ml-py (or your distribution's python3 package of it), "
            "then run doctor again",
        )
    if gpu.state == "no-permission":
        return Finding(
            Severity.INFO,
            "no-permission",
            "cannot open the NVIDIA devices as this user: run as root to classify",
            step="classify",
            evidence=(gpu.detail,),
            fix="sudo spark-guard doctor",
        )
    if gpu.state != "ok" or not ev.nvidiactl or not gpu.cards:
        evidence = [gpu.detail]
        if not ev.nvidiactl:
            evidence.append("/dev/nvidiactl does not exist")
        if ev.nvidia_pci:
            evidence.append(f"{ev.nvidia_pci} NVIDIA device(s) on the PCI bus")
        evidence += [x.line for x in hardware[-3:]]
        return Finding(
            Severity.CRITICAL,
            "driver-level",
            "driver-level: the driver or the GPU is gone from NVML's view",
            step="classify",
            evidence=tuple(evidence),
            fix="lsmod | grep nvidia; dkms status; journalctl -k | grep NVRM; after an Xid 79 "
            "only a reboot brings the GPU back",
        )
    if hardware:
        codes = sorted({x.code for x in hardware})
        return Finding(
            worst(describe(x.code) for x in hardware),
            "hardware/firmware-level",
            f"hardware/firmware-level: NVML sees the GPU, but the kernel logged Xid "
            f"{', '.join(map(str, codes))}",
            step="classify",
            evidence=tuple(x.line for x in hardware[-3:]),
            fix="read the Xid findings below; they say what to check first",
        )
    if app or cuda:
        evidence = [x.line for x in app[-3:]] + [line.message for _, line in cuda[-3:]]
        return Finding(
            Severity.WARNING,
            "app-level",
            "app-level: the GPU and driver are fine; an application hit CUDA errors"
            + (
                " (Xid " + ", ".join(sorted({str(x.code) for x in app})) + ": application "
                "faults in NVIDIA's catalogue)"
                if app
                else ""
            ),
            step="classify",
            evidence=tuple(evidence),
            fix="read the loader's own log (journalctl -u UNIT) and its memory budget below",
        )
    return Finding(
        Severity.OK,
        "healthy",
        f"healthy: NVML sees {len(gpu.cards)} GPU(s), no Xid, no CUDA errors in the window",
        step="classify",
    )


def xid_findings(xids: list[XidEvent], ev: Evidence) -> list[Finding]:
    by_code: dict[int, list[XidEvent]] = defaultdict(list)
    for x in xids:
        by_code[x.code].append(x)
    out = []
    for code, events in sorted(by_code.items()):
        info = describe(code)
        pids = sorted({x.pid for x in events if x.pid is not None})
        units = sorted({ev.unit_of_pid[p] for p in pids if p in ev.unit_of_pid})
        who = f"; pid {', '.join(map(str, pids))}" if pids else ""
        who += f" ({', '.join(units)})" if units else ""
        out.append(
            Finding(
                info.severity,
                f"xid-{code}",
                f"Xid {code} ({info.name}) x{len(events)} on {events[-1].device}, "
                f"{_when(events[0].at)} .. {_when(events[-1].at)}{who}. Usual causes: "
                f"{info.causes}",
                step="kernel",
                evidence=(events[-1].line, f"catalogue: {CATALOGUE_URL}"),
                fix=info.first_check,
            )
        )
    if not xids and ev.logs:
        out.append(Finding(Severity.OK, "no-xid", "no NVRM Xid lines in the window", step="kernel"))
    return out


def _densest(times: list[float], window: float) -> int:
    times = sorted(times)
    return max(
        (sum(1 for t in times[i:] if t - start <= window) for i, start in enumerate(times)),
        default=0,
    )


WEDGE = Finding(
    Severity.INFO,
    "wedge-signature",
    "the unified-memory wedge, should this machine have hung before: ping answers, ssh "
    "times out, no OOM kill, no panic; only a power cycle helps (NVIDIA/open-gpu-kernel-"
    "modules issue 1358). doctor cannot see a past wedge, only these lines; spark-guard's "
    "device floor and make-room are what prevent it",
    step="kernel",
    fix="spark-guard preflight --make-room UNIT as the loader's ExecStartPre=",
)


def nv_no_memory_findings(ev: Evidence) -> list[Finding]:
    lines = [ln for ln in ev.logs if ln.kernel and NV_NO_MEMORY.search(ln.message)]
    if not lines:
        return []
    burst = _densest([ln.at for ln in lines], NV_NO_MEMORY_WINDOW)
    seen = (
        f"{len(lines)} NVRM NV_ERR_NO_MEMORY line(s), {_when(lines[0].at)} .. "
        f"{_when(lines[-1].at)}, at most {burst} within a minute"
    )
    evidence = (lines[-1].message,)
    if not ev.mem_total:
        return [
            Finding(
                Severity.INFO,
                "nv-no-memory",
                f"{seen}; memory not read, so not judged: the line alone is not a sign "
                "(the driver logs it at rest and on healthy starts too, vllm issue 56824)",
                step="kernel",
                evidence=evidence,
            ),
            WEDGE,
        ]
    floor = ev.floor
    figures = (
        f"MemFree {format_size(ev.mem_free)}, MemAvailable {format_size(ev.mem_available)}, "
        f"page cache {format_size(ev.file_cache)}, free in 2 MiB blocks "
        + (format_size(ev.huge_free) if ev.huge_free is not None else "unknown")
        + f"; the device floor {format_size(floor)}"
    )
    severity = Severity.CRITICAL if burst >= NV_NO_MEMORY_BURST else Severity.WARNING
    if ev.mem_free < floor:
        # MemAvailable counts the page cache; a GPU allocation on unified memory cannot
        # take it until it is dropped.
        cache = ev.mem_available >= 2 * ev.mem_free
        finding = Finding(
            severity,
            "nv-no-memory",
            f"{seen}, and MemFree has collapsed to {format_size(ev.mem_free)}, under the "
            f"device floor {format_size(floor)}: on unified memory a GPU allocation gets "
            "MemFree, not MemAvailable"
            + (
                f"; MemAvailable {format_size(ev.mem_available)} counts the page cache "
                f"({format_size(ev.file_cache)}), which the GPU cannot use until it is dropped"
                if cache
                else f"; MemAvailable {format_size(ev.mem_available)} is low too: "
                "memory is used, not cached"
            ),
            step="kernel",
            evidence=(*evidence, figures),
            fix="sync; echo 1 > /proc/sys/vm/drop_caches, or let spark-guard make room: "
            "spark-guard preflight --make-room UNIT as ExecStartPre="
            if cache
            else "spark-guard status: stop what holds the memory before the next start",
        )
    elif ev.huge_free is not None and ev.huge_free < floor:
        finding = Finding(
            severity,
            "nv-no-memory",
            f"{seen}, and free memory is fragmented: MemFree {format_size(ev.mem_free)}, "
            f"but only {format_size(ev.huge_free)} of it in blocks of 2 MiB or larger, "
            f"under the device floor {format_size(floor)}; large allocations can fail "
            "although MemFree looks fine",
            step="kernel",
            evidence=(*evidence, figures),
            fix="echo 1 > /proc/sys/vm/compact_memory, or let spark-guard make room: "
            "spark-guard preflight --make-room UNIT as ExecStartPre=",
        )
    else:
        finding = Finding(
            Severity.INFO,
            "nv-no-memory",
            f"{seen}; alone the line is not a sign: the driver logs it at rest and on "
            "healthy starts too (vllm issue 56824). Memory now is above the device floor, "
            "neither collapsed nor fragmented; this judges memory now, not at the time "
            "of the line",
            step="kernel",
            evidence=(*evidence, figures),
        )
    return [finding, WEDGE]


def driver_findings(ev: Evidence, storms: set[str]) -> list[Finding]:
    gpu = ev.gpu
    if gpu.state != "ok":
        return []
    out = [
        Finding(
            Severity.INFO,
            "versions",
            f"driver {gpu.driver_version or '?'}, CUDA {gpu.cuda_version or '?'} (the highest "
            "CUDA the driver supports)",
            step="driver",
        )
    ]
    for card in gpu.cards:
        if card.persistence is None:
            out.append(
                Finding(
                    Severity.INFO,
                    "persistence-unknown",
                    f"GPU {card.index}: persistence mode not reported by this GPU",
                    step="driver",
                    evidence=(f"nvidia-persistenced: {ev.persistenced}",),
                )
            )
        elif not card.persistence and ev.persistenced != "active":
            loader_storm = any(_is_loader(u, ev) for u in storms)
            out.append(
                Finding(
                    Severity.WARNING if loader_storm else Severity.INFO,
                    "persistence-off",
                    f"GPU {card.index}: persistence mode off and nvidia-persistenced not "
                    "running. It matters when GPU processes start and stop often or "
                    "initialise concurrently (each first open re-initialises the GPU, "
                    "seconds); a long-running server does not care"
                    + ("; a loader is in a restart storm here" if loader_storm else ""),
                    step="driver",
                    evidence=(f"nvidia-persistenced: {ev.persistenced}",),
                    fix="systemctl enable --now nvidia-persistenced",
                )
            )
    return out


def card_findings(ev: Evidence) -> list[Finding]:
    out = []
    for c in ev.gpu.cards:
        tag = f"GPU {c.index} ({c.name})"
        if c.pcie_width is not None and c.pcie_width_max and c.pcie_width < c.pcie_width_max:
            out.append(
                Finding(
                    Severity.WARNING,
                    "pcie-width",
                    f"{tag}: PCIe link x{c.pcie_width}, the card can do x{c.pcie_width_max}",
                    step="card",
                    evidence=(f"gen {c.pcie_gen} of {c.pcie_gen_max}",),
                    fix="reseat the card or riser; check the slot; kernel log for AER errors",
                )
            )
        if c.pcie_gen is not None and c.pcie_gen_max and c.pcie_gen < c.pcie_gen_max:
            out.append(
                Finding(
                    Severity.INFO,
                    "pcie-gen",
                    f"{tag}: PCIe gen {c.pcie_gen}, the card can do gen {c.pcie_gen_max}; "
                    "normal at idle (the link slows down to save power)",
                    step="card",
                    fix="check again under load: nvidia-smi -q -d PCIE",
                )
            )
        if c.temperature is not None and c.temperature_slowdown:
            margin = c.temperature_slowdown - c.temperature
            sev = (
                Severity.CRITICAL
                if margin <= 0
                else Severity.WARNING
                if margin <= 5
                else Severity.OK
            )
            out.append(
                Finding(
                    sev,
                    "temperature",
                    f"{tag}: {c.temperature} °C, slowdown at {c.temperature_slowdown} °C",
                    step="card",
                    fix=""
                    if sev == Severity.OK
                    else "check airflow and fans; clocks drop at slowdown",
                )
            )
        if c.power is not None and c.power_limit:
            capped = c.power >= 0.98 * c.power_limit
            out.append(
                Finding(
                    Severity.WARNING if capped else Severity.OK,
                    "power",
                    f"{tag}: drawing {c.power:.0f} W of a {c.power_limit:.0f} W limit"
                    + ("; clocks are power-capped" if capped else ""),
                    step="card",
                    fix="nvidia-smi -q -d POWER,PERFORMANCE (throttle reasons)" if capped else "",
                )
            )
        gpu_total = sum(p.used or 0 for p in ev.gpu.processes)
        if c.memory_used is None:
            out.append(
                Finding(
                    Severity.INFO,
                    "memory-not-supported",
                    f"{tag}: device memory figure NOT SUPPORTED (as on GB10, which shares "
                    f"system memory); per-process: {format_size(gpu_total)} in "
                    f"{len(ev.gpu.processes)} process(es)",
                    step="card",
                    evidence=tuple(
                        f"pid {p.pid} ({ev.unit_of_pid.get(p.pid, '?')}): "
                        f"{format_size(p.used) if p.used is not None else 'n/a'}"
                        for p in ev.gpu.processes
                    ),
                )
            )
        elif c.memory_total:
            share = c.memory_used / c.memory_total
            out.append(
                Finding(
                    Severity.WARNING if share > 0.9 else Severity.OK,
                    "memory",
                    f"{tag}: {format_size(c.memory_used)} of {format_size(c.memory_total)} "
                    f"used ({share:.0%})",
                    step="card",
                    fix="spark-guard status; nvidia-smi --query-compute-apps=pid,used_memory "
                    "--format=csv"
                    if share > 0.9
                    else "",
                )
            )
    return out


def _storms(ev: Evidence) -> dict[str, list[LogLine]]:
    by_unit: dict[str, list[LogLine]] = defaultdict(list)
    for line in ev.logs:
        if line.message_id == RESTART_SCHEDULED and line.unit:
            by_unit[line.unit].append(line)
    storms = {}
    for unit, lines in by_unit.items():
        if _densest([line.at for line in lines], STORM_WINDOW) >= STORM_COUNT:
            storms[unit] = sorted(lines, key=lambda line: line.at)
    return storms


def application_findings(
    ev: Evidence, storms: dict[str, list[LogLine]], cuda: list[tuple[str, LogLine]]
) -> list[Finding]:
    out = []
    for unit, lines in sorted(storms.items()):
        loader = _is_loader(unit, ev)
        out.append(
            Finding(
                Severity.CRITICAL if loader else Severity.WARNING,
                "restart-storm",
                f"{unit}: restarted {len(lines)} times, at least {STORM_COUNT} within "
                f"{STORM_WINDOW / 60:g} min (last {_when(lines[-1].at)})"
                + ("; a model loader: each start loads the model again" if loader else ""),
                step="application",
                evidence=(lines[-1].message,),
                fix=f"spark-guard audit {unit}; spark-guard harden {unit} (StartLimit, RestartSec)",
            )
        )
    kills: dict[str, list[str]] = defaultdict(list)
    memcg_unit: dict[int, str] = {}  # pid -> unit, from the kernel's oom-kill: line
    for line in ev.logs:
        if line.kernel and (m := OOM_TASK.search(line.message)):
            unit = next(
                (p for p in reversed(m.group("memcg").split("/")) if p.endswith(".service")), ""
            )
            if unit:
                memcg_unit[int(m.group("pid"))] = unit
    for line in ev.logs:
        if line.kernel and (m := OOM_KILL.search(line.message)):
            pid = int(m.group("pid"))
            unit = ev.unit_of_pid.get(pid) or memcg_unit.get(pid) or m.group("name")
            kills[unit].append(line.message)
        elif line.message_id == UNIT_OOM_KILLED and line.unit:
            kills[line.unit].append(line.message)
    for unit, records in sorted(kills.items()):
        loader = _is_loader(unit, ev, unit)
        out.append(
            Finding(
                Severity.WARNING if loader else Severity.INFO,
                "oom-kill",
                f"{unit}: killed by the kernel's OOM killer ({len(records)} record(s))",
                step="application",
                evidence=(records[-1],),
                fix=f"spark-guard preflight {unit}: the load did not fit next to what ran"
                if loader
                else "",
            )
        )
    by_kind: dict[tuple[str, str], list[LogLine]] = defaultdict(list)
    for kind, line in cuda:
        by_kind[(line.unit or line.identifier, kind)].append(line)
    nexts = {
        "out-of-memory": "spark-guard preflight {unit}; a smaller -c/--ctx-size, or fewer -ngl",
        "init": "nvidia-smi; the driver/CUDA versions above; is the GPU held or gone?",
        "error": "the loader's log around it; the Xid findings above",
    }
    for (unit, kind), lines in sorted(by_kind.items()):
        out.append(
            Finding(
                Severity.WARNING,
                f"cuda-{kind}",
                f"{unit}: {len(lines)} CUDA {kind.replace('-', ' ')} line(s), last "
                f"{_when(lines[-1].at)}",
                step="application",
                evidence=(lines[-1].message,),
                fix=nexts[kind].format(unit=unit),
            )
        )
    budget = ev.mem_total - ev.reserve
    boot_total = 0
    for b in ev.budgets:
        if b.expected is None:
            out.append(
                Finding(
                    Severity.INFO,
                    "budget-unknown",
                    f"{b.unit}: footprint unknown ({b.source})",
                    step="application",
                    fix="set it in /etc/spark-guard.toml [loaders.footprint]",
                )
            )
            continue
        if b.autostart:
            boot_total += b.expected
        fits = b.expected <= budget
        out.append(
            Finding(
                Severity.OK if fits else Severity.CRITICAL,
                "budget",
                f"{b.unit}: expects {format_size(b.expected)} of a "
                f"{format_size(budget)} budget (MemTotal {format_size(ev.mem_total)} less "
                f"the reserve {format_size(ev.reserve)})",
                step="application",
                evidence=(b.source,),
                fix=""
                if fits
                else f"a smaller quantisation or context: spark-guard preflight {b.unit}",
            )
        )
    if boot_total > budget:
        out.append(
            Finding(
                Severity.CRITICAL,
                "budget-boot",
                f"the loaders started at boot expect {format_size(boot_total)} together, "
                f"more than the {format_size(budget)} budget: the guard will block some",
                step="application",
                evidence=tuple(
                    f"{b.unit}: {format_size(b.expected)}"
                    for b in ev.budgets
                    if b.autostart and b.expected is not None
                ),
                fix="spark-guard audit; disable all but one at boot",
            )
        )
    return out


def judge(ev: Evidence) -> Report:
    xids = _xids(ev)
    cuda = _cuda_lines(ev)
    storms = _storms(ev)
    first = classify(ev, xids, cuda)
    findings = [first, *unreached_findings(ev.unreached, "application")]
    findings += [Finding(Severity.INFO, "log-limit", lim, step="kernel") for lim in ev.log_limits]
    findings += xid_findings(xids, ev)
    findings += nv_no_memory_findings(ev)
    findings += driver_findings(ev, set(storms))
    findings += card_findings(ev)
    findings += application_findings(ev, storms, cuda)
    return Report(first.code, tuple(findings))
