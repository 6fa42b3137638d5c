"""The logs doctor reads: the journal (journalctl), or the kernel ring buffer when there is none.

Three targeted reads, not a walk through everything since --since: kernel
messages (_TRANSPORT=kernel, every boot in the window, not just this one),
systemd's own restart and OOM-kill records (by their catalog MESSAGE_IDs,
from PID 1 and user managers), and lines that mention CUDA or running out of
memory (journalctl --grep). Parsing is separate and pure (`parse_entry`).
Not on the guard's action path: this runs journalctl.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ...core.snapshot import USER_PREFIX

# systemd's catalog: "Automatic restarting of a unit has been scheduled" and
# "A process of this unit has been killed by the OOM killer".
RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"
UNIT_OOM_KILLED = "fe6faa94e7774663a0da52717891d8ef"
CUDA_PATTERN = r"cuda|out of memory|cudaMalloc|failed to allocate|no CUDA-capable"


@dataclass(frozen=True)
class LogLine:
    at: float  # seconds since the epoch
    message: str
    unit: str  # "name.service", "user:UID:name.service" or ""
    kernel: bool = False
    message_id: str = ""
    identifier: str = ""


@dataclass
class Logs:
    lines: list[LogLine] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # what was read
    limits: list[str] = field(default_factory=list)  # what could not be, and why


# The fields a sender chooses (MESSAGE_ID, UNIT=, USER_UNIT=; `logger --journald` sets any)
# against the ones journald itself adds from the kernel (_UID, _COMM, _SYSTEMD_UNIT).
SYSTEMD_IDS = frozenset({RESTART_SCHEDULED, UNIT_OOM_KILLED})


def _sender(entry: Mapping[str, object]) -> str:
    """Who may speak of units here, by journald's own fields: "root" (PID 1, or any of
    root's processes), "manager" (a user's own systemd, in her user@UID.service), or ""
    (anyone else: what it says of units is not believed)."""
    uid = str(entry.get("_UID", ""))
    if uid == "0":
        return "root"
    if (
        uid
        and entry.get("_SYSTEMD_UNIT") == f"user@{uid}.service"
        and entry.get("_COMM")
        in (
            "systemd",
            "(sd-pam)",
        )
    ):
        return "manager"
    return ""


def parse_entry(entry: Mapping[str, object]) -> LogLine | None:
    """One journalctl -o json entry -> LogLine (None when it has no text message).

    Which unit a line is about comes from fields the sender chooses only when root sent
    it, or a user's own manager about her own units; anyone else's line is about the unit
    its process runs in, and cannot carry systemd's restart or OOM-kill MESSAGE_IDs
    (a user's `logger --journald` forging a restart storm of PID 1's unit)."""
    message = entry.get("MESSAGE")
    if not isinstance(message, str):
        return None  # binary or absent
    uid = str(entry.get("_UID", ""))
    sender = _sender(entry)
    fields = {
        "root": (("USER_UNIT", True), ("UNIT", False)),
        "manager": (("USER_UNIT", True),),
        "": (),
    }[sender] + (("_SYSTEMD_USER_UNIT", True), ("_SYSTEMD_UNIT", False))
    unit = ""
    for key, user in fields:
        value = entry.get(key)
        if isinstance(value, str) and value:
            unit = f"{USER_PREFIX}{uid}:{value}" if user and uid else value
            break
    message_id = str(entry.get("MESSAGE_ID", ""))
    if message_id in SYSTEMD_IDS and not sender:
        message_id = ""  # not systemd's word: read as any other line
    try:
        at = int(str(entry.get("__REALTIME_TIMESTAMP", "0"))) / 1e6
    except ValueError:
        at = 0.0
    return LogLine(
        at,
        message,
        unit,
        kernel=entry.get("_TRANSPORT") == "kernel",
        message_id=message_id,
        identifier=str(entry.get("SYSLOG_IDENTIFIER", "")),
    )


def parse_kmsg(records: Iterable[str], boot_epoch: float) -> list[LogLine]:
    """/dev/kmsg records ("pri,seq,usec,flags;text", continuation lines start with a space)."""
    out = []
    for record in records:
        head, sep, text = record.partition(";")
        if not sep or record.startswith(" "):
            continue
        fields = head.split(",")
        try:
            usec = int(fields[2])
        except (IndexError, ValueError):
            continue
        out.append(LogLine(boot_epoch + usec / 1e6, text.rstrip("\n"), "", kernel=True))
    return out


def _journalctl(args: list[str], since: str, directory: str | None) -> tuple[list[LogLine], str]:
    where = ["--directory", directory] if directory else []
    cmd = ["journalctl", "--no-pager", "-q", "-o", "json", "--since", since, *where, *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return [], f"{' '.join(cmd)}: no answer in 120 s"
    lines = []
    for raw in out.stdout.splitlines():
        with contextlib.suppress(ValueError):
            line = parse_entry(json.loads(raw))
            if line is not None:
                lines.append(line)
    # --grep with nothing matching exits 1 and says nothing: that is not an error.
    said = out.stderr.strip().splitlines()
    error = "" if out.returncode == 0 or not said else said[-1]
    return lines, error


def _can_read_all_journals() -> bool:
    if os.geteuid() == 0:
        return True
    groups = set()
    for gid in os.getgroups():
        with contextlib.suppress(KeyError):
            groups.add(grp.getgrgid(gid).gr_name)
    return bool(groups & {"systemd-journal", "adm", "wheel"})


def read_kmsg(path: str, logs: Logs) -> None:
    """The kernel ring buffer (this boot only); needs root where dmesg_restrict is set."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        logs.limits.append(f"{path}: {e.strerror}: kernel messages not read (run as root)")
        return
    records: list[str] = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # records overwritten while reading: go on with the next
                if e.errno == errno.EAGAIN:
                    break
                raise
            if not chunk:
                break
            records.extend(chunk.decode(errors="replace").splitlines())
    finally:
        os.close(fd)
    with open("/proc/uptime") as f:
        boot_epoch = time.time() - float(f.read().split()[0])
    logs.lines.extend(parse_kmsg(records, boot_epoch))
    logs.sources.append(path)


