"""What processes with huge command lines cost one pass of the guard: then and now.

    .venv/bin/python -m benchmarks.argv_cost [--procs 8] [--mib 1] [--repeat 5]

A user's service runs --procs processes, each with a --mib MiB command line of
short words in 128 KiB arguments (`sh -c 'exec -a llama sleep infinity' 'a a
a ...' ...`), then each with a 60 kB `sh -c` script, laid out as
a /proc tree (cmdline, cgroup, statm) in a temporary directory. Measured, as
the median of --repeat runs:

- raw shlex, every pass (before): each pass read every cmdline whole and
  split every argument holding a space with shlex, twice (model paths, then
  loader binaries). That code is copied below, as it was.
- bounded, split once (now): the first pass reads each cmdline bounded
  (procfs.cmdline) and splits it once (classify.CommandLine), then decides;
  every later pass decides on the ready CommandLines.
- plain argv (now, one-shot commands): `audit` and `dump` hand decide() plain
  argv tuples, so each call bounds and splits them once.

Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from spark_guard.core.classify import CommandLine
from spark_guard.core.config import Config
from spark_guard.core.policy import decide
from spark_guard.core.snapshot import Memory, SeenUnit, Snapshot, UnitRef
from spark_guard.system.procfs import ProcFS

GiB = 1024**3
REF = UnitRef("user:1000", "argv.service")

# --- the per-pass argv work as classify.py did it before (copied, unchanged) -------------

_MODEL_FLAGS = {"-m", "--model", "--model-path", "--mmproj", "-md", "--model-draft"}


def _old_tokens(argv: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if " " in arg:
            try:
                out.extend(shlex.split(arg))
                continue
            except ValueError:
                pass
        out.append(arg)
    return out


def _old_model_files(argvs: Iterable[tuple[str, ...]]) -> list[str]:
    found: list[str] = []
    for argv in argvs:
        tokens = _old_tokens(argv)
        for i, tok in enumerate(tokens):
            value = tok.split("=", 1)[1] if tok.startswith("--") and "=" in tok else tok
            after_flag = i > 0 and tokens[i - 1] in _MODEL_FLAGS
            if value.lower().endswith((".gguf", ".safetensors")) or (after_flag and "/" in value):
                found.append(os.path.normpath(value))
    return found


def _old_binary_evidence(argvs: Iterable[tuple[str, ...]], binaries: tuple[str, ...]) -> str | None:
    wanted = set(binaries)
    for argv in argvs:
        tokens = _old_tokens(argv)
        for i, tok in enumerate(tokens):
            base = os.path.basename(tok)
            module = tok.split(".", 1)[0] if i > 0 and tokens[i - 1] == "-m" else None
            if base in wanted or module in wanted:
                return base if base in wanted else f"python -m {module}"
    return None


def _old_read(proc: str, pid: int) -> tuple[str, ...]:
    with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
        raw = f.read()
    return tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)


# --- the fixture -------------------------------------------------------------------------


def huge_argument(mib: int) -> list[bytes]:
    """MiBs of short words after a shell command, in 128 KiB arguments (execve's most for
    one, MAX_ARG_STRLEN): what the bounds cut."""
    words = [b"a " * (64 * 1024) for _ in range(mib * 8)]
    return [b"sh", b"-c", b"exec -a llama sleep infinity", *words]


def script_at_the_bound(_mib: int) -> list[bytes]:
    """A 60 kB `sh -c` script that loadspec reads: the most the bounds let through."""
    script = b"exec llama-server -m /srv/models/qwen.gguf " + b"'a b' " * 10_000
    return [b"sh", b"-c", script]


def lay_out(proc: Path, procs: int, argv: list[bytes]) -> list[int]:
    pids = list(range(1000, 1000 + procs))
    for pid in pids:
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "cmdline").write_bytes(b"\0".join(argv) + b"\0")
    return pids


def snapshot(exec_start: tuple[tuple[str, ...], ...], cmdlines: list[tuple[str, ...]]) -> Snapshot:
    seen = SeenUnit(
        REF, pids=(1,), exec_start=exec_start, cmdlines=tuple(cmdlines), active_since=1.0
    )
    return Snapshot(now=100.0, memory=Memory(121 * GiB, 100 * GiB), units=(seen,))


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def shown(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms * 1000:.0f} µs" if ms < 1 else f"{ms:,.1f} ms"


def measure(
    argv: list[bytes], procs: int, repeat: int, config: Config
) -> list[tuple[str, float | None, float]]:
    exec_start = (("/bin/sh", "-c", "exec -a llama sleep infinity", "$ARGS"),)
    with tempfile.TemporaryDirectory() as tmp:
        proc = Path(tmp) / "proc"
        pids = lay_out(proc, procs, argv)
        procfs = ProcFS(str(proc))

        def before() -> None:
            argvs = [*exec_start, *(_old_read(str(proc), pid) for pid in pids)]
            _old_model_files(argvs)
            _old_binary_evidence(argvs, config.loader_binaries)

        raw = [_old_read(str(proc), pid) for pid in pids]

        def before_later() -> None:  # the cmdlines were cached per process then too
            _old_model_files([*exec_start, *raw])
            _old_binary_evidence([*exec_start, *raw], config.loader_binaries)

        def now_first() -> None:
            lines = [CommandLine(procfs.cmdline(pid) or ()) for pid in pids]
            decide(snapshot(tuple(CommandLine(a) for a in exec_start), list(lines)), config)

        ready = snapshot(
            tuple(CommandLine(a) for a in exec_start),
            [CommandLine(procfs.cmdline(pid) or ()) for pid in pids],
        )
        plain = snapshot(exec_start, raw)
        return [
            (
                "raw shlex, every pass (before)",
                median_ms(before, repeat),
                median_ms(before_later, repeat),
            ),
            (
                "bounded, split once (now)",
                median_ms(now_first, repeat),
                median_ms(lambda: decide(ready, config), repeat),
            ),
            (
                "plain argv, split per call (now: audit, dump)",
                None,
                median_ms(lambda: decide(plain, config), repeat),
            ),
        ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    config = Config()
    print(
        f"{args.procs} processes of one user's service; median of {args.repeat}; "
        f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print("| each process's argv | argv handling | first pass (read, split, decide) | later pass |")
    print("|---|---|---|---|")
    for what, build in (
        (f"{args.mib} MiB of short words in 128 KiB arguments", huge_argument),
        ("60 kB `sh -c` script naming llama-server", script_at_the_bound),
    ):
        for name, first, later in measure(build(args.mib), args.procs, args.repeat, config):
            print(f"| {what} | {name} | {shown(first)} | {shown(later)} |")


if __name__ == "__main__":
    main()
