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

# Binary, as systemd reads sizes (K, M, G, T are 1024-based); its decimal KB, MB... it
# refuses, and so does this: '8GB' taken as 8 * 1000**3 was 7.5 GiB without a word.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
}
_DECIMAL = ("kb", "mb", "gb", "tb")
# systemd's time span units (systemd.time(7)).
_DURATION_UNITS = {
    "us": 1e-6,
    "usec": 1e-6,
    "ms": 0.001,
    "msec": 0.001,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
    "w": 604800.0,
    "week": 604800.0,
    "weeks": 604800.0,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SPAN_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)")


def parse_size(value: object) -> int:
    """'8GiB', '512 MiB', '1.5G' or a plain integer of bytes -> bytes. K, M, G, T are
    binary, as systemd reads them; '8GB' is refused, as systemd refuses it."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size like '8GiB', got {value!r}")
    m = _SIZE_RE.match(value)
    if m and m.group(2).lower() in _DECIMAL:
        binary = m.group(2)[0].upper()
        raise ValueError(
            f"{value!r}: decimal units are not taken, as systemd does not take them; "
            f"write '{m.group(1)}{binary}' or '{m.group(1)}{binary}iB' (1024-based) or bytes"
        )
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. '8GiB', '512MiB', '1.5G')")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(value: object) -> float:
    """'30s', '250ms', '2min', '1d', '1h 30min' (systemd's time spans) or a plain number
    of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like '30s', got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a duration cannot be negative: {value}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration like '30s', got {value!r}")
    bad = ValueError(f"not a duration: {value!r} (use e.g. '30s', '250ms', '2min', '1h 30min')")
    text = value.strip()
    if not text or len(text) > 64:
        raise bad
    total, at, parts = 0.0, 0, 0
    while at < len(text):
        m = _SPAN_PART.match(text, at)
        if m is None or m.end() == at:
            raise bad
        unit = m.group(2).lower()
        if unit == "":
            if parts or m.end() != len(text):
                raise bad  # a bare number is seconds only on its own
        elif unit not in _DURATION_UNITS:
            raise bad
        total += float(m.group(1)) * _DURATION_UNITS.get(unit, 1.0)
        at, parts = m.end(), parts + 1
    return total


def format_size(n: float) -> str:
    """Bytes in the unit an admin reads at a glance (binary units, like free -h)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"