# How many directory entries has_journal_files() looks at, at most.
JOURNAL_LOOK = 4096


def has_journal_files(directory: str) -> bool:
    """Whether journalctl --directory has anything to read: journal files in the directory
    or one level down (a machine's /var/log/journal keeps them under its machine id)."""
    todo, looked = [directory], 0
    for depth in range(2):
        below = []
        for path in todo:
            try:
                with os.scandir(path) as it:
                    for entry in it:
                        looked += 1
                        if looked > JOURNAL_LOOK:
                            return False
                        if entry.name.endswith((".journal", ".journal~")):
                            return True
                        if depth == 0 and entry.is_dir(follow_symlinks=False):
                            below.append(entry.path)
            except OSError:
                continue
        todo = below
    return False


def read(since: str, kmsg: str = "/dev/kmsg", directory: str | None = None) -> Logs:
    """The journal since `since` (a journalctl time); `directory`: journal files of another
    system (a rescued disk's /var/log/journal), whose kernel ring buffer is not this one."""
    logs = Logs()
    if directory is None and not _can_read_all_journals():
        logs.limits.append(
            "not root and not in group systemd-journal or adm: only your own journal "
            "is read (the system's and other users' are not); run as root"
        )
    if shutil.which("journalctl") is None:
        logs.limits.append("journalctl not found: the journal is not read")
        read_kmsg(kmsg, logs)
        return logs
    if directory is not None and not has_journal_files(directory):
        # journalctl reads nothing there and says nothing: the run would look clean.
        logs.limits.append(
            f"{directory}: no journal files in it (*.journal, here or one level down, as "
            "in /var/log/journal/MACHINE-ID/): no log was read"
        )
        return logs
    kernel, error = _journalctl(["_TRANSPORT=kernel"], since, directory)
    if error:
        logs.limits.append(f"journal (kernel messages): {error}")
    systemd, error = _journalctl(
        [f"MESSAGE_ID={RESTART_SCHEDULED}", "+", f"MESSAGE_ID={UNIT_OOM_KILLED}"],
        since,
        directory,
    )
    if error:
        logs.limits.append(f"journal (restarts, OOM kills): {error}")
    cuda, error = _journalctl(["--case-sensitive=false", "--grep", CUDA_PATTERN], since, directory)
    if error:
        logs.limits.append(f"journal (CUDA errors): {error}")
    logs.lines += kernel + systemd + [line for line in cuda if not line.kernel]
    logs.sources.append(f"journal{' in ' + directory if directory else ''} since {since}")
    if not kernel and directory is None:
        # No kernel messages in the journal (journald not reading them, or no rights to
        # the system journal): the ring buffer still has this boot's.
        read_kmsg(kmsg, logs)
    return logs


# The kernel's two lines per OOM kill; the first names the victim's cgroup, hence its unit.
OOM_TASK = re.compile(
    r"oom-kill:.*task_memcg=(?P<memcg>[^,]*),task=(?P<name>[^,]+),pid=(?P<pid>\d+)"
)
OOM_KILL = re.compile(r"Out of memory: Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)")
