"""What the admin tools find, and how bad it is: one Finding, one Severity, one order.

`spark-guard audit` and `spark-guard doctor` both judge a machine and report
Findings; each prints them its own way on a terminal, but what a finding is,
which severity is worse and how --json writes one is said here once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from enum import StrEnum
from typing import Any, Protocol, TextIO


class Severity(StrEnum):
    """How bad a finding is, least to worst: the members' order is the one order.

    The values are what the reports print and what --json carries. A StrEnum
    compares as its text, so compare severities by `rank` (or `at_least`),
    never with < or >.
    """

    OK = "ok"
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        """0 for ok, up to 3 for critical."""
        return _RANK[self]

    def at_least(self, other: Severity) -> bool:
        return self.rank >= other.rank


_RANK = {severity: rank for rank, severity in enumerate(Severity)}

# ANSI SGR for each severity on a terminal: red for critical, yellow for a warning.
_COLOURS = {Severity.OK: "32", Severity.INFO: "", Severity.WARNING: "33", Severity.CRITICAL: "1;31"}


def colours_wanted(stream: TextIO) -> bool:
    """Colours as systemd's tools decide them: SYSTEMD_COLORS says (0/false/no: none;
    anything else: colours), else NO_COLOR set means none, else a terminal gets them."""
    forced = os.environ.get("SYSTEMD_COLORS")
    if forced is not None:
        return forced.lower() not in ("0", "false", "no", "off")
    if "NO_COLOR" in os.environ:
        return False
    return stream.isatty() and os.environ.get("TERM") != "dumb"


def label(severity: Severity, *, colour: bool = False) -> str:
    """The one word audit and doctor print for a severity, padded to 8, coloured when
    asked."""
    word = f"{severity.upper():8}"
    code = _COLOURS[severity]
    return f"\x1b[{code}m{word}\x1b[0m" if colour and code else word


@dataclass(frozen=True)
class Finding:
    """One thing a tool found, and what to do about it.

    Audit names the unit a finding is about; doctor files it under one of its
    steps and quotes the log lines it rests on. A field a tool does not use
    stays empty.
    """

    severity: Severity
    code: str  # short and stable: "duplicate", "xid-79", ...
    message: str
    _: KW_ONLY
    fix: str = ""  # the command that fixes it, or the next thing to check ("" for none)
    unit: str = ""  # audit: the unit it is about ("" for the machine as a whole)
    step: str = ""  # doctor: the step that found it (judge.STEPS)
    evidence: tuple[str, ...] = ()  # doctor: the lines it rests on

    def as_json(self) -> dict[str, Any]:
        """The one --json form of a finding, for audit and doctor alike: a field a tool
        does not fill is null (evidence: an empty list)."""
        return {
            "severity": self.severity.value,
            "code": self.code,
            "message": self.message,
            "fix": self.fix or None,
            "unit": self.unit or None,
            "step": self.step or None,
            "evidence": list(self.evidence),
        }


class Graded(Protocol):
    """Anything with a severity: a Finding, an entry of the Xid catalogue."""

    @property
    def severity(self) -> Severity: ...


def worst(items: Iterable[Graded]) -> Severity:
    """The worst severity among items; ok for none."""
    return max((i.severity for i in items), key=_RANK.__getitem__, default=Severity.OK)


def worst_first(item: Graded) -> int:
    """Sort key: the worst first, items of one severity in their order (sorted is stable)."""
    return -item.severity.rank
