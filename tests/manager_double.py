"""A unit manager in a dict, for the Blocker's tests: no systemd, no root.

What the Blocker asks of a manager (blocker.ManagerPort), with the units'
states in dicts and the enablement links as real files, which a disable
removes. Used by the step transcripts (test_block_steps.py) and the fault
matrix (fault_matrix.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from spark_guard.core.snapshot import Action, Decision, Phase, Reason, UnitRef, manager_uid
from spark_guard.system.managers import ManagerError, UnitState


class FakeManager:
    """Just what the Blocker asks of a Manager, with the units in a dict.

    A stop leaves the unit 'deactivating' until the test says it is gone; LoadState
    is read again from the files only at reload(), as a real manager does.
    """

    def __init__(self, key: str, control: str, links: dict[str, list[str]]) -> None:
        self.key = key
        self.uid = manager_uid(key)
        self.control = control
        self.unit_path_dirs = [control, os.path.dirname(control) + "/user"]
        self.root_cgroup = f"/user.slice/user-{self.uid}.slice/user@{self.uid}.service"
        self.persistent_config_dir: str | None = None
        self.links = links
        self.active: dict[str, str] = {}  # name -> ActiveState
        self.load: dict[str, str] = {}  # name -> LoadState, as of the last reload
        self.calls: list[str] = []
        # Runs instead of the reload once: a start job that got in before it.
        self.on_reload: Callable[[], None] | None = None

    def start(self, name: str) -> None:
        self.active[name] = "active"
        self.load.setdefault(name, "loaded")

    def unit_states(self, names: Iterable[str]) -> dict[str, UnitState]:
        return {
            n: UnitState(n, self.load[n], self.active[n], self.active[n])
            for n in names
            if n in self.active
        }

    def freeze_unit(self, name: str) -> None:
        self.calls.append(f"freeze {name}")

    def thaw_unit(self, name: str) -> None:
        self.calls.append(f"thaw {name}")

    def stop_unit(self, name: str) -> str:
        self.calls.append(f"stop {name}")
        if self.active.get(name) == "active":
            self.active[name] = "deactivating"
        return f"/org/freedesktop/systemd1/job/{len(self.calls)}"

    def kill_unit(self, name: str, signal: int) -> None:
        self.calls.append(f"kill {name} {int(signal)}")
        self.active[name] = "failed"

    def stopped(self, name: str) -> None:
        self.active[name] = "inactive"

    def reload(self) -> None:
        self.calls.append("reload")
        if self.on_reload is not None:
            hook, self.on_reload = self.on_reload, None
            hook()
            return
        for name in self.load:
            masked = os.path.lexists(os.path.join(self.control, name))
            self.load[name] = "masked" if masked else "loaded"

    def unit_file_links(self, name: str) -> list[str]:
        return list(self.links.get(name, []))

    def disable_unit_files(self, name: str) -> list[str]:
        self.calls.append(f"disable {name}")
        gone = []
        for path in self.links.get(name, []):
            try:
                os.unlink(path)
            except OSError as e:  # systemd answers the D-Bus call with an error
                raise ManagerError(f"DisableUnitFiles {name}: {e}") from None
            gone.append(path)
        self.links.pop(name, None)
        return gone

    def unit_control_group(self, name: str) -> str:
        return f"{self.root_cgroup}/app.slice/{name}"


class Clock:
    """Time that passes only when the Blocker sleeps or the test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def stop_decision(ref: UnitRef) -> tuple[list[Action], Decision]:
    """What the policy says of a loader that does not fit, at boot: stop `ref`."""
    action = Action("stop", ref, Reason.FOOTPRINT, "expects 115GiB", {"mem_available": 1})
    return [action], Decision(Phase.STRICT, 8, (), (action,))
