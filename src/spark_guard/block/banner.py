"""The note at login while something is blocked: what, why, and how to undo it.

Written to /run/motd.d/ (pam_motd shows it on ssh and console logins) and to
the console's issue file (before the login prompt; the package links
/etc/issue.d/spark-guard.issue to it). Removed once nothing is blocked, so
the rescue instructions are on the machine exactly while they are needed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..core.block import Step
from ..core.text import printable
from ..system.safefs import MAKEDIRS, own_tree
from .records import Record

# Per field of the note: a unit name fits (systemd allows 255 bytes), a long path is cut.
FIELD_LIMIT = 300
# Rows of the note per manager, and in all: one user's thousand units (issue 40, H8) would
# be a thousand lines at every login, on the console too, and push everyone else's out.
# The rest is counted; `spark-guard release --all --dry-run` lists every one.
ROWS_PER_MANAGER = 5
ROWS = 30


def render(records: Iterable[Record]) -> str:
    rows = sorted(records, key=lambda r: (r.manager, r.unit))
    if not rows:
        return ""
    lines = ["spark-guard blocked model loaders to keep this machine reachable:"]
    per: dict[str, int] = {}  # each manager's records, shown or not
    shown = 0
    for r in rows:
        per[r.manager] = per.get(r.manager, 0) + 1
        if per[r.manager] > ROWS_PER_MANAGER or shown == ROWS:
            continue
        shown += 1
        # Every field can hold a user's text (a unit name, a model path): one line each, inert.
        ref, step, at, reason, detail = (
            printable(v, FIELD_LIMIT) for v in (r.ref, r.step, r.at, r.reason, r.detail)
        )
        state = "blocked" if r.step == Step.BLOCKED else f"blocking ({step})"
        lines.append(f"  {ref}  {state} since {at}: {reason}: {detail}")
        if r.problem:
            lines.append(f"      problem: {printable(r.problem, FIELD_LIMIT)}")
    if len(rows) > shown:
        most = ", ".join(
            f"{printable(m, FIELD_LIMIT)} {n}" for m, n in per.items() if n > ROWS_PER_MANAGER
        )
        lines.append(
            f"  ... and {len(rows) - shown} more (spark-guard release --all --dry-run lists them"
            + (f"; in all: {most})" if most else ")")
        )
    boxes = sum(r.ref.is_container for r in rows)
    if boxes == len(rows):
        lines.append("They are stopped, their restart policy set to no (the old one recorded).")
    elif boxes:
        lines.append("Units are stopped, masked until reboot and disabled; containers are")
        lines.append("stopped, their restart policy set to no (the old one recorded).")
    else:
        lines.append("They are stopped, masked until reboot and disabled.")
    lines += [
        "  details:  spark-guard status; journalctl -t spark-guard",
        "  undo:     spark-guard release UNIT   (or: spark-guard release --all)",
        "",
    ]
    return "\n".join(lines)


def write(path: str, text: str) -> None:
    """Replace the note atomically, or remove it when there is nothing to say.

    Through safefs: never through a symlink, a random temporary name per writer
    (the daemon and release both write it), parent directories made as needed.
    """
    if not text:
        own_tree().unlink(path)
        return
    own_tree().write(path, text.encode(), mode=0o644, create=MAKEDIRS)


def sweep(*paths: str) -> list[str]:
    """Remove what a writer of these notes that died left beside them (safefs's
    temporary files): in /etc, they are the admin's directory's clutter."""
    tree = own_tree()
    return [
        gone
        for path in paths
        for gone in tree.remove_leftovers(os.path.dirname(path), {os.path.basename(path)})
    ]


def publish(records: Iterable[Record], motd: str, issue: str) -> str:
    text = render(records)
    write(motd, text)
    # agetty reads backslash escapes in issue files (unit names can hold \x2d).
    write(issue, text.replace("\\", "\\\\"))
    return text
