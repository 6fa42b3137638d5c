"""Build the caches the tests otherwise build on first use, all at once.

    .venv/bin/python tests/prebuild.py

On a fresh machine the suite builds three root filesystems with mmdebstrap
(Debian 12 and Ubuntu 24.04 for the containers, Debian 12 for the VM) and
downloads its test data, one after the other as the tests first ask: about
five minutes of a CI run. They are independent, mostly network and disk, so
scripts/test starts this beside the lint and type checks and waits for it
before pytest. Each builder is the one the tests call (a finished cache is
found and returned at once), so a cache built here is exactly theirs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if not __package__:  # run by path (scripts/test): sys.path[0] is tests/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout

from lab import nspawn, testdata, vm

BUILDS: dict[str, Callable[[], object]] = {
    "rootfs debian-12": lambda: nspawn.rootfs("bookworm"),
    "rootfs ubuntu-24.04": lambda: nspawn.rootfs("noble"),
    "rootfs vm": vm.base_rootfs,
    "test data": testdata.real_ggufs,
}


def main() -> int:
    began = time.monotonic()

    def timed(name: str) -> str:
        t = time.monotonic()
        BUILDS[name]()
        return f"{name} {time.monotonic() - t:.0f}s"

    failed = 0
    with ThreadPoolExecutor(max_workers=len(BUILDS)) as pool:
        futures = {name: pool.submit(timed, name) for name in BUILDS}
        for name, future in futures.items():
            try:
                print(f"prebuild: {future.result()}", flush=True)
            except Exception as e:  # the test that needs it will build it again and say why
                failed += 1
                print(f"prebuild: {name} failed: {e}", file=sys.stderr, flush=True)
    print(f"prebuild: done in {time.monotonic() - began:.0f}s, {failed} failed", flush=True)
    return 0  # never fails the run: the tests that need a cache build it again and say why


if __name__ == "__main__":
    raise SystemExit(main())
