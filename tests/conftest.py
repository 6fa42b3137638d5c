import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
REPO = Path(__file__).parent.parent


@pytest.fixture(scope="session")
def deb() -> Path:
    """The package, built once per run by packaging/build-deb.sh (test_deb and test_vm)."""
    out = subprocess.run(
        [str(REPO / "packaging" / "build-deb.sh")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return REPO / out.stdout.strip().splitlines()[-1]
