"""The rescue units: the ways in (sshd, a console, a desktop) whose start the guard
waits for, and keeps the window open for, before any loader may load.

Asked of the guard's own manager (PID 1's for the system guard), once a pass: whether
each group is present, and since when it runs (its manager's word, read once per run).
On a machine whose default target is graphical, the desktop is one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..core.config import Config
from ..core.snapshot import SYSTEM, RescueGroup, UnitRef
from ..system.managers import Manager, ManagerError


class RescueWatch:
    """The rescue groups (`|` joins the units of one), and when each unit became active."""

    def __init__(self, managers: Mapping[str, Manager], clock: Callable[[], float]) -> None:
        self.managers, self.clock = managers, clock
        self.groups: list[tuple[str, ...]] = []
        self._graphical = "no"  # rescue_graphical: whether the desktop is one of them
        self._graphical_checked = False
        self._since: dict[str, float] = {}

    def reconfigure(self, config: Config, guard_unit: UnitRef | None) -> None:
        self.groups = [tuple(g.split("|")) for g in config.rescue_units]
        self._graphical, self._graphical_checked = config.rescue_graphical, False
        self.add_graphical(guard_unit)

    def manager(self, guard_unit: UnitRef | None) -> Manager | None:
        """The guard's own manager (its rescue units are its), else PID 1."""
        key = guard_unit.manager if guard_unit else SYSTEM
        return self.managers.get(key) or self.managers.get(SYSTEM)

    def add_graphical(self, guard_unit: UnitRef | None) -> None:
        """graphical.target is a rescue unit where the config says so, or ("auto") where
        it is the default target (asked until its manager answers)."""
        m = self.manager(guard_unit)
        if self._graphical_checked or self._graphical == "no" or m is None:
            return
        self._graphical_checked = True
        try:
            graphical = self._graphical == "yes" or m.default_target() == "graphical.target"
        except ManagerError:
            self._graphical_checked = False
            return
        if graphical and ("graphical.target",) not in self.groups:
            self.groups.append(("graphical.target",))

    def read(
        self, guard_unit: UnitRef | None, drop: Callable[[str, str], None]
    ) -> tuple[RescueGroup, ...]:
        """Each group now: present, and since when it runs (None: not running, or its
        manager did not answer, which `drop`s it)."""
        m = self.manager(guard_unit)
        if m is None:
            return tuple(RescueGroup(g, False, None) for g in self.groups)
        names = [n for g in self.groups for n in g]
        try:
            states = m.unit_states(names)
        except ManagerError as e:
            drop(m.key, str(e))
            return tuple(RescueGroup(g, False, None) for g in self.groups)
        out = []
        for group in self.groups:
            present = any(states[n].load_state != "not-found" for n in group if n in states)
            since = None
            for name in group:
                st = states.get(name)
                if st is None or st.active_state != "active":
                    self._since.pop(name, None)
                    continue
                if name not in self._since:
                    try:
                        t = m.unit_details(name).active_since
                    except ManagerError:
                        t = None
                    self._since[name] = t if t is not None else self.clock()
                t = self._since[name]
                since = t if since is None else min(since, t)
            out.append(RescueGroup(group, present, since))
        return tuple(out)
