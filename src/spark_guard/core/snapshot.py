"""Plain data passed from sensing to deciding to acting.

Nothing here does I/O. A Snapshot is what the guard saw at one instant; the
policy reads it and returns Actions. Times are CLOCK_MONOTONIC seconds, the
clock systemd's *TimestampMonotonic properties use.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

SYSTEM = "system"
# The manager key of a container: not a systemd manager but its engine's
# restart policy brings it back. A container's UnitRef is ("container", NAME), shown and
# named by the admin as `container:NAME`. A user's rootless engine's container is hers:
# ("user:UID", "container:NAME"), named `user:UID:container:NAME`, judged at her level.
CONTAINER = "container"
CONTAINER_PREFIX = CONTAINER + ":"

# Docker's own grammar for container names (daemon/names: [a-zA-Z0-9][a-zA-Z0-9_.-]+;
# one character is let through too); a 64-hex id or a prefix of one matches it as well.
_CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")
CONTAINER_NAME_MAX = 255
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")


def valid_name(name: str) -> bool:
    """A container name (or id) as Docker accepts it, bounded: the only kind the guard puts
    in a request path or in a `container:NAME` reference."""
    return len(name) <= CONTAINER_NAME_MAX and _CONTAINER_NAME.fullmatch(name) is not None


def valid_id(cid: str) -> bool:
    """A container's full id: 64 hex digits."""
    return _CONTAINER_ID.fullmatch(cid) is not None


class Phase(StrEnum):
    """The guard's two phases (policy.phase); a Decision made by `spark-guard rescue` (the
    same block, by the admin's hand) has the phase RESCUE."""

    STRICT = "strict"  # boot, until the rescue units have been up for the grace period
    STEADY = "steady"
    RESCUE = "rescue"


class Reason(StrEnum):
    """Why an Action names a unit (the journal's SG_REASON, a record's reason)."""

    FOOTPRINT = "footprint"  # its expected footprint does not fit above the reserve
    TREND = "trend"  # it grows while the judged figure falls toward the reserve
    RESERVE = "reserve"  # the figure is below the reserve: the deficit is freed
    DUPLICATE = "duplicate"  # a second loader of a model one already holds
    UNSIZED = "unsized"  # boot: its footprint is unknown and it holds more than [boot] unsized
    RESCUE = "rescue"  # the admin's `spark-guard rescue`


class FootprintFrom(StrEnum):
    """Where a loader's expected footprint comes from."""

    CONFIG = "config"  # [loaders.footprint]: the admin's figure wins
    ESTIMATE = "estimate"  # foresight's, from the model and the settings
    CLIENTS = "clients"  # what the clients charged to a server ask it to load
    UNKNOWN = ""  # neither: the trend guards it


class ServerKind(StrEnum):
    """A server that loads models on request (argv/servers.py), or none."""

    LMSTUDIO = "lmstudio"
    OLLAMA = "ollama"
    NONE = ""


ActionKind = Literal["stop", "warn"]
# How a stop is done: "block" (stop, disable, mask, verify: a unit Restart= or a boot
# would bring back), "kill" (processes that are no unit the guard can block: a scope, a
# cgroup of a user's own, a user's job in a system unit; killed by the kernel's word,
# nothing is written), "stop-only" (a server that loads on request was asked over its
# API from outside any unit: stopped, never masked or disabled, since its next start
# loads nothing by itself).
StopHow = Literal["block", "kill", "stop-only"]

# Users' uids: from login.defs' UID_MIN (1000 on Debian and Ubuntu) up, less Debian's
# 60000-65535 (its own system users such as libvirt-qemu's 64055, systemd's DynamicUser=
# 61184-65519, nobody's 65534). A directory's users (LDAP, AD: often above 65535) and user
# namespaces' subuids are users': a process of such a uid inside a system unit not
# running as it is that user's job (Debian's cron has no pam_systemd, exim runs a
# .forward pipe, atd a job, a user namespace maps her to a subuid), not the unit's.
FIRST_LOGIN_UID = 1000
SYSTEM_RANGE = range(60000, 65536)

