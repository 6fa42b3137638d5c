"""Sizes and durations: the text an admin writes and the text the guard shows.

'8GiB', '512 MiB', '1.5G', '30s', '250ms' in the config file and in unit
properties become bytes and seconds here, and bytes become '8.0GiB' again on
every screen, so every module reads and writes them the same way. Pure and
dependency-free: config, inventory and the reports all import it, and it
imports none of them.
"""

from __future__ import annotations

import re

GiB = 1024**3

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """'8GiB', '512 MiB', '1.5G' or a plain integer of bytes -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size like '8GiB', got {value!r}")
    m = _SIZE_RE.match(value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. '8GiB', '512MiB', '1.5G')")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(value: object) -> float:
    """'30s', '250ms', '2min' or a plain number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '30s', got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a duration cannot be negative: {value}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration like '30s', got {value!r}")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in _DURATION_UNITS):
        raise ValueError(f"not a duration: {value!r} (use e.g. '30s', '250ms', '2min')")
    return float(m.group(1)) * _DURATION_UNITS.get(unit, 1.0)


def format_size(n: float) -> str:
    """Bytes in the unit an admin reads at a glance (binary units, like free -h)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"
