"""The guard's own budget over 1,000 cycles: RSS and open fds, before and after.

    .venv/bin/python -m benchmarks.guard_budget [--rounds 100] [--users 10] [--loaders 10]

As tests/test_budget.py, longer: the guard as a Type=notify unit of a
harness user manager; each round, --users fake user managers (lab/churn.py)
appear, are believed and watched, and vanish, while --loaders loader units
start and stop. Default: 100 rounds of 10, i.e. 1,000 manager cycles and
1,000 loader start/stops. Goals: RSS <= 30 MiB throughout, open fds <= 32,
no fd (socket, pidfd, PSI) and no thread more at the end than after the
warm-up, RSS within 512 kB of it. Exits non-zero when a goal is missed.
"""

from __future__ import annotations

import argparse
import time

from lab.churn import Churn, guard_figures
from lab.guardunit import GUARD, guard_manager, restart_guard, write_config

MAX_RSS_KB, MAX_FDS, RSS_NOISE_KB, WARMUP = 30 * 1024, 32, 512, 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--loaders", type=int, default=10)
    args = ap.parse_args()
    with guard_manager() as um:
        write_config(um)
        restart_guard(um)
        pid = int(um.show(GUARD, "MainPID")["MainPID"])
        start = guard_figures(pid)
        churn = Churn(um, users=args.users, loaders=args.loaders)
        began = time.monotonic()
        series = []
        try:
            for i in range(WARMUP + args.rounds):
                churn.cycle()
                series.append((i + 1, guard_figures(pid)))
        finally:
            churn.close()
        took = time.monotonic() - began
        restarts = um.show(GUARD, "NRestarts")["NRestarts"]
    base, end = series[WARMUP - 1][1], series[-1][1]
    print("| after round | RSS | fds | sockets | pidfds | PSI fds | threads |")
    print("|---|---|---|---|---|---|---|")
    for n, f in [(0, start), *series[WARMUP - 1 :: max(1, args.rounds // 10)], series[-1]]:
        print(
            f"| {n} | {f['rss_kb'] / 1024:.1f} MiB | {f['fds']} | {f['sockets']} | "
            f"{f['pidfds']} | {f['psi']} | {f['threads']} |"
        )
    cycles = args.rounds * args.users
    growth = end["rss_kb"] - base["rss_kb"]
    print(
        f"\n{cycles} manager cycles, {args.rounds * args.loaders} loader start/stops in "
        f"{took:.0f} s; RSS {growth:+d} kB ({growth * 1024 / max(cycles, 1):.0f} B per manager "
        f"cycle); NRestarts={restarts}"
    )
    missed = []
    if max(f["rss_kb"] for _, f in series) > MAX_RSS_KB:
        missed.append("RSS over 30 MiB")
    if max(f["fds"] for _, f in series) > MAX_FDS:
        missed.append(f"over {MAX_FDS} fds")
    if any(end[k] > base[k] for k in ("fds", "sockets", "pidfds", "psi", "threads")):
        missed.append("fds or threads grew")
    if growth > RSS_NOISE_KB:
        missed.append(f"RSS grew by {growth} kB")
    print("goals missed: " + ", ".join(missed) if missed else "all goals met")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