# A loader takes tens of seconds per start, so restarts closer than this are a
# storm, not a load being retried: doctor counts restarts within it, and audit
# wants a unit's start limit to span at least this long.
STORM_WINDOW = 300.0  # seconds


# Files a loader maps or names that are models (procfs finds them mapped, classify named).
MODEL_SUFFIXES = (".gguf", ".safetensors")

# What of one command line is looked at. A loader's command line, every flag spelled out,
# is under 2 KiB and under 100 arguments; a model path is at most PATH_MAX (4 KiB). 64 KiB
# holds sixteen such paths, and 1024 arguments ten times any real loader's. The kernel
# allows 2 MiB and more (ARG_MAX): a process could otherwise make every pass read and
# split megabytes, and the watchdog fires after 20 s.
ARGV_MAX_BYTES = 64 * 1024
ARGV_MAX_ARGS = 1024
# The command lines a pass holds, in bytes of argv: per unit, per manager (a user's), and
# in all. Python keeps about 7x the raw bytes (str objects, tokens): 300 processes of
# 64 KiB in one user service held 145 MiB before. The biggest processes are read first.
ARGV_UNIT_BUDGET = 128 * 1024
ARGV_OWNER_BUDGET = 512 * 1024
ARGV_PASS_BUDGET = 2 * 1024 * 1024
# A process's mapped model files: a loader maps one model, its shards and a projector;
# a real llama-server's maps is a few thousand lines, some hundred kB.
MAPS_MAX_MODELS = 16
MAPS_MAX_BYTES = 8 << 20
PATH_MAX = 4096


def server_managers(client_manager: str, runs_as: int | None) -> list[str]:
    """The managers a client's server is looked for in, in order: its own; for a system
    client also the manager of the user it runs as (root's when it runs as root). Never
    another user's for a user's client: her unit cannot get someone else's server refused."""
    if client_manager != SYSTEM:
        return [client_manager]
    return [client_manager, user_manager(runs_as or 0)]


USER_PREFIX = "user:"


def user_manager(uid: int) -> str:
    """The key of user `uid`'s manager: 'user:UID'. Manager keys are made here and read by
    manager_uid(), nowhere else."""
    return f"{USER_PREFIX}{uid}"


def manager_uid(key: str) -> int:
    """The uid a manager key names: 0 for 'system' (PID 1), UID for 'user:UID'.

    ValueError for anything else. Digits as discover() accepts them: every key
    the guard holds was built from a /run/user/UID directory it found.
    """
    if key == SYSTEM:
        return 0
    kind, _, uid = key.partition(":")
    if kind != "user" or not uid.isdigit():
        raise ValueError(f"not a manager key: {key!r} (use 'system' or 'user:UID')")
    return int(uid)  # ValueError too for the few digits int() refuses (superscripts)


# systemd's unit name grammar (systemd.unit(5)): at most 255 bytes of ASCII
# letters, digits and ":-_.\\", one "@" for a template instance, a known type.
UNIT_TYPES = (
    "service",
    "socket",
    "device",
    "mount",
    "automount",
    "swap",
    "target",
    "path",
    "timer",
    "slice",
    "scope",
)
_UNIT_NAME = re.compile(
    r"[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?\.(" + "|".join(UNIT_TYPES) + r")"
)


def valid_unit_name(name: str) -> bool:
    """Whether `name` is a unit name systemd itself would accept; anything else a manager
    reports (a user's, or a fake one) is not believed."""
    return len(name) <= 255 and _UNIT_NAME.fullmatch(name) is not None


