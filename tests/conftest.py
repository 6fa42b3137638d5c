import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.accounts import User, unprivileged_user
from lab.engine import DockerD, available

REPO = Path(__file__).parent.parent


# Markers of tests that need root: they start real managers, containers and VMs, or act
# as other users. Without root they are skipped with the reason, as systemd's own tests
# do, so `pytest` as a normal user runs every pure test. CI runs as root: all of them.
NEEDS_ROOT = ("root", "systemd", "journald", "nspawn", "vm", "engine")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    for item in items:
        marker = next((m for m in NEEDS_ROOT if item.get_closest_marker(m)), None)
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs root (marked {marker})"))


@pytest.fixture(scope="session", autouse=True)
def checkout_reachable_by_other_users() -> Iterator[None]:
    """The hostile-user tests run loaders and fake managers as an unprivileged account, from
    this checkout's interpreter and lab/. A clone in a 0700 directory (mktemp -d) would
    refuse them: give each directory above it the search bit for others (no read), and put
    the modes back at the end."""
    changed = []
    for d in [REPO.resolve(), *REPO.resolve().parents]:
        mode = d.stat().st_mode
        if not mode & stat.S_IXOTH and os.geteuid() == 0:  # a normal user runs no such test
            os.chmod(d, stat.S_IMODE(mode) | stat.S_IXOTH)
            changed.append((d, stat.S_IMODE(mode)))
    yield
    for d, mode in reversed(changed):
        os.chmod(d, mode)


@pytest.fixture(scope="session")
def deb() -> Path:
    """The package, built once per run by packaging/build-deb.sh (test_deb and test_vm)."""
    out = subprocess.run(
        [str(REPO / "packaging" / "build-deb.sh")], capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0 and os.geteuid() != 0:
        # Root builds it in CI, where a failure fails; a normal user may lack the build
        # tools (only root installs them) or own no checkout git will read.
        why = out.stderr.strip().splitlines()
        pytest.skip(f"cannot build the .deb as uid {os.geteuid()}: {why[0] if why else ''}")
    assert out.returncode == 0, out.stderr[-3000:]
    return REPO / out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dockerd() -> Iterator[DockerD]:
    """A private dockerd per test module (lab/engine.py), and nothing of it left after."""
    # scripts/deps --test installs docker.io: as root (the skips above), a missing engine
    # is a broken test machine, not a reason to leave containers untested.
    why = available()
    if why:
        pytest.fail(why)
    with DockerD() as d:
        yield d
    # Nothing of it is left: no dockerd, containerd or shim, no mount.
    assert d.proc is None and not d._ours()
    with open("/proc/self/mountinfo") as f:
        assert str(d.base) not in f.read()
    assert not d.base.exists()


@pytest.fixture(scope="module")
def mallory() -> Iterator[User]:
    """A real unprivileged account, one per test module, for the attacks done as her."""
    with unprivileged_user() as user:
        yield user


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A root-owned directory anyone may search, outside pytest's root-only tmp tree."""
    d = Path(tempfile.mkdtemp(prefix="sg-public."))
    d.chmod(0o755)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=True)
