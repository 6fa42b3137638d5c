"""The guard's settings, parsed strictly from the text of /etc/spark-guard.toml.

Every key is declared once in SCHEMA, with the Config field it sets and the
converter that checks it (defaults are Config's own); the parser refuses
unknown keys, wrong types and bad sizes with an error that names the file,
the key and the line, so an admin can fix it without reading code.
Reading the file is spark_guard.config's: this module is the policy's view.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from .quantities import GiB, parse_duration, parse_size
from .text import printable


class ConfigError(ValueError):
    """One problem in one place: str() is the line an admin reads."""

    def __init__(self, path: str, key: str | None, line: int | None, problem: str) -> None:
        self.path, self.key, self.line, self.problem = path, key, line, problem
        where = path + (f":{line}" if line else "")
        super().__init__(f"{where}: {key + ': ' if key else ''}{problem}")


DEFAULT_LOADER_PATTERNS = (
    "llama",
    "ds4",
    "deepseek",
    "lms",
    "lmstudio",
    "ollama",
    "qwen",
    "vllm",
    "sglang",
    "gguf",
    "koboldcpp",
    "text-generation",
)
DEFAULT_LOADER_BINARIES = (
    "llama-server",
    "llama-cli",
    "llama-run",
    "llama-box",
    "ollama",
    "lms",
    "lmstudio",
    "lm-studio",
    "vllm",
    "sglang",
    "koboldcpp",
    "text-generation-launcher",
    "text-generation-server",
)
DEFAULT_PROTECTED = (
    "ssh.service",
    "ssh.socket",
    "sshd.service",
    "sshd@*.service",
    "ssh@*.service",
    "getty@*.service",
    "serial-getty@*.service",
    "console-getty.service",
    "dbus.service",
    "dbus.socket",
    "dbus-broker.service",
    "systemd-journald.service",
    "systemd-logind.service",
    "display-manager.service",
    "gdm.service",
    "gdm3.service",
    "lightdm.service",
    "sddm.service",
    "spark-guard.service",
    "user@*.service",
    "init.scope",
)
DEFAULT_RESCUE = ("ssh.service|ssh.socket|sshd.service",)


class Steady(StrEnum):
    """[budget] steady: what the guard does once boot is over."""

    GUARD = "guard"  # go on stopping what threatens the reserve, as at boot
    WARN = "warn"  # say what it would stop, and stop nothing
    OFF = "off"  # neither: the guard acts at boot only


@dataclass(frozen=True)
class Config:
    """Plain settings; defaults here are the built-in protection."""

    # [budget]
    reserve: int = 8 * GiB
    reserve_percent: float = 7.0
    steady: Steady = Steady.GUARD
    # [memory]: unified memory (docs/unified-memory.md)
    unified: str = "auto"  # auto (NVML says), yes, no
    # MemFree kept above this on unified memory by making room: the field's 8 GiB on a
    # 121.7 GiB DGX Spark, scaled by MemTotal; `floor` (bytes) instead when not 0.
    floor: int = 0
    floor_percent: float = 6.6
    make_room: bool = True
    make_room_every: float = 1.0  # seconds: the least time between two reclaims
    # [boot]
    rescue_units: tuple[str, ...] = DEFAULT_RESCUE
    rescue_graphical: str = "auto"
    grace: float = 60.0
    # What a loader the guard cannot size may hold before the rescue window is open.
    unsized: int = 2 * GiB
    # [poll]
    poll_min: float = 0.1
    poll_max: float = 2.0
    poll_strict: float = 0.5
    psi_stall: float = 0.15
    # [trend]
    trend_window: float = 5.0
    trend_horizon: float = 10.0
    # [loaders]
    patterns: tuple[str, ...] = DEFAULT_LOADER_PATTERNS
    extra_patterns: tuple[str, ...] = ()
    binaries: tuple[str, ...] = DEFAULT_LOADER_BINARIES
    extra_binaries: tuple[str, ...] = ()
    footprint: Mapping[str, int] = field(default_factory=dict)
    # [protected]
    # PID 1's units: a name protects on its own level only (a user's sshd@x.service is hers).
    protected: tuple[str, ...] = DEFAULT_PROTECTED
    user_protected: tuple[str, ...] = ()  # every user manager's units (none by default)
    # Each says its level: NAME (PID 1), user:NAME, user:UID:NAME, container:NAME.
    extra_protected: tuple[str, ...] = ()
    # [gpu]
    gpu: bool = True
    gpu_retry: float = 60.0  # seconds between attempts to find a missing driver
    gpu_deadline: float = 2.0  # seconds the loop waits for NVML; later, figures are stale
    # [containers]: engines asked about the containers whose processes the guard sees
    containers: bool = True
    engines: tuple[str, ...] = ("/run/docker.sock", "/run/podman/podman.sock")
    # A user's own (rootless) engines: sockets in her runtime dir, asked about her containers.
    user_engines: tuple[str, ...] = ("podman/podman.sock", "docker.sock")
    engine_timeout: float = 2.0  # seconds for one call to an engine
    docker_root: str = "/var/lib/docker"  # dockerd's data-root: read while its API is silent
    # [guard]
    dry_run: bool = False
    repeat_after: float = 30.0
    stop_timeout: float = 10.0
    kill_timeout: float = 3.0
    # [paths]
    proc: str = "/proc"
    system_manager: str = "/run/systemd/private"
    user_runtime: str = "/run/user"
    cgroup: str = "/sys/fs/cgroup"
    state: str = "/var/lib/spark-guard"
    motd: str = "/run/motd.d/spark-guard"
    issue: str = "/run/spark-guard/issue"
    runtime: str = "/run/spark-guard"
    linger: str = "/var/lib/systemd/linger"
    dev: str = "/dev"
    sysfs: str = "/sys"
    kmsg: str = "/dev/kmsg"
    # [metrics]
    metrics_textfile: str = "/var/lib/prometheus/node-exporter/spark_guard.prom"

    def reserve_for(self, mem_total: int) -> int:
        """The reserve is the larger of a fixed floor and a share of MemTotal."""
        return max(self.reserve, int(mem_total * self.reserve_percent / 100))

    def floor_for(self, mem_total: int) -> int:
        """The device floor: MemFree the guard keeps free for GPU allocations, by making room."""
        return self.floor or int(mem_total * self.floor_percent / 100)

    @property
    def loader_patterns(self) -> tuple[str, ...]:
        return self.patterns + self.extra_patterns

    @property
    def loader_binaries(self) -> tuple[str, ...]:
        return self.binaries + self.extra_binaries

    @property
    def protected_units(self) -> tuple[str, ...]:
        return self.protected + self.extra_protected


# --- the schema: (section, key) -> (Config field, converter) ---
# A converter takes the TOML value and returns the field's value, or raises ValueError
# with what is wrong (the parser adds the file, key and line).


def _enum(*choices: str) -> Callable[[object], str]:
    def conv(v: object) -> str:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {v!r}")
        return str(v)

    return conv


def _str_list(v: object) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"expected a list of non-empty strings, got {v!r}")
    return tuple(v)


def _relative_list(v: object) -> tuple[str, ...]:
    """Paths within a user's runtime dir: relative, no `..`, no empty component."""
    out = _str_list(v)
    for x in out:
        parts = x.split("/")
        if x.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"expected paths relative to a user's runtime dir, got {x!r}")
    return out


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def _percent(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 90:
        raise ValueError(f"expected a number from 0 to 90, got {v!r}")
    return float(v)


def _path(v: object) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise ValueError(f"expected an absolute path, got {v!r}")
    return v


def _positive_duration(v: object) -> float:
    d = parse_duration(v)
    if d <= 0:
        raise ValueError(f"must be longer than zero, got {v!r}")
    return d


def _textfile(v: object) -> str:
    if v == "":
        return ""
    path = _path(v)
    if not path.endswith(".prom"):
        raise ValueError(f"node_exporter reads only *.prom files, got {v!r}")
    return path


SCHEMA: dict[tuple[str, str], tuple[str, Callable[[object], Any]]] = {
    ("budget", "reserve"): ("reserve", parse_size),
    ("budget", "reserve_percent"): ("reserve_percent", _percent),
    ("budget", "steady"): ("steady", lambda v: Steady(_enum(*Steady)(v))),
    ("memory", "unified"): ("unified", _enum("auto", "yes", "no")),
    ("memory", "floor"): ("floor", parse_size),
    ("memory", "floor_percent"): ("floor_percent", _percent),
    ("memory", "make_room"): ("make_room", _bool),
    ("memory", "make_room_every"): ("make_room_every", _positive_duration),
    ("boot", "rescue_units"): ("rescue_units", _str_list),
    ("boot", "rescue_graphical"): ("rescue_graphical", _enum("auto", "yes", "no")),
    ("boot", "grace"): ("grace", parse_duration),
    ("boot", "unsized"): ("unsized", parse_size),
    ("poll", "min"): ("poll_min", _positive_duration),
    ("poll", "max"): ("poll_max", _positive_duration),
    ("poll", "strict"): ("poll_strict", _positive_duration),
    ("poll", "psi_stall"): ("psi_stall", parse_duration),
    ("trend", "window"): ("trend_window", _positive_duration),
    ("trend", "horizon"): ("trend_horizon", parse_duration),
    ("loaders", "patterns"): ("patterns", _str_list),
    ("loaders", "extra_patterns"): ("extra_patterns", _str_list),
    ("loaders", "binaries"): ("binaries", _str_list),
    ("loaders", "extra_binaries"): ("extra_binaries", _str_list),
    ("protected", "units"): ("protected", _str_list),
    ("protected", "user_units"): ("user_protected", _str_list),
    ("protected", "extra"): ("extra_protected", _str_list),
    ("gpu", "enabled"): ("gpu", _bool),
    ("gpu", "retry"): ("gpu_retry", _positive_duration),
    ("gpu", "deadline"): ("gpu_deadline", _positive_duration),
    ("containers", "enabled"): ("containers", _bool),
    ("containers", "engines"): ("engines", _str_list),
    ("containers", "user_engines"): ("user_engines", _relative_list),
    ("containers", "timeout"): ("engine_timeout", _positive_duration),
    ("containers", "docker_root"): ("docker_root", _path),
    ("guard", "dry_run"): ("dry_run", _bool),
    ("guard", "repeat_after"): ("repeat_after", parse_duration),
    ("guard", "stop_timeout"): ("stop_timeout", _positive_duration),
    ("guard", "kill_timeout"): ("kill_timeout", _positive_duration),
    ("paths", "proc"): ("proc", _path),
    ("paths", "system_manager"): ("system_manager", _path),
    ("paths", "user_runtime"): ("user_runtime", _path),
    ("paths", "cgroup"): ("cgroup", _path),
    ("paths", "state"): ("state", _path),
    ("paths", "motd"): ("motd", _path),
    ("paths", "issue"): ("issue", _path),
    ("paths", "runtime"): ("runtime", _path),
    ("paths", "linger"): ("linger", _path),
    ("paths", "dev"): ("dev", _path),
    ("paths", "sysfs"): ("sysfs", _path),
    ("paths", "kmsg"): ("kmsg", _path),
    ("metrics", "textfile"): ("metrics_textfile", _textfile),
}
# [loaders.footprint] is a table of unit-name glob -> size.
FOOTPRINT_TABLE = ("loaders", "footprint")

_FIELD_NAMES = {f.name for f in fields(Config)}
assert all(name in _FIELD_NAMES for name, _ in SCHEMA.values())


def _line_of(text: str, section: str, key: str | None) -> int | None:
    """Line of `key` inside `[section]` (or of the header when key is None).

    tomllib keeps no positions, so this scans: enough for the flat files the
    guard reads, and it degrades to no line rather than a wrong one.
    """
    current = ""
    header = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
    for number, raw in enumerate(text.splitlines(), start=1):
        m = header.match(raw)
        if m:
            current = ".".join(p.strip().strip('"') for p in m.group(1).split("."))
            if key is None and current == section:
                return number
            continue
        if key is not None and current == section:
            km = re.match(r'^\s*("([^"]*)"|\'([^\']*)\'|[A-Za-z0-9_-]+)\s*=', raw)
            if km and (km.group(2) or km.group(3) or km.group(1)) == key:
                return number
    return None


def parse(text: str, path: str = "<config>") -> Config:
    """TOML text -> Config, or ConfigError naming the file, key and line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+)", str(e))
        why = str(e)
        twice = re.match(r"Cannot declare \(([^)]*)\) twice", why)
        line = int(m.group(1)) if m else None
        if twice:
            # The shipped file has every [section] already: a pasted header is the second.
            parts = [part.strip(" '") for part in twice.group(1).split(",")]
            name = ".".join(part for part in parts if part)
            why = f"[{name}] is already in this file: add these lines under the first one"
        elif why.startswith("Cannot overwrite a value") and line is not None:
            lines = text.splitlines()
            key = lines[line - 1].split("=", 1)[0].strip() if 0 < line <= len(lines) else ""
            why = f"{printable(key) or 'a key'} is set twice in its section: keep one"
        raise ConfigError(path, None, line, why) from None

    values: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                path, section, _line_of(text, "", section), "top-level keys must be in a [section]"
            )
        for key, raw in table.items():
            if (section, key) == FOOTPRINT_TABLE:
                values["footprint"] = _footprints(text, path, raw)
                continue
            spec = SCHEMA.get((section, key))
            name = f"{section}.{key}"
            if spec is None:
                line = _line_of(text, section, key) or _line_of(text, section, None)
                known = sorted(k for s, k in SCHEMA if s == section)
                if not known:  # the section itself is unknown: a typo of one, most likely
                    sections = sorted({s for s, _ in SCHEMA} | {FOOTPRINT_TABLE[0]})
                    close = difflib.get_close_matches(section, sections, n=1)
                    hint = f"; did you mean [{close[0]}]?" if close else ""
                    raise ConfigError(
                        path,
                        section,
                        _line_of(text, section, None) or line,
                        f"unknown section [{section}]{hint} (known: {', '.join(sections)})",
                    )
                if isinstance(raw, dict):  # a [section.key] table of its own
                    tables = [".".join(FOOTPRINT_TABLE)] if section == FOOTPRINT_TABLE[0] else []
                    close = difflib.get_close_matches(name, tables, n=1)
                    hint = f"; did you mean [{close[0]}]?" if close else ""
                    raise ConfigError(
                        path,
                        name,
                        _line_of(text, name, None) or line,
                        f"unknown table [{name}]{hint}",
                    )
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(
                    path,
                    name,
                    line,
                    f"unknown key{hint} (known in [{section}]: {', '.join(known)})",
                )
            field_name, convert = spec
            try:
                values[field_name] = convert(raw)
            except ValueError as e:
                raise ConfigError(path, name, _line_of(text, section, key), str(e)) from None

    config = Config(**values)
    _check_consistency(config, text, path)
    return config


def _footprints(text: str, path: str, raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise ConfigError(path, "loaders.footprint", None, "must be a table of unit = size")
    out = {}
    for unit, size in raw.items():
        try:
            out[unit] = parse_size(size)
        except ValueError as e:
            line = _line_of(text, "loaders.footprint", unit)
            raise ConfigError(path, f"loaders.footprint.{unit}", line, str(e)) from None
    return out


def _check_consistency(c: Config, text: str, path: str) -> None:
    if c.poll_min > c.poll_max:
        raise ConfigError(
            path, "poll.min", _line_of(text, "poll", "min"), "must not be longer than poll.max"
        )