@dataclass(frozen=True, order=True)
class UnitRef:
    """A unit in one manager: 'system' (PID 1) or 'user:UID'."""

    manager: str
    name: str

    def __str__(self) -> str:
        return self.name if self.manager == SYSTEM else f"{self.manager}:{self.name}"

    @property
    def is_container(self) -> bool:
        """A container: of an engine of root's, or of a user's own (rootless) engine. Hers
        is `container:NAME` on her manager, a name no unit can have (a unit name ends in its
        type: her unit `container:x.service` is a unit), and never root's (user:0)."""
        if self.manager == CONTAINER:
            return True
        if not (self.manager.startswith(USER_PREFIX) and self.name.startswith(CONTAINER_PREFIX)):
            return False
        try:
            uid = manager_uid(self.manager)
        except ValueError:
            return False
        return uid > 0 and valid_name(self.container_name) and not valid_unit_name(self.name)

    @property
    def container_name(self) -> str:
        return self.name[len(CONTAINER_PREFIX) :]

    @property
    def container(self) -> str:
        """The container's name as its engine knows it ("" for a unit)."""
        if self.manager == CONTAINER:
            return self.name
        return self.container_name if self.is_container else ""

    @property
    def engine_owner(self) -> int:
        """The uid whose engine a container is in: 0 for root's engines, hers for her own."""
        return 0 if self.manager == CONTAINER else manager_uid(self.manager)


def parse_ref(text: str, default_manager: str) -> UnitRef:
    """'llama' or 'llama.service' (on `default_manager`), 'user:1000:llama.service',
    'container:NAME', 'user:1000:container:NAME' (a container of her rootless engine),
    and a group of a user's processes, named by its cgroup ('user:1000:/user.slice/.../
    hideout', whose name is hers, ':' in it too)."""
    if text.startswith(CONTAINER_PREFIX):
        return UnitRef(CONTAINER, text[len(CONTAINER_PREFIX) :])
    manager, name = default_manager, text
    if text.startswith(USER_PREFIX) and text.count(":") >= 2:
        _, uid, name = text.split(":", 2)
        manager = USER_PREFIX + uid
    if "." not in name and "/" not in name and not name.startswith(CONTAINER_PREFIX):
        name += ".service"
    return UnitRef(manager, name)


@dataclass(frozen=True)
class Memory:
    """/proc/meminfo and /proc/buddyinfo, in bytes, as the quiet pass reads them.

    On unified memory (a DGX Spark) a GPU allocation gets MemFree, not MemAvailable:
    the page cache counts in MemAvailable but the driver cannot take it until it is
    dropped (docs/unified-memory.md). `free` is None where it was not read."""

    total: int
    available: int
    free: int | None = None  # MemFree
    # Page cache the kernel can drop at once: Active(file) + Inactive(file), less what is
    # dirty or under writeback.
    file_clean: int = 0
    dirty: int = 0  # Dirty + Writeback: cache that must be written before it is dropped
    # Mapped: page cache some process maps (a model in use): drop_caches never drops it,
    # memory.reclaim takes it only by evicting what is in use.
    mapped: int = 0
    shmem: int = 0  # tmpfs and shared memory: counted in the cache, never dropped
    swap_total: int = 0
    # Free in blocks of 2 MiB and larger (what a driver allocating 2 MiB pages can take
    # without a compaction); None where there is no /proc/buddyinfo.
    huge_free: int | None = None


@dataclass(frozen=True)
class MemoryRule:
    """Which figure the guard's rules judge on this machine (policy.judged).

    `unified`: CPU and GPU share one pool, so a device allocation gets MemFree.
    `make_room`: the guard drops clean page cache for it, so that cache counts as room."""

    unified: bool = False
    make_room: bool = False
    # Room is made by a way that takes mapped cache too (memory.reclaim has worked here);
    # until then only unmapped clean cache counts.
    reclaims_mapped: bool = False


def droppable(memory: Memory, rule: MemoryRule) -> int:
    """The page cache the guard can drop for the GPU: clean, and unmapped unless the way it
    makes room has been seen to take mapped pages."""
    if rule.reclaims_mapped:
        return memory.file_clean
    return max(memory.file_clean - memory.mapped, 0)


