"""Every kind of event the guard logs, with its journal MESSAGE_ID.

`journalctl MESSAGE_ID=<id>` finds every event of one kind; the IDs never
change once released (the message catalog of the package keys on them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Level = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class Event:
    """Something to tell the journal, as plain data: pure code returns these and the I/O
    side logs them (act.tell). `kind` is a key of MESSAGE_IDS."""

    kind: str
    level: Level
    msg: str
    fields: dict[str, Any] = field(default_factory=dict)


MESSAGE_IDS: dict[str, str] = {
    "guard-started": "8499ee7b395245ab811cf26e83911ead",
    "guard-stopping": "a7c0e1ea184a4cc0889c96bef6fc0c8f",
    "config-invalid": "87366aeaf55f458d943fef92003a4a27",
    "config-reloaded": "7d4a83b4823b4e968a980fd1f014ef5f",
    "config-reload-refused": "e20ac1ea7c5840379b8d230be52f7ba4",
    "gpu-accounting-off": "343fe5ebb11843f6a0753f7357559624",
    "gpu-accounting-on": "be04c5795d1e46efba08aea465d37337",
    "gpu-hung": "3e52a17603ff4bf49ccaadef383cdf03",
    "manager-connected": "542be34c8de6421cb66e1a009b6949e3",
    "manager-lost": "be412eceffd849ddaa1bd575d38bd4b3",
    "manager-untrusted": "30ca554172384757b931717acb0d32b7",
    "engine-unanswered": "c7752726b9074718bb28d293086eea7d",
    "loader-seen": "4a07fefefba742fca5fdea72ee9904c8",
    "phase-changed": "9fdd30b2101e4b4a800f03b3587ed425",
    "decision": "386c475fe9d64cdfb4d03ede643cd1d2",
    "unit-stop-requested": "068574cbf2c74b65a6744f41ff55b762",
    "unit-stop-failed": "83856f75370143689e0f5965a4cac00b",
    "dry-run": "447c739011624aacb47ca3408ec3d060",
    "psi-trigger-off": "8844c0d55c5b4cc5aa406731145534b5",
    "memlock-failed": "3a49c4fbc7094cfe942a2efc3bada846",
    "sense-failed": "6776d5f685704f268d151cecab7fe43f",
    "unit-stopped": "ac1d944d0c8d44ed93bdcfe43c2997d2",
    "unit-killed": "9b512aa4392b4cc0bba33a359d89d6f1",
    "unit-blocked": "946bcf8b7d054547a32d497077fd9379",
    "block-failed": "330a79dbc034448fb7ac4365419fa51a",
    "block-renewed": "7bd47e0684834296bc60c60039672a7c",
    "state-busy": "5a7570cfeac84610a641f9fd4ec39f7f",
    "record-unreadable": "83cd7014831d45e299290fff91c64030",
    "banner-failed": "207ebaccb9e84fdda1a859a2242a75b1",
    "unit-released": "9fcd4780bf5842c78919f0d3599374b2",
    "footprint-unknown": "a33da9a96833480f84e35b39ca9edd11",
    "metrics-off": "4f76fb80581c4fd68ec441a08693e7b4",
    "brake": "1def070118a642b092262264a76aea3c",
    "brake-released": "c725e9176903439d992f0b8cbe64ac37",
    "thaw-failed": "aae995cb63eb4e29b028f0e3ff7e0e94",
    "brake-failed": "2a96ecf430f04dac84d957db813eff70",
    "pressure-wake": "2197032827e94d129a83292ae1436385",
    "memlock": "1eb07c395299433ca89f86cd6e77583b",
    "state-unwritten": "4bdea0cfb6d6492e82c9984b50394eed",
    "room-made": "687c3cf5d15744ea932bb082c17fed2a",
    "room-failed": "41e7b70ba971400ca7fa5fe322aaeea5",
}
