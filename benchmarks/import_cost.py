"""What each of the guard's dependencies costs in resident memory, imported alone.

Each row is a fresh interpreter (the one running this script, `-S`-free, as
the guard runs) that imports one thing and reports its own VmRSS from
/proc/self/status; the median of --runs. The first row imports nothing: every
other row's "added" column is over it. pystemd's D-Bus module is loaded the
way the guard loads it (managers._dbuslib(): the extension without pystemd's
package, which would pull lxml in), and once as `import pystemd.dbuslib` for
comparison. The last row is the daemon's module with what it loads once it
runs: its logging set up for the journal, the D-Bus module, sdnotify.

    .venv/bin/python -m benchmarks.import_cost [--runs 5]

Prints the table docs/benchmarks.md shows, in Markdown, to be pasted unedited.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys

ROWS = (
    ("bare interpreter", "pass"),
    ("structlog", "import structlog"),
    (
        "pystemd's D-Bus module, as the guard loads it",
        "from spark_guard.system.managers import _dbuslib; _dbuslib()",
    ),
    ("pystemd.dbuslib (the whole package)", "import pystemd.dbuslib"),
    ("sdnotify", "import sdnotify"),
    (
        "all of the above as the running guard loads them",
        "import spark_guard.daemon, sdnotify; from spark_guard import log;"
        " log.configure('journal'); from spark_guard.system.managers import _dbuslib; _dbuslib()",
    ),
)

REPORT = (
    "\nfor line in open('/proc/self/status'):\n"
    "    if line.startswith('VmRSS:'):\n"
    "        print(int(line.split()[1]))\n"
)


def rss_kib(code: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", code + REPORT], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    measured = [
        (name, statistics.median(rss_kib(code) for _ in range(args.runs))) for name, code in ROWS
    ]
    bare = measured[0][1]
    print(
        f"Python {platform.python_version()}, {platform.machine()}; "
        f"VmRSS after the import, median of {args.runs}:"
    )
    print()
    print("| import | RSS | added to a bare interpreter |")
    print("|---|---|---|")
    for name, kib in measured:
        added = "-" if kib == bare else f"{(kib - bare) / 1024:.1f} MB"
        print(f"| {name} | {kib / 1024:.1f} MB | {added} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
