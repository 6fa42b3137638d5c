"""NVIDIA Xid events: what the driver's `NVRM: Xid` kernel lines mean and what to check first.

Source: NVIDIA's Xid catalogue, "Xid Errors" in the GPU deployment and
management documentation, https://docs.nvidia.com/deploy/xid-errors/
(the catalogue table: analyzing-xid-catalog.html, with its "resolution
bucket" per Xid: RESTART_APP, RESET_GPU, CONTACT_SUPPORT, ...). The texts
below are our summaries of it for an admin at a shell, not copies.

`origin` says where NVIDIA's catalogue puts the usual cause: "app" Xids are
faults of one program (the GPU itself is fine), the rest point at the
driver, firmware or hardware.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..findings import Severity

CATALOGUE_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


@dataclass(frozen=True)
class XidInfo:
    code: int
    name: str
    severity: Literal[Severity.WARNING, Severity.CRITICAL]
    origin: str  # app | driver | hardware | firmware
    causes: str
    first_check: str


_CATALOGUE = (
    XidInfo(
        13,
        "Graphics engine exception",
        Severity.WARNING,
        "app",
        "an application fault on the GPU: out-of-range memory access or an illegal "
        "instruction in a kernel; rarely a driver bug",
        "restart the application; if it recurs with one model or build, run it under "
        "compute-sanitizer and check the llama.cpp/CUDA versions",
    ),
    XidInfo(
        31,
        "GPU memory page fault",
        Severity.WARNING,
        "app",
        "an application touched GPU memory it did not own (MMU fault); often a "
        "use-after-free or a bad offset in the program, sometimes the driver",
        "restart the application; note which process (pid= in the line) and whether "
        "it recurs after a driver update",
    ),
    XidInfo(
        43,
        "GPU stopped processing",
        Severity.WARNING,
        "app",
        "a user application hit a software-induced fault and its channel was stopped; "
        "the GPU stays usable by other processes",
        "restart the application that owned the channel; look at its own log for the "
        "error just before",
    ),
    XidInfo(
        45,
        "Preemptive cleanup, due to previous errors",
        Severity.WARNING,
        "app",
        "the driver cleaned up a channel because its process was killed (OOM killer, "
        "SIGKILL, Restart=) or after an earlier Xid; a follow-up, not a cause",
        "look at the Xid or kill just before it: an OOM kill of the loader is the "
        "usual origin on a shared-memory machine",
    ),
    XidInfo(
        48,
        "Double-bit ECC error",
        Severity.CRITICAL,
        "hardware",
        "an uncorrectable error in GPU memory; the data in the affected page is lost",
        "stop the GPU's work and reset the GPU (or reboot); if it repeats, the board "
        "needs service (nvidia-smi -q -d ECC)",
    ),
    XidInfo(
        63,
        "ECC page retirement or row remapping recorded",
        Severity.WARNING,
        "hardware",
        "the driver recorded a failing memory row/page to be retired or remapped",
        "reset the GPU (or reboot) at a quiet moment so the remap takes effect; "
        "check nvidia-smi -q -d ROW_REMAPPER",
    ),
    XidInfo(
        64,
        "ECC page retirement or row remapping failed",
        Severity.CRITICAL,
        "hardware",
        "a failing memory row could not be recorded for retirement or remapping",
        "reset the GPU; if it repeats, contact NVIDIA support with nvidia-bug-report.sh",
    ),
    XidInfo(
        74,
        "NVLink error",
        Severity.CRITICAL,
        "hardware",
        "an NVLink link reported an error (link training, CRC, replay) between GPUs or GPU and CPU",
        "check nvidia-smi nvlink -s and -e; reset the GPU; recurring errors on one link "
        "need service",
    ),
    XidInfo(
        79,
        "GPU has fallen off the bus",
        Severity.CRITICAL,
        "hardware",
        "the GPU stopped answering on its bus: power delivery, thermal shutdown, a PCIe "
        "link or riser fault, or a firmware hang",
        "reboot (the driver cannot recover it); then check power and cooling, PCIe "
        "AER messages in the kernel log, and the link width/generation below",
    ),
    XidInfo(
        92,
        "High single-bit ECC error rate",
        Severity.WARNING,
        "hardware",
        "corrected memory errors at an unusual rate: memory wearing or overheating",
        "watch nvidia-smi -q -d ECC and the temperature; plan a reset, and service if "
        "it keeps rising",
    ),
    XidInfo(
        94,
        "Contained ECC error",
        Severity.WARNING,
        "hardware",
        "an uncorrectable memory error, contained to the processes using that memory",
        "restart the affected application(s); a row remap is pending until the next GPU reset",
    ),
    XidInfo(
        95,
        "Uncontained ECC error",
        Severity.CRITICAL,
        "hardware",
        "an uncorrectable memory error that could not be contained: every process on "
        "the GPU is affected",
        "stop all GPU work and reset the GPU (or reboot); repeated events need service",
    ),
    XidInfo(
        119,
        "GSP RPC timeout",
        Severity.CRITICAL,
        "firmware",
        "the GPU System Processor firmware did not answer the driver in time: a "
        "firmware hang, often under load or at init",
        "reset the GPU or reboot; update the driver; collect nvidia-bug-report.sh if it repeats",
    ),
    XidInfo(
        120,
        "GSP error",
        Severity.CRITICAL,
        "firmware",
        "the GPU System Processor firmware reported an error",
        "reset the GPU or reboot; update the driver; collect nvidia-bug-report.sh if it repeats",
    ),
)
CATALOGUE: dict[int, XidInfo] = {x.code: x for x in _CATALOGUE}


def describe(code: int) -> XidInfo:
    """The entry for code, or a placeholder that points at the catalogue."""
    known = CATALOGUE.get(code)
    if known is not None:
        return known
    return XidInfo(
        code,
        "not in spark-guard's table",
        Severity.WARNING,
        "unknown",
        "see NVIDIA's catalogue",
        f"look Xid {code} up in {CATALOGUE_URL}",
    )


# NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=llama-server, GPU has fallen off the bus.
_XID = re.compile(r"NVRM: Xid \((?P<device>[^)]*)\): (?P<code>\d+)(?:, (?P<rest>.*))?")
_PID = re.compile(r"\bpid=(?P<pid>\d+)")


@dataclass(frozen=True)
class XidEvent:
    code: int
    device: str
    pid: int | None
    line: str
    at: float  # seconds since the epoch (0 when unknown)


def parse_line(line: str, at: float = 0.0) -> XidEvent | None:
    m = _XID.search(line)
    if m is None:
        return None
    pid = _PID.search(m.group("rest") or "")
    return XidEvent(
        int(m.group("code")),
        m.group("device").removeprefix("PCI:"),
        int(pid.group("pid")) if pid else None,
        line.strip(),
        at,
    )
