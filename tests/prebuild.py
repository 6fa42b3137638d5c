"""Build the caches the tests otherwise build on first use, all at once.

    .venv/bin/python tests/prebuild.py

On a fresh machine the suite builds three root filesystems with mmdebstrap
(Debian 12 and Ubuntu 24.04 for the containers, Debian 12 for the VM) and
fetches its test data: about five minutes of a CI run one after the other.
They are independent, mostly network and disk, so scripts/test starts this
beside the lint and type checks and waits for it before pytest. Each
rootfs builder is the one the tests call (a finished cache is found and
returned at once), so a cache built here is exactly theirs. The test data
is fetched only here: the tests read the cache and skip without it
(lab/testdata.py), so a run whose fetch failed stops here.
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
    "test data": lambda: testdata.real_ggufs(fetch=True),
}


def main() -> int:
    began = time.monotonic()

    def timed(name: str) -> str:
        t = time.monotonic()
        BUILDS[name]()
        return f"{name} {time.monotonic() - t:.0f}s"

    failed: list[str] = []
    with ThreadPoolExecutor(max_workers=len(BUILDS)) as pool:
        futures = {name: pool.submit(timed, name) for name in BUILDS}
        for name, future in futures.items():
            try:
                print(f"prebuild: {future.result()}", flush=True)
            except Exception as e:
                failed.append(name)
                print(f"prebuild: {name} failed: {e}", file=sys.stderr, flush=True)
    print(f"prebuild: done in {time.monotonic() - began:.0f}s, {len(failed)} failed", flush=True)
    # A root filesystem is built again by the test that needs it, which says why it cannot;
    # the test data is only read by the tests (they skip without it), so without it the
    # run would pass on skips: that fails here.
    return 1 if "test data" in failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
