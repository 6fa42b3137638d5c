"""The guard as a unit of a harness user manager, with loader units beside it.

Shared by the tests that run the guard for real on a `systemd --user`
manager: the guard's unit, its config, loader units, and its log.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lab import LAB
from lab.harness import UserManager

PY = sys.executable
GUARD = "spark-guard-test.service"
MiB = 1024**2


@contextmanager
def guard_manager() -> Iterator[UserManager]:
    with UserManager() as manager:
        manager.models = manager.base / "models"  # type: ignore[attr-defined]
        manager.models.mkdir()  # type: ignore[attr-defined]
        (manager.base / "models" / "ds4.gguf").write_bytes(b"GGUF" + b"\0" * 8192)
        manager.write_unit(
            GUARD,
            f"""[Unit]
Description=spark-guard under test

[Service]
Type=notify
NotifyAccess=main
ExecStart={PY} -m spark_guard run --config {manager.base}/guard.toml --log console
ExecReload=/bin/sh -c 'kill -HUP ${{MAINPID}}'
WatchdogSec=10s
Environment=PYTHONUNBUFFERED=1
""",
        )
        manager.write_unit("rescue-ssh.service", "[Service]\nExecStart=/bin/sleep infinity\n")
        yield manager


def write_config(
    um: UserManager, extra: str = "", *, grace: str = "1h", fast: bool = True, unsized: str = ""
) -> None:
    """The guard's config for a harness manager. `fast`: polls shorter than the shipped
    defaults, so tests see a pass soon; a benchmark of the guard's own cost wants them off.
    `unsized`: [boot] unsized, where a test's loader of unknown size holds more than 2 GiB."""
    poll = '[poll]\nstrict = "200ms"\nmax = "500ms"' if fast else ""
    (um.base / "guard.toml").write_text(f"""
[boot]
rescue_units = ["rescue-ssh.service"]
rescue_graphical = "no"
grace = "{grace}"
{f'unsized = "{unsized}"' if unsized else ""}
{poll}
[paths]
system_manager = "/nonexistent/systemd/private"
user_runtime = "{um.user_runtime}"
state = "{um.base}/state"
motd = "{um.base}/motd.d/spark-guard"
issue = "{um.base}/issue"
runtime = "{um.base}/run"
{extra}
""")


def loader_unit(
    um: UserManager,
    name: str,
    alloc_mib: int,
    model: str = "",
    rate: int = 0,
    *,
    data_dir: bool = False,
    wanted_by: str = "",
    ignore_term: bool = False,
    **service: str,
) -> Path:
    args = f"-m {model} " if model else ""
    args += f"--alloc {alloc_mib} --rate {rate}" + (" --ignore-term" if ignore_term else "")
    extra = "".join(f"{k}={v}\n" for k, v in service.items())
    install = f"\n[Install]\nWantedBy={wanted_by}\n" if wanted_by else ""
    restart = "" if "Restart" in extra else "Restart=on-failure\n"
    return um.write_unit(
        name,
        f"""[Service]
ExecStart={PY} {LAB}/fake_loader.py {args}
LimitAS=2G
{restart}{extra}{install}""",
        data_dir=data_dir,
    )


def log_text(um: UserManager) -> str:
    return um.log.read_text(errors="replace")


def wait_log(um: UserManager, pattern: str, timeout: float = 20.0, after: int = 0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log_text(um)[after:], re.MULTILINE)
        if m:
            return m
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the log:\n{log_text(um)[after:][-4000:]}")


def restart_guard(um: UserManager, *, wait: bool = True) -> int:
    """Restart the guard; returns the log offset from which its new lines start.

    With wait=False it returns at once: the guard's first pass (and any block
    in it) comes before READY=1, so a caller that must act during it cannot wait.
    """
    offset = len(log_text(um))
    um.systemctl("restart", *(() if wait else ("--no-block",)), GUARD)
    if wait:
        um.wait_for(GUARD, "ActiveState", "active")
    return offset
