"""A guard restarted while a unit it blocked runs again keeps that unit's record.

The record is the only account of the links the block removed: a new guard
that wrote a fresh record over it (its first decision came before it had read
the store) would leave `release` nothing to put back. The layout is the one
that reaches it: the admin removed the mask by hand and started the unit
while no guard ran (an upgrade, a crash), and the new guard's first pass
sees it running.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from lab.guardunit import (
    GUARD,
    PY,
    guard_manager,
    loader_unit,
    restart_guard,
    wait_log,
    write_config,
)
from lab.harness import file_tree

pytestmark = pytest.mark.systemd

FOOTPRINT = '[loaders.footprint]\n"llama*" = "100TiB"\n'
UNIT = "llama-back.service"


def test_a_restarted_guard_keeps_the_record_of_a_unit_running_again():
    with guard_manager() as um:
        write_config(um, FOOTPRINT)
        loader_unit(um, UNIT, 20, wanted_by="default.target")
        um.systemctl("enable", "--now", UNIT)
        um.wait_for(UNIT, "ActiveState", "active")
        watched = (um.home / ".config" / "systemd", um.unit_dir)
        before = file_tree(*watched)
        assert any(k.endswith(f"default.target.wants/{UNIT}") for k in before)

        offset = restart_guard(um)
        wait_log(um, rf"^warning unit-blocked: user:0:{UNIT} is stopped, masked", after=offset)
        path = um.base / "state" / "blocked" / f"user:0:{UNIT}.json"
        first = json.loads(path.read_text())
        assert [ln["removed"] for ln in first["links"]] == [True]

        # No guard: the admin unmasks by hand and starts it.
        um.systemctl("stop", GUARD)
        (um.runtime / "systemd" / "user.control" / UNIT).unlink()
        um.systemctl("daemon-reload")
        um.systemctl("start", UNIT)
        um.wait_for(UNIT, "ActiveState", "active")

        # The new guard's first pass sees it running: it blocks it again, on the old record.
        offset = restart_guard(um)
        wait_log(um, rf"^warning unit-blocked: user:0:{UNIT} is stopped, masked", after=offset)
        props = um.show(UNIT, "ActiveState", "LoadState")
        assert props == {"ActiveState": "inactive", "LoadState": "masked"}, props
        again = json.loads(path.read_text())
        assert again["links"] == first["links"]
        assert again["at"] == first["at"] and again["history"][: len(first["history"])] == [
            list(h) for h in first["history"]
        ]
        assert any(what.startswith("running again") for _, what in again["history"])
        assert again["mask_made"] is True and again["step"] == "blocked"

        um.systemctl("stop", GUARD)
        out = subprocess.run(
            [PY, "-m", "spark_guard", "release", UNIT, "--config", str(um.base / "guard.toml")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert file_tree(*watched) == before  # byte for byte, owners and modes too
        assert not (um.runtime / "systemd" / "user.control" / UNIT).exists()
        assert um.show(UNIT, "LoadState", "UnitFileState") == {
            "LoadState": "loaded",
            "UnitFileState": "enabled",
        }