def judged(memory: Memory, rule: MemoryRule) -> int:
    """The figure every rule judges: MemAvailable, except on unified memory.

    There a GPU allocation gets MemFree, not MemAvailable: the page cache MemAvailable
    counts is no room for it until it is dropped (docs/unified-memory.md). The room a
    device allocation can be given is MemFree plus, where the guard makes room, the clean
    page cache it can drop; the lower of that and MemAvailable is judged. Low MemFree
    with clean cache to spare is then no reason to stop anything: room is made first.
    """
    if not rule.unified or memory.free is None:
        return memory.available
    room = memory.free + (droppable(memory, rule) if rule.make_room else 0)
    return min(memory.available, room)


@dataclass(frozen=True)
class Pressure:
    """PSI for memory: share of time (percent) stalled over the last 10 s.

    Not part of the Snapshot: decide() does not use it, and the daemon's PSI trigger
    is the kernel's own wake-up. `spark-guard dump --json` shows it.
    """

    some_avg10: float
    full_avg10: float


class Foreseen(StrEnum):
    """Where foresight stands on a unit's footprint; `SeenUnit.prediction` is its message."""

    KNOWN = "known"  # the bytes are in `predicted`
    PENDING = "pending"  # a model read is under way: the trend guards the unit meanwhile
    UNKNOWN = "unknown"  # none (no model named, or it cannot be read): the message says why


@dataclass(frozen=True)
class SeenUnit:
    """One unit that has processes right now, with what they hold."""

    ref: UnitRef
    active_state: str = "active"
    pids: tuple[int, ...] = ()
    rss: int = 0
    gpu: int = 0
    gpu_pids: tuple[int, ...] = ()
    # ExecStart= command lines, as the manager reports them.
    exec_start: tuple[tuple[str, ...], ...] = ()
    # Command lines of the running processes (for units whose ExecStart is a wrapper).
    cmdlines: tuple[tuple[str, ...], ...] = ()
    mapped_models: tuple[str, ...] = ()
    active_since: float | None = None
    # Bytes per second what the unit holds grew since the previous snapshot.
    growth: float = 0.0
    # The unit's own cgroup, as /proc shows it: what a kill of last resort targets.
    cgroup: str = ""
    # Foresight: bytes the load will hold, from its command line and model header;
    # `prediction` says how it was found, or why it could not be.
    predicted: int | None = None
    prediction: str = ""
    foreseen: Foreseen = Foreseen.UNKNOWN
    # Model bytes the load reads through the page cache (foresight's Prediction.page_cache):
    # on unified memory without make-room, counted on top of `predicted` while it loads.
    page_cache: int = 0
    # A start job is queued: no process yet, nothing allocated, the best time to stop it.
    starting: bool = False
    # The uid its processes run as, where foresight looked it up (a system unit's User=,
    # off the loop): whose server a client's load lands in. None: not known.
    runs_as: int | None = None

    # Its user manager did not answer, or is out of view: what the kernel shows is all
    # there is (its processes, their uid, their cgroup), and why. A block ends in a cgroup
    # kill within her own subtree until the manager answers again.
    unmanaged: str = ""
    # Not a unit the guard can stop and mask (a scope, a cgroup of a user's own below her
    # user@UID.service, a user's job inside a system unit): what it is. Judged as a unit
    # of her level (ref.manager is her user:UID); a stop kills its processes of her uid.
    group: str = ""
    # A user's job inside a service of root's managers (split_jobs()): that service. When
    # its ExecStart= runs this load by name (`runuser -u bob -- llama-server -m X`: the
    # admin wrote it), the job keeps a model loaded twice as root's units do (H11).
    within: UnitRef | None = None

    # A container (ref.manager == CONTAINER): what its engine said of it.
    container: ContainerFacts | None = None

    @property
    def used(self) -> int:
        return self.rss + self.gpu


