"""psutil against the guard's hand-written /proc readers, on this machine's real /proc.

    .venv/bin/python -m benchmarks.psutil_cost [--repeat 21] [--runs 15] [--mib 1]

Needs psutil in the venv (`.venv/bin/pip install psutil`); the guard itself does not
import it. Each row is timed timeit-style: --repeat rounds, each calling the reader
`number` times in a loop, the variants of one row interleaved round by round so drift
hits them alike. Shown: the median per call and the interquartile range of the rounds
(q1-q3), and each variant against the first row as the ratio of their times in the same
round: the median ratio and its q1-q3. A difference is beyond noise when that ratio's
q1-q3 leaves out 1.00 (most rounds agree on which is faster).

- quiet pass: what the guard reads on every quiet pass (0.1-5 s apart): MemTotal and
  MemAvailable. ProcFS.memory() against psutil.virtual_memory().
- full look, the process walk: every PID's cgroup and RSS. ProcFS.pids() and
  process(pid) against psutil.pids() and Process(pid).memory_info().rss, and against
  psutil.process_iter() (which keeps its Process objects from one call to the next, as
  a daemon would). psutil has no cgroup reader, so its variants still call the
  hand-written ProcFS.cgroup(pid) for each PID: the walk as it would really run.
- cmdline of every process, and of one process with a 1 MiB argv (a shell with eight
  128 KiB arguments, started here and killed at the end): ProcFS.cmdline (bounded:
  ARGV_MAX_BYTES) against Process.cmdline() on Process objects made beforehand (what
  the walk would hand it; the most favourable case for psutil).
- import: wall time of a fresh interpreter that imports psutil against one that
  imports nothing (median of --runs), `-X importtime`'s cumulative figure, and the
  VmRSS that `import psutil` adds, to a bare interpreter and to one holding the
  guard's own modules (the daemon's goal: RSS under 30 MiB).

Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

from spark_guard.core.snapshot import ARGV_MAX_BYTES, Memory
from spark_guard.system.procfs import ProcFS

GONE = (psutil.NoSuchProcess, psutil.AccessDenied)
GUARD_IMPORTS = (
    "import spark_guard.daemon, sdnotify; from spark_guard import log;"
    " log.configure('journal'); from spark_guard.system.managers import _dbuslib; _dbuslib()"
)
REPORT = (
    "\nfor line in open('/proc/self/status'):\n"
    "    if line.startswith('VmRSS:'):\n"
    "        print(int(line.split()[1]))\n"
)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


class Timing:
    def __init__(self, per_call: list[float]) -> None:
        self.per_call = per_call
        self.q1, self.median, self.q3 = quartiles(per_call)

    def against(self, first: Timing) -> str:
        """The paired ratio to `first`, round by round, and whether it is beyond noise."""
        pairs = zip(self.per_call, first.per_call, strict=True)
        q1, median, q3 = quartiles([a / b for a, b in pairs])
        verdict = "within noise" if q1 <= 1.0 <= q3 else "beyond noise"
        return f"{median:.2f}x ({q1:.2f}-{q3:.2f}), {verdict}"


def timed(fns: dict[str, Callable[[], object]], number: int, repeat: int) -> dict[str, Timing]:
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm caches and psutil's own state once
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            began = time.perf_counter()
            for _ in range(number):
                fn()
            rounds[name].append((time.perf_counter() - began) / number)
    return {name: Timing(per_call) for name, per_call in rounds.items()}


def shown(seconds: float) -> str:
    us = seconds * 1e6
    if us < 1000:
        return f"{us:.1f} µs"
    return f"{us / 1000:.2f} ms"


# --- the readers, each way -----------------------------------------------------------------


def quiet_pass(procfs: ProcFS) -> dict[str, Callable[[], object]]:
    def psutil_memory() -> Memory:
        m = psutil.virtual_memory()
        return Memory(m.total, m.available)

    return {"ProcFS.memory()": procfs.memory, "psutil.virtual_memory()": psutil_memory}


def process_walk(procfs: ProcFS) -> dict[str, Callable[[], object]]:
    def hand() -> list[object]:
        return [info for pid in procfs.pids() if (info := procfs.process(pid)) is not None]

    def fresh() -> list[tuple[int, str, int]]:
        out = []
        for pid in psutil.pids():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except GONE:
                continue
            cgroup = procfs.cgroup(pid)  # psutil has no cgroup reader
            if cgroup is not None:
                out.append((pid, cgroup, rss))
        return out

    def kept() -> list[tuple[int, str, int]]:
        out = []
        for p in psutil.process_iter():
            try:
                rss = p.memory_info().rss
            except GONE:
                continue
            cgroup = procfs.cgroup(p.pid)
            if cgroup is not None:
                out.append((p.pid, cgroup, rss))
        return out

    return {
        "ProcFS.pids() + process(pid)": hand,
        "psutil.pids() + Process(pid).memory_info() + ProcFS.cgroup": fresh,
        "psutil.process_iter() + memory_info() + ProcFS.cgroup": kept,
    }


def cmdlines(procfs: ProcFS, pids: list[int]) -> dict[str, Callable[[], object]]:
    procs = []
    for pid in pids:
        with contextlib.suppress(*GONE):
            procs.append(psutil.Process(pid))

    def hand() -> list[object]:
        return [procfs.cmdline(pid) for pid in pids]

    def theirs() -> list[object]:
        out: list[object] = []
        for p in procs:
            try:
                out.append(p.cmdline())
            except GONE:
                out.append(None)
        return out

    return {"ProcFS.cmdline": hand, "psutil Process.cmdline()": theirs}


def huge_argv(mib: int) -> subprocess.Popen[bytes]:
    """A process whose argv is `mib` MiB: 128 KiB arguments (MAX_ARG_STRLEN less the NUL).
    The shell waits in its builtin `read`, so it has no child left behind when killed."""
    words = ["a" * (128 * 1024 - 1)] * (mib * 8)
    return subprocess.Popen(["sh", "-c", "read -r _", "sh", *words], stdin=subprocess.PIPE)


# --- import cost ---------------------------------------------------------------------------


def wall_ms(code: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return (time.perf_counter() - began) * 1000


def importtime_ms() -> float:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import psutil"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in out.stderr.splitlines():
        _, _, rest = line.partition("import time:")
        fields = [f.strip() for f in rest.split("|")]
        if len(fields) == 3 and fields[2] == "psutil":
            return int(fields[1]) / 1000
    raise RuntimeError("no psutil line in -X importtime output")


def rss_kib(code: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", code + REPORT],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"{code!r} failed: {out.stderr.strip()}")
    return int(out.stdout.split()[-1])


def machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({model}), Linux {platform.release()}, "
        f"Python {platform.python_version()}, psutil {psutil.__version__}"
    )


def table(title: str, rows: dict[str, Timing], extra: dict[str, str] | None = None) -> None:
    first = next(iter(rows.values()))
    print(f"\n{title}\n")
    print("| reader | median per call | q1-q3 | time against the first row, per round |")
    print("|---|---|---|---|")
    for name, t in rows.items():
        against = "-" if t is first else t.against(first)
        note = f" ({extra[name]})" if extra and name in extra else ""
        print(f"| {name}{note} | {shown(t.median)} | {shown(t.q1)}-{shown(t.q3)} | {against} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=21, help="rounds per row")
    ap.add_argument("--runs", type=int, default=15, help="fresh interpreters per import row")
    ap.add_argument("--mib", type=int, default=1, help="size of the huge argv")
    args = ap.parse_args()

    procfs = ProcFS("/proc")
    psutil.PROCFS_PATH = "/proc"
    print(machine())
    print(f"{len(procfs.pids())} processes; median of {args.repeat} rounds")

    table(
        "Quiet pass (MemTotal, MemAvailable), 2000 calls a round:",
        timed(quiet_pass(procfs), 2000, args.repeat),
    )
    table(
        "Full look, the process walk (cgroup and RSS of every PID), 20 walks a round:",
        timed(process_walk(procfs), 20, args.repeat),
    )
    pids = [pid for pid in procfs.pids() if pid != os.getpid()]
    table(
        f"cmdline of every process ({len(pids)}), 20 rounds of all:",
        timed(cmdlines(procfs, pids), 20, args.repeat),
    )

    huge = huge_argv(args.mib)
    try:
        time.sleep(0.2)
        fns = cmdlines(procfs, [huge.pid])
        got = {"ProcFS.cmdline": procfs.cmdline(huge.pid) or ()}
        got["psutil Process.cmdline()"] = tuple(psutil.Process(huge.pid).cmdline())
        sizes = {k: f"{len(v)} args, {sum(len(a) + 1 for a in v):,} bytes" for k, v in got.items()}
        table(
            f"cmdline of one process with a {args.mib} MiB argv "
            f"(bound: ARGV_MAX_BYTES = {ARGV_MAX_BYTES // 1024} KiB), 20 reads a round:",
            timed(fns, 20, args.repeat),
            sizes,
        )
    finally:
        huge.kill()
        huge.wait()

    bare = [wall_ms("pass") for _ in range(args.runs)]
    imported = [wall_ms("import psutil") for _ in range(args.runs)]
    importtime = statistics.median(importtime_ms() for _ in range(args.runs))
    rss = {
        code: statistics.median(rss_kib(code) for _ in range(args.runs))
        for code in ("pass", "import psutil", GUARD_IMPORTS, GUARD_IMPORTS + "; import psutil")
    }
    print(f"\nImport cost, median of {args.runs} fresh interpreters:\n")
    print("| what | figure |")
    print("|---|---|")
    print(
        f"| interpreter start, exit: nothing / `import psutil` | "
        f"{statistics.median(bare):.1f} ms / {statistics.median(imported):.1f} ms |"
    )
    print(f"| `-X importtime`, psutil cumulative | {importtime:.1f} ms |")
    alone = rss["import psutil"] - rss["pass"]
    print(
        f"| VmRSS: bare / `import psutil` | {rss['pass'] / 1024:.1f} MiB / "
        f"{rss['import psutil'] / 1024:.1f} MiB (+{alone / 1024:.1f} MiB) |"
    )
    with_guard = rss[GUARD_IMPORTS + "; import psutil"] - rss[GUARD_IMPORTS]
    print(
        f"| VmRSS: the guard's modules / and psutil | {rss[GUARD_IMPORTS] / 1024:.1f} MiB / "
        f"{rss[GUARD_IMPORTS + '; import psutil'] / 1024:.1f} MiB (+{with_guard / 1024:.1f} MiB) |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
