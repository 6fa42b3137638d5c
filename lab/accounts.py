"""A real unprivileged account for the tests that play a hostile local user.

`unprivileged_user()` adds a passwd entry (useradd) with its home in a
temporary directory, and removes it afterwards; `User.run()` runs a command
as that uid/gid with no supplementary groups and no capabilities (setpriv),
the way a local user's shell would.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "sg-mallory"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def run(
        self, *argv: str, check: bool = True, env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        cmd = [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            *argv,
        ]
        base = {"HOME": str(self.home), "PATH": "/usr/bin:/bin", "USER": self.name}
        return subprocess.run(
            cmd,
            env={**base, **(env or {})},
            text=True,
            capture_output=True,
            check=check,
            timeout=60,
            **kw,
        )

    def sh(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A shell script run as the user: the attacks are written as a user would type them."""
        return self.run("sh", "-ec", script, check=check)


def _free_uid() -> int:
    used = {p.pw_uid for p in pwd.getpwall()}
    return next(u for u in range(4200, 60000) if u not in used)


_LIVE: set[str] = set()  # accounts this process made and still uses (two users at once)


def _remove_stale() -> None:
    for p in pwd.getpwall():
        if p.pw_name.startswith(PREFIX) and p.pw_name not in _LIVE:
            subprocess.run(["userdel", p.pw_name], capture_output=True)


@contextmanager
def unprivileged_user(parent: Path | None = None) -> Iterator[User]:
    """A fresh account whose home (0700, its own) is under `parent` or a new temp dir."""
    _remove_stale()
    base = Path(tempfile.mkdtemp(prefix="sg-user.")) if parent is None else parent
    os.chmod(base, 0o755)
    uid = _free_uid()
    name = f"{PREFIX}{uid}"
    home = base / name
    subprocess.run(
        [
            "useradd",
            "--no-create-home",
            "--home-dir",
            str(home),
            "--uid",
            str(uid),
            "--user-group",
            "--shell",
            "/bin/sh",
            name,
        ],
        check=True,
        capture_output=True,
    )
    _LIVE.add(name)
    try:
        entry = pwd.getpwnam(name)
        home.mkdir(mode=0o700)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        yield User(name, entry.pw_uid, entry.pw_gid, home)
    finally:
        _LIVE.discard(name)
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
        if parent is None:
            shutil.rmtree(base, ignore_errors=True)