@dataclass(frozen=True)
class ContainerFacts:
    """What the engine said of a container the guard sees run (system/engine.Container,
    cut down to what deciding and blocking need). Text is printable and capped."""

    id: str
    image: str
    engine: str  # the engine's API socket
    restart: str = ""  # its restart policy: "no" (or ""), always, unless-stopped, on-failure
    max_retries: int = 0
    # Why its image makes it a loader (containers.image_evidence), "" if it does not.
    image_evidence: str = ""
    # Its bind mounts, (source on the host, destination inside): what a path inside it
    # is on the host (classify.loaded_models compares models by that).
    mounts: tuple[tuple[str, str], ...] = ()
    # The compose project it belongs to (its com.docker.compose.project label), "": none.
    project: str = ""

    @property
    def policy(self) -> str:
        """As `docker run --restart` spells it."""
        name = self.restart or "no"
        return f"{name}:{self.max_retries}" if self.max_retries else name


@dataclass(frozen=True)
class RescueGroup:
    """Alternatives that each count as one rescue unit (ssh.service | ssh.socket)."""

    names: tuple[str, ...]
    present: bool
    # Monotonic time the first member became active; None while none is.
    active_since: float | None


@dataclass(frozen=True)
class Snapshot:
    now: float
    memory: Memory
    # (time, MemAvailable) samples, oldest first, the last one being `memory`.
    history: tuple[tuple[float, int], ...] = ()
    units: tuple[SeenUnit, ...] = ()
    rescue: tuple[RescueGroup, ...] = ()
    guard_started: float = 0.0
    # Set once the strict phase has ended: boot does not come back.
    boot_over: bool = False
    guard_unit: UnitRef | None = None
    gpu_accounting: bool = False
    gpu_stale: bool = False  # NVML hangs: the GPU figures are the last known ones
    rule: MemoryRule = MemoryRule()
    # Bytes pinned long-term (/proc/vmstat FOLL_PIN): no reclaim or compaction moves them.
    pinned: int | None = None
    # Remembered (step.GuardState): what each charged client's server held when the
    # client was first seen asking it (policy.charge_clients); the load comes on top.
    charge_bases: Mapping[UnitRef, int] = field(default_factory=dict)
    # The units whose stop the guard (or a rescue, for a block) sent and that have not yet
    # gone: deactivating, they are leaving; any other unit deactivating is judged as running.
    stopping: frozenset[UnitRef] = frozenset()


@dataclass(frozen=True)
class Loader:
    """A unit the classifier judged to be a model loader, and why."""

    seen: SeenUnit
    evidence: tuple[str, ...]
    models: tuple[str, ...]
    expected: int | None
    expected_from: FootprintFrom = FootprintFrom.UNKNOWN
    # A server that loads on request: the kind it runs, or, for a client (`lms load`,
    # `ollama run`), the kind it asks.
    serves: ServerKind = ServerKind.NONE
    asks: ServerKind = ServerKind.NONE
    # A client's load is charged to its server (policy.charge_clients): the server's
    # unit, and on the server the clients charged to it.
    charged_to: UnitRef | None = None
    clients: tuple[UnitRef, ...] = ()

    @property
    def ref(self) -> UnitRef:
        return self.seen.ref


@dataclass(frozen=True)
class Action:
    """What the policy wants done to one unit; `kind` is 'stop' or 'warn'."""

    kind: ActionKind
    unit: UnitRef
    reason: Reason
    detail: str
    figures: dict[str, int | float] = field(default_factory=dict, compare=False)
    # When this run of the unit became active: a restart is a new run to act on.
    since: float | None = None
    # On a server: the client units whose loads it was refused or blocked for.
    clients: tuple[UnitRef, ...] = ()
    how: StopHow = "block"


@dataclass(frozen=True)
class Decision:
    phase: Phase
    reserve: int
    loaders: tuple[Loader, ...]
    actions: tuple[Action, ...]
    # Slope of the judged figure over the trend window, bytes/s (negative: falling).
    slope: float = 0.0
    rule: MemoryRule = MemoryRule()
    # The judged figure (policy.judged: MemAvailable, or on unified memory the room a
    # device allocation can be given), and the device floor make-room keeps MemFree above.
    headroom: int = 0
    floor: int = 0
