"""How every command writes its --json document: one shape for all of them.

`--json` (or `--json=pretty`) is indented, `--json=short` one line, as systemd's
tools take it; every document says its `format` (the version of its shape), first.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

FORMAT = 1
MODES = ("pretty", "short")


def emit(doc: dict[str, Any], mode: str | bool, stream: TextIO | None = None) -> None:
    """Write `doc` with its `format` first, as `mode` says (True: pretty)."""
    out = stream or sys.stdout
    shaped = {
        "format": doc.get("format", FORMAT),
        **{k: v for k, v in doc.items() if k != "format"},
    }
    if mode == "short":
        json.dump(shaped, out, separators=(",", ":"))
    else:
        json.dump(shaped, out, indent=1)
    out.write("\n")
