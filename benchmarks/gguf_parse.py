"""Header parse time: spark-guard's reader against gguf-py's GGUFReader, on every test file.

    .venv/bin/python -m benchmarks.gguf_parse

Real files (lab/testdata.py: 19 vocab-only GGUFs and SmolLM2-135M) and the
synthetic big-model headers (lab/synth.py, with a token list of the
model's vocabulary size, as real files have). Ours: best of 5 runs; gguf-py:
one run (it takes seconds). Goal: at least 50x faster, under 100 ms each.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import gguf

from lab import synth, testdata
from spark_guard.foresight.gguf import read_header


def best_of(n: int, fn: object, arg: str) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn(arg)  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        files = testdata.real_ggufs(fetch=True)
        files += [synth.write(spec, Path(tmp), vocabulary=True) for spec in synth.SPECS.values()]
        print("| file | size | ours | gguf-py | speed-up |")
        print("|---|---|---|---|---|")
        worst, slowest_ratio = 0.0, float("inf")
        for f in files:
            ours = best_of(5, read_header, str(f))
            ref = best_of(1, gguf.GGUFReader, str(f))
            worst = max(worst, ours)
            slowest_ratio = min(slowest_ratio, ref / ours)
            size = f.stat().st_size / 2**20
            print(
                f"| {f.name} | {size:.1f} MiB | {ours * 1000:.1f} ms | {ref * 1000:.0f} ms "
                f"| {ref / ours:.0f}x |"
            )
    print(f"\nslowest header: {worst * 1000:.1f} ms; smallest speed-up: {slowest_ratio:.0f}x")
    return 0 if worst < 0.1 and slowest_ratio >= 50 else 1


if __name__ == "__main__":
    raise SystemExit(main())
