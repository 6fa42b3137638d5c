"""The real GGUF test data (lab/testdata.py) as the tests take it: from the cache that
tests/prebuild.py fills, or a skip that says so. A test never fetches."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab import testdata


def smollm2() -> Path:
    try:
        return testdata.smollm2()
    except testdata.NotFetched as e:
        pytest.skip(str(e))


def real_ggufs() -> list[Path]:
    try:
        return testdata.real_ggufs()
    except testdata.NotFetched as e:
        pytest.skip(str(e))
