"""The package's promises with blocks active, on PID 1 in a container, in one boot.

The previous release (the second entry of packaging/debian/changelog), built from
the commit that shipped it (what admins installed), out of this checkout's history,
is installed and blocks two enabled
loaders; upgraded to this checkout's package it restarts once and keeps their
records and masks; a release by the new tools still restores exactly what the old
guard removed; removed with a block active it releases that unit exactly and
takes back the drop-in `harden` wrote (not one an admin rewrote since); purged, it
leaves /etc/systemd/system byte for byte as it was before the install, but for that
admin's drop-in, whose record it keeps and names.

So what is tested is the upgrade path (prerm upgrade, unpack, postinst's restart)
across a real change of code: records written by the old guard, read by the new.
And the way back: a downgrade releases every block first, while the code that can
undo it exactly is still there (the older guard cannot read these records).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from lab.harness import file_tree
from lab.nspawn import Container

pytestmark = pytest.mark.nspawn

CONFIG = """
[boot]
grace = "1h"
[loaders.footprint]
"llama*" = "100TiB"
"""
LOADER = """[Service]
ExecStart=/bin/sleep infinity
Restart=always
RestartSec=1s
[Install]
WantedBy=multi-user.target
"""
LOADERS = ("llama-a.service", "llama-b.service")
STATE = "/var/lib/spark-guard"
REPO = Path(__file__).resolve().parent.parent
CHANGELOG = "packaging/debian/changelog"


def _versions(changelog: str) -> list[str]:
    return re.findall(r"^spark-guard \(([^)]+)\)", changelog, re.MULTILINE)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True
    ).stdout


def _shipping_commit(version: str) -> str:
    """The commit that shipped `version`: the first to put it at the top of the changelog
    (its code is what admins installed, not the code of the commit before the next one)."""
    if _git("rev-parse", "--is-shallow-repository").strip() == "true":
        # A shallow clone (a CI's): the previous release's code is in the history it lacks.
        subprocess.run(
            ["git", "-C", str(REPO), "fetch", "-q", "--unshallow"],
            capture_output=True,
            timeout=120,
        )
    for commit in _git("log", "--first-parent", "--format=%H", "--", CHANGELOG).split():
        if _versions(_git("show", f"{commit}:{CHANGELOG}"))[:1] != [version]:
            continue
        parent = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}^:{CHANGELOG}"],
            capture_output=True,
            text=True,
        )
        if parent.returncode == 0 and _versions(parent.stdout)[:1] == [version]:
            continue  # a later commit of that release: older ones come next
        if (
            parent.returncode != 0
            and _git("rev-parse", "--is-shallow-repository").strip() == "true"
        ):
            break
        return commit
    raise AssertionError(f"{version}'s code is not in this checkout's history (shallow?)")


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(the previous release's version, its .deb built from the code that shipped it)."""
    version = _versions((REPO / CHANGELOG).read_text())[1]
    commit = _shipping_commit(version)
    src = tmp_path_factory.mktemp("previous") / "spark-guard"
    subprocess.run(["git", "clone", "-q", str(REPO), str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "checkout", "-q", commit], check=True)
    out = subprocess.run(
        [str(src / "packaging" / "build-deb.sh")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return version, src / out.stdout.strip().splitlines()[-1]


def apt(c: Container, *args: str) -> str:
    out = c.run(
        "apt-get",
        *args,
        "-y",
        "-q",
        "-o",
        "Dpkg::Options::=--force-confold",  # the test's /etc/spark-guard.toml stays
        check=False,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout + out.stderr


def events(c: Container, event: str) -> list[dict[str, str]]:
    out = c.run("journalctl", "-o", "json", "-u", "spark-guard", f"SG_EVENT={event}").stdout
    return [json.loads(line) for line in out.splitlines()]


def wait_event(c: Container, event: str, unit: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e.get("SG_UNIT") == unit for e in events(c, event)):
            return
        time.sleep(0.2)
    raise AssertionError(f"no {event} {unit}: {c.run('journalctl', '-u', 'spark-guard').stdout}")


def masked(c: Container, unit: str) -> bool:
    mask = f"/run/systemd/system.control/{unit}"
    return c.run("readlink", mask, check=False).stdout.strip() == "/dev/null"


def ours(tree: dict[str, tuple[object, ...]]) -> dict[str, tuple[object, ...]]:
    """The tree without the package's own enablement (which stays until purge)."""
    return {k: v for k, v in tree.items() if "spark-guard.service" not in k}


def blocked_as(c: Container, unit: str) -> dict[str, object]:
    """What a release needs of a unit's record: where its mask is, and its links."""
    record = json.loads(c.path(f"{STATE}/blocked/{unit}.json").read_text())
    return {k: record.get(k) for k in ("unit", "manager", "mask_path", "mask_made", "links")}


OLD, NEW = "/root/spark-guard-old.deb", "/root/spark-guard-new.deb"


def stage(c: Container, old_deb: Path, new_deb: Path) -> tuple[Path, dict[str, tuple[object, ...]]]:
    """Both packages copied in (OLD, NEW), the config and two enabled loaders written, the
    container booted: /etc/systemd/system and its tree before any install."""
    shutil.copy(old_deb, c.path(OLD))
    shutil.copy(new_deb, c.path(NEW))
    c.path("/etc/spark-guard.toml").write_text(CONFIG)
    wants = c.path("/etc/systemd/system/multi-user.target.wants")
    wants.mkdir(parents=True, exist_ok=True)
    for unit in LOADERS:
        c.path(f"/etc/systemd/system/{unit}").write_text(LOADER)
        (wants / unit).symlink_to(f"/etc/systemd/system/{unit}")
    c.boot()
    etc = c.path("/etc/systemd/system")
    return etc, file_tree(etc)


def test_upgrade_keeps_blocks_and_remove_and_purge_undo_everything(
    deb: Path, previous: tuple[str, Path]
):
    version, old_deb = previous
    current = _versions((REPO / CHANGELOG).read_text())[0]
    with Container() as c:
        etc, before = stage(c, old_deb, deb)

        apt(c, "install", OLD)
        assert c.run("dpkg-query", "-W", "-f=${Version}", "spark-guard").stdout == version
        for unit in LOADERS:
            wait_event(c, "unit-blocked", unit)
        records = {u: blocked_as(c, u) for u in LOADERS}
        for unit in LOADERS:
            assert records[unit]["mask_made"] is True and records[unit]["links"], records
        old = c.show("spark-guard.service", "ExecMainPID", "InvocationID", "NRestarts")
        assert old["NRestarts"] == "0"
        started = len(events(c, "guard-started"))

        # The upgrade: the guard is restarted once, by postinst; blocks, records and masks stay.
        apt(c, "install", NEW)
        c.wait_for("spark-guard.service", "ActiveState", "active")
        assert c.run("dpkg-query", "-W", "-f=${Version}", "spark-guard").stdout == current
        assert current != version
        new = c.show("spark-guard.service", "ExecMainPID", "InvocationID", "NRestarts")
        assert new["ExecMainPID"] != old["ExecMainPID"]
        assert new["InvocationID"] != old["InvocationID"]
        assert new["NRestarts"] == "0"  # restarted by the upgrade, never by a crash
        assert len(events(c, "guard-started")) == started + 1
        assert len(events(c, "guard-stopping")) == 1
        time.sleep(1.0)  # a few passes of the new guard
        for unit in LOADERS:
            assert blocked_as(c, unit) == records[unit], unit  # read by the new guard, kept
            assert masked(c, unit), unit
            props = c.show(unit, "ActiveState", "LoadState")
            assert props == {"ActiveState": "inactive", "LoadState": "masked"}, (unit, props)

        # A release by the new guard's tools restores exactly what the old one removed.
        out = c.run("spark-guard", "release", "llama-a", check=False)
        assert out.returncode == 0, out.stderr
        assert not masked(c, "llama-a.service")
        assert c.show("llama-a.service", "UnitFileState")["UnitFileState"] == "enabled"
        # Drop-ins from harden: one as harden wrote it, for the remove to take back, and one
        # an admin has rewritten since, which is theirs now.
        for unit in LOADERS:
            out = c.run("spark-guard", "harden", unit, "--yes", check=False)
            assert out.returncode == 0, out.stdout + out.stderr
        drop_in = etc / "llama-a.service.d" / "50-spark-guard.conf"
        assert drop_in.is_file()
        theirs = etc / "llama-b.service.d" / "50-spark-guard.conf"
        theirs.write_text("[Service]\nMemoryMax=1G\n")
        kept = {k: v for k, v in file_tree(etc).items() if k.startswith(str(theirs.parent))}

        # Remove with llama-b still blocked: prerm releases it exactly, and undoes harden.
        said = apt(c, "remove", "spark-guard")
        assert "release --all failed" not in said, said
        assert "drop-in of llama-b.service left in place" in said, said
        assert "drop-in of llama-a.service" not in said, said
        assert not masked(c, "llama-b.service")
        for unit in LOADERS:
            props = c.show(unit, "LoadState", "UnitFileState")
            assert props == {"LoadState": "loaded", "UnitFileState": "enabled"}, (unit, props)
        assert not drop_in.parent.exists()
        assert ours(file_tree(etc)) == ours(before) | kept
        assert not any(c.path(f"{STATE}/blocked").glob("*.json"))

        # A record a save once set aside as unreadable: an admin's only account of what it
        # changed, which the docs promise to keep.
        aside = c.path(f"{STATE}/blocked/llama-c.service.json.unreadable-20261201T000000Z")
        aside.parent.mkdir(parents=True, exist_ok=True)
        aside.write_text("{not json")

        # Purged: nothing of it left, /etc/systemd/system as before the install, but for
        # the admin's drop-in, whose record stays (named) as the way to tell it was ours,
        # and the record set aside (named).
        said = apt(c, "purge", "spark-guard")
        assert "keeping /var/lib/spark-guard/hardened" in said and "llama-b.service" in said
        assert "set aside as unreadable: llama-c.service.json.unreadable-" in said, said
        assert file_tree(etc) == before | kept
        assert sorted(str(p.relative_to(c.root)) for p in c.path(STATE).rglob("*")) == [
            "var/lib/spark-guard/blocked",
            "var/lib/spark-guard/blocked/llama-c.service.json.unreadable-20261201T000000Z",
            "var/lib/spark-guard/hardened",
            "var/lib/spark-guard/hardened/llama-b.service.json",
        ]


def test_a_downgrade_releases_every_block_first_exactly(deb: Path, previous: tuple[str, Path]):
    """The older guard cannot read this one's records, and would write its own over them:
    before it takes over, every block is released exactly (not started), and said."""
    version, old_deb = previous
    with Container() as c:
        etc, before = stage(c, old_deb, deb)
        apt(c, "install", NEW)
        for unit in LOADERS:
            wait_event(c, "unit-blocked", unit)
            assert masked(c, unit)

        said = apt(c, "install", "--allow-downgrades", OLD)
        assert c.run("dpkg-query", "-W", "-f=${Version}", "spark-guard").stdout == version
        assert f"downgrading to {version}, which cannot read these records" in said, said
        assert "release --all failed" not in said, said
        for unit in LOADERS:
            assert not masked(c, unit), unit
            props = c.show(unit, "LoadState", "UnitFileState", "ActiveState")
            assert props == {
                "LoadState": "loaded",
                "UnitFileState": "enabled",
                "ActiveState": "inactive",  # not started: as at removal, at the next boot
            }, (unit, props)
        assert ours(file_tree(etc)) == ours(before)
        assert not any(c.path(f"{STATE}/blocked").glob("*.json"))
        c.wait_for("spark-guard.service", "ActiveState", "active")  # the older guard watches
