"""audit/rescue's reading of a linger user's unit files: her files, her rights, bounded reads.

A real unprivileged account writes the files (setpriv: her uid, no
capabilities); `collect()` reads them as root would run `spark-guard audit`,
with no manager running, so her units come from disk.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.accounts import User, unprivileged_user
from spark_guard.core.config import Config
from spark_guard.tools.inventory import UNIT_FILE_MAX, Inventory, collect


@pytest.fixture(scope="module")
def lingering() -> Iterator[tuple[User, Config]]:
    with unprivileged_user() as user:
        base = Path(tempfile.mkdtemp(prefix="sg-inventory."))
        (base / "linger").mkdir()
        (base / "linger" / user.name).touch()  # as loginctl enable-linger leaves it
        config = Config(
            system_manager=str(base / "no-system-manager"),
            user_runtime=str(base / "run-user"),  # no manager running: files on disk
            linger=str(base / "linger"),
        )
        try:
            yield user, config
        finally:
            shutil.rmtree(base)


@pytest.fixture
def vault() -> Iterator[Path]:
    """A root-only (0700) directory, as /root is."""
    d = Path(tempfile.mkdtemp(prefix="sg-vault."))
    try:
        yield d
    finally:
        shutil.rmtree(d)


def collect_within(config: Config, seconds: float) -> Inventory:
    """collect() in a thread: a hang fails the test instead of stopping it."""
    box: list[Inventory] = []
    t = threading.Thread(target=lambda: box.append(collect(config)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"collect() still running after {seconds}s"
    return box[0]


@pytest.mark.root
def test_her_unit_files_that_hang_or_never_end_are_error_lines(
    lingering: tuple[User, Config], vault: Path
) -> None:
    user, config = lingering
    units = user.home / ".config/systemd/user"
    (vault / "secret.service").write_text("[Service]\nExecStart=/usr/bin/llama-server -m /s\n")
    user.sh(
        f"""
        mkdir -p {units}/default.target.wants {units}/llama-good.service.d
        printf '[Service]\\nExecStart=/usr/bin/llama-server -m /m/a.gguf -c 4096\\n' \\
            > {units}/llama-good.service
        ln -s ../llama-good.service {units}/default.target.wants/llama-good.service
        printf '[Service]\\nEnvironment=LLAMA_ARG_CTX_SIZE=8192\\n' \\
            > {units}/llama-good.service.d/ctx.conf
        ln -s /dev/zero {units}/llama-good.service.d/zero.conf
        ln -s /dev/zero {units}/llama-zero.service
        mkfifo {units}/llama-fifo.service
        ln -s {vault}/secret.service {units}/llama-secret.service
        head -c {UNIT_FILE_MAX + 100} /dev/zero | tr '\\0' '#' > {units}/llama-huge.service
        mkdir {units}/llama-dir.service
        """
    )
    t = time.monotonic()
    inv = collect_within(config, 20)
    assert time.monotonic() - t < 10
    loaders = {u.ref.name: u for u in inv.loaders}
    assert set(loaders) == {"llama-good.service"}
    good = loaders["llama-good.service"]
    assert good.user == user.name and good.from_files and good.file_state == "enabled"
    assert good.environment == ("LLAMA_ARG_CTX_SIZE=8192",)  # her readable drop-in counts
    errors = sorted(inv.errors)
    assert errors == sorted(
        [
            f"{units}/llama-good.service.d/zero.conf: not a regular file (not read)",
            f"{units}/llama-zero.service: not a regular file (not read)",
            f"{units}/llama-fifo.service: not a regular file (not read)",
            f"{units}/llama-dir.service: not a regular file (not read)",
            # Root could read it; she cannot, and it is read as her.
            f"{units}/llama-secret.service: Permission denied",
            f"{units}/llama-huge.service: larger than {UNIT_FILE_MAX} bytes (not read)",
        ]
    ), errors
