"""Act for real: stop a loader unit, block it, disable it, verify, and record every step.

The order follows what matters while memory goes:

  stop     StopUnit through the unit's own manager, before anything is written
  plan     record the links a disable removes (with their targets and owners),
           and where the mask goes
  disable  DisableUnitFiles through the same manager: it removes what `plan`
           recorded, as the manager's own user (it refuses once masked, so
           this comes first)
  mask     a /dev/null link in the manager's runtime *control* directory, the
           one runtime directory that outranks /etc/systemd/system and
           ~/.config/systemd/user (a plain runtime mask loses against both)
  settle   wait for the unit to be inactive; then KillUnit SIGKILL; then the
           cgroup's kill
  verify   read LoadState back (a daemon-reload if the unit is still loaded)
  blocked  done; the mask is laid again if a reboot or manager restart took it

Each step is saved before the next, so a crash resumes where it stopped. It
is all D-Bus on the managers' private sockets and syscalls: no fork, no exec,
nothing on the system bus. A manager that does not answer gets its unit's
cgroup killed and the block is retried on a later pass.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import banner, cgroupfs
from .config import Config
from .managers import Manager, ManagerError
from .records import LinkRecord, Record, RecordError, RecordStore, boot_id, utc_now
from .snapshot import Action, Decision, UnitRef
from .unitfiles import (
    Owner,
    UnitFileError,
    lay_mask,
    mask_dir,
    owner,
    present,
    read_link,
    shadowing_file,
)

SETTLED = ("inactive", "failed")
RETRY_AFTER = 5.0  # seconds between attempts to finish a block that did not complete
POLL = 0.02  # seconds between state reads while a unit stops (one D-Bus round trip each)


class Enforcer:
    def __init__(
        self,
        managers: Mapping[str, Manager],
        config: Config,
        log: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        self.managers = managers
        self.config = config
        self.log = log
        self.clock = clock
        self.sleep = sleep
        # Called while waiting for units to stop (the daemon sends WATCHDOG=1).
        self.tick = tick
        # Paths keep their start-up values across a reload, like the sensor's.
        self.store = RecordStore(config.state)
        self.motd, self.issue = config.motd, config.issue
        self.user_runtime = config.user_runtime
        self.cgroup_root = cgroupfs.v2_root(config.cgroup)
        self.boot_id = boot_id(config.proc)
        self.records: dict[str, Record] = {}
        self._generation: int | None = None
        self._stop_sent: dict[str, float] = {}
        self._retry_at: dict[str, float] = {}
        self._reported: dict[str, str] = {}
        self._banner: str | None = None
        self._on_disk: set[str] = set()  # records this guard has seen on disk

    # --- entry points ---------------------------------------------------------

    def block(self, actions: Sequence[Action], decision: Decision) -> None:
        """Stop, block and disable the unit of each action."""
        # The store first: a unit blocked before (by a guard since restarted, or by rescue)
        # keeps its record, the only account of the links its release must put back.
        self._refresh()
        cgroups = {ld.ref: ld.usage.cgroup for ld in decision.loaders}
        batch = []
        for action in actions:
            key = str(action.unit)
            record = self.records.get(key)
            if record is not None and self._released_meanwhile(record):
                record = None  # released, and now a threat again: a new block
            if record is None:
                record = Record(
                    unit=action.unit.name,
                    manager=action.unit.manager,
                    reason=action.reason,
                    detail=action.detail,
                    phase=decision.phase,
                    figures=dict(action.figures),
                    at=utc_now(),
                    boot_id=self.boot_id,
                    cgroup=cgroups.get(action.unit, ""),
                )
            else:
                # Blocked before, and running again (it started before its mask was back).
                record.note(f"running again: {action.reason}: {action.detail}")
                if record.step in ("blocked", "verify"):
                    record.step = "settle"
                    if record.mask_path and not self._mask_present(record):
                        # Unmasked by hand while no guard watched: the mask goes back first.
                        record.step, record.mask_made = "mask", True
                        record.note("mask gone: laying it again")
            # The stop goes out first: everything else can wait a few milliseconds.
            self._request_stop(record)
            self.records[key] = record
            batch.append(record)
        self._run(batch)

    def advance(self) -> None:
        """Finish blocks left unfinished, and lay again masks a reboot or restart removed."""
        self._refresh()
        now = self.clock()
        due = []
        for key, record in self.records.items():
            manager = self.managers.get(record.manager)
            if manager is None:
                continue  # its manager is not running: nothing can start the unit
            if record.step == "blocked":
                if record.mask_path and not self._mask_present(record):
                    due.append(record)  # renewed in _run, once it is sure not released
            elif now >= self._retry_at.get(key, 0.0):
                due.append(record)
        if due:
            self._run(due)

    @property
    def busy(self) -> bool:
        """A block is unfinished: the guard keeps taking full looks until it is done."""
        return any(r.step != "blocked" for r in self.records.values())

    # --- the steps ------------------------------------------------------------

    def _run(self, batch: list[Record]) -> None:
        with self.store.lock(wait=1.0) as locked:
            if not locked:
                self.log.warning(
                    "state-busy",
                    state=self.store.root,
                    msg=f"{self.store.root} is locked by another spark-guard; going on",
                )
            batch = [r for r in batch if not self._released_meanwhile(r)]
            for record in batch:
                if record.step == "blocked":
                    record.step = "mask"
                    record.mask_made = True
                    record.note("mask gone (reboot or manager restart): laying it again")
                    self._stop_sent.pop(str(record.ref), None)  # that stop was for an old run
                    self._event("block-renewed", record, f"laying the mask on {record.ref} again")
            for record in batch:
                self._retry_at[str(record.ref)] = self.clock() + RETRY_AFTER
                if record.step == "stop" and str(record.ref) not in self._stop_sent:
                    self._request_stop(record)
                if record.step == "plan":
                    self._guarded(record, self._plan)
                if record.step == "disable":
                    self._guarded(record, self._disable)
                if record.step == "mask":
                    self._guarded(record, self._mask)
            self._settle([r for r in batch if r.step == "settle"])
            self._verify([r for r in batch if r.step == "verify"])
            for record in batch:
                self._save(record)
        self._publish()

    def _released_meanwhile(self, record: Record) -> bool:
        """A record this guard saved that is no longer on disk: `release` took it (under the
        lock we now hold). Acting on it would undo the admin's release."""
        key = str(record.ref)
        if key not in self._on_disk:
            return False
        try:
            gone = self.store.load(record.ref) is None
        except RecordError:
            gone = False
        if gone:
            self.records.pop(key, None)
            self._on_disk.discard(key)
        return gone

    def _guarded(self, record: Record, step: Callable[[Record, Manager], None]) -> None:
        manager = self.managers.get(record.manager)
        try:
            if manager is None:
                raise ManagerError(f"{record.manager} manager is not connected")
            step(record, manager)
        except (ManagerError, UnitFileError, OSError) as e:
            self._problem(record, f"{record.step}: {e}")
        else:
            self._save(record)

    def _request_stop(self, record: Record) -> None:
        key = str(record.ref)
        manager = self.managers.get(record.manager)
        try:
            if manager is None:
                raise ManagerError(f"{record.manager} manager is not connected")
            job = manager.stop_unit(record.unit)
        except ManagerError as e:
            self.log.error(
                "unit-stop-failed",
                unit=key,
                manager=record.manager,
                error=str(e),
                msg=f"cannot stop {key}: {e}",
            )
            # The manager is not answering: kill from the kernel side, block later.
            self._kill_cgroup(record, str(e))
            self._problem(record, f"stop: {e}")
            return
        self._stop_sent[key] = self.clock()
        self.log.warning(
            "unit-stop-requested",
            unit=key,
            manager=record.manager,
            job=job,
            reason=record.reason,
            msg=f"stopping {key} ({record.reason})",
        )
        record.note(f"stop requested ({job})")
        if record.step == "stop":
            record.step = "plan"

    def _owner(self, record: Record) -> Owner:
        return owner(record.manager, self.user_runtime)

    def _mask_present(self, record: Record) -> bool:
        try:
            return present(record.mask_path, self._owner(record))
        except UnitFileError:
            return False  # not reachable safely: laying it again names the problem

    def _plan(self, record: Record, manager: Manager) -> None:
        # Where the mask goes is ours to say; the manager only has to read it from there.
        control = mask_dir(record.manager, self.user_runtime)
        if control not in {os.path.normpath(d) for d in manager.unit_path_dirs}:
            raise UnitFileError(
                f"{record.manager}: {control} is not in its UnitPath, so a mask there "
                "would not hold"
            )
        who = self._owner(record)
        links = []
        for path in manager.unit_file_links(record.unit):
            try:
                link = read_link(path, who)
            except UnitFileError as e:
                # Not readable as its owner could: not recorded, so never put back.
                record.note(f"plan: {path} left out ({e})")
                continue
            if link is not None:
                links.append(LinkRecord(link.path, link.target, link.uid, link.gid))
        record.links = links
        if not record.cgroup and record.unit.endswith(".service"):
            # Only for the kill of last resort; the snapshot usually had it.
            with contextlib.suppress(ManagerError):
                record.cgroup = manager.unit_control_group(record.unit)
        record.mask_path = os.path.join(control, record.unit)
        # A mask someone else laid stays theirs: release leaves it.
        try:
            record.mask_made = not present(record.mask_path, who)
        except UnitFileError:
            record.mask_made = True  # the way there is not theirs: the mask step says so
        record.note(f"plan: mask {record.mask_path}; links {[lr.path for lr in links]}")
        record.step = "disable"

    def _mask(self, record: Record, manager: Manager) -> None:
        expected = os.path.join(mask_dir(record.manager, self.user_runtime), record.unit)
        if record.mask_path != expected:  # a record from before the guard chose it itself
            raise UnitFileError(f"{record.mask_path}: not where a mask goes ({expected})")
        lay_mask(record.mask_path, self._owner(record))
        record.note(f"masked: {record.mask_path} -> /dev/null")
        record.step = "settle"

    def _settle(self, batch: list[Record]) -> None:
        """Wait for each unit to be inactive; escalate on those that will not stop."""
        if not batch:
            return
        resumed = [r for r in batch if str(r.ref) not in self._stop_sent]
        for record in resumed:  # resumed after a restart of the guard, or a renewed mask
            if self._running(record):
                self._request_stop(record)
        start = min(self._stop_sent.get(str(r.ref), self.clock()) for r in batch)
        pending = {str(r.ref): r for r in batch}
        stage = 0  # 1: KillUnit sent; 2: cgroup killed
        cfg = self.config
        while pending:
            for key, manager in self.managers.items():
                names = [r.unit for r in pending.values() if r.manager == key]
                if not names:
                    continue
                try:
                    states = manager.unit_states(names)
                except ManagerError:
                    continue  # not answering: the deadlines below still run
                for name in names:
                    st = states.get(name)
                    if st is None or st.active_state in SETTLED or st.load_state == "not-found":
                        record = pending.pop(str(UnitRef(key, name)))
                        record.step = "verify"
                        if str(record.ref) not in self._stop_sent:
                            record.note("not running")  # a renewed mask: nothing to stop
                            self._save(record)
                            continue
                        waited = self.clock() - self._stop_sent[str(record.ref)]
                        record.note(f"stopped after {waited:.2f}s")
                        self.log.info(
                            "unit-stopped",
                            unit=str(record.ref),
                            manager=record.manager,
                            seconds=round(waited, 3),
                            msg=f"{record.ref} stopped after {waited:.2f}s",
                        )
                        self._save(record)
            if not pending:
                break
            elapsed = self.clock() - start
            if stage == 0 and elapsed >= cfg.stop_timeout:
                stage = 1
                for record in pending.values():
                    self._kill_unit(record)
            elif stage == 1 and elapsed >= cfg.stop_timeout + cfg.kill_timeout:
                stage = 2
                for record in pending.values():
                    self._kill_cgroup(record, f"still running {elapsed:.1f}s after the stop")
            elif stage == 2 and elapsed >= cfg.stop_timeout + 2 * cfg.kill_timeout:
                for record in pending.values():
                    self._problem(record, "still running after stop, SIGKILL and cgroup kill")
                return
            self.tick()
            self.sleep(POLL)

    def _running(self, record: Record) -> bool:
        """Whether the unit has anything to stop; True when its manager cannot say (stop it)."""
        manager = self.managers.get(record.manager)
        if manager is None:
            return True
        try:
            state = manager.unit_states([record.unit]).get(record.unit)
        except ManagerError:
            return True
        return state is not None and state.active_state not in SETTLED

    def _kill_unit(self, record: Record) -> None:
        manager = self.managers.get(record.manager)
        how = "KillUnit SIGKILL"
        try:
            if manager is None:
                raise ManagerError(f"{record.manager} manager is not connected")
            manager.kill_unit(record.unit, signal.SIGKILL)
        except ManagerError as e:
            self._kill_cgroup(record, str(e))
            return
        record.note(f"killed: {how}")
        self.log.warning(
            "unit-killed",
            unit=str(record.ref),
            manager=record.manager,
            how=how,
            msg=f"{record.ref} did not stop within {self.config.stop_timeout:g}s: {how}",
        )

    def _kill_cgroup(self, record: Record, why: str) -> None:
        try:
            how = cgroupfs.kill(self.cgroup_root, record.cgroup)
        except OSError as e:
            self._problem(record, f"cgroup kill of {record.cgroup or '(unknown cgroup)'}: {e}")
            return
        record.note(f"killed: {how} ({why})")
        self.log.warning(
            "unit-killed",
            unit=str(record.ref),
            manager=record.manager,
            how=how,
            cgroup=record.cgroup,
            error=why,
            msg=f"{record.ref}: killed its cgroup ({why})",
        )

    def _disable(self, record: Record, manager: Manager) -> None:
        if any(not lr.removed for lr in record.links):
            manager.disable_unit_files(record.unit)
        who = self._owner(record)
        left = []
        for lr in record.links:
            if lr.removed:
                continue
            try:
                there = present(lr.path, who)
            except UnitFileError as e:
                # The way to it changed since the plan: not ours to check, nor to put back.
                record.note(f"disable: {lr.path} cannot be checked ({e}); not restored")
                continue
            if there:
                left.append(lr.path)
            else:
                lr.removed = True
                record.note(f"disabled: removed {lr.path} -> {lr.target}")
        if left:
            raise ManagerError(f"{record.manager} left {', '.join(left)} in place")
        record.step = "mask"

    def _verify(self, batch: list[Record]) -> None:
        """LoadState must read 'masked'; a unit still loaded needs one daemon-reload."""
        for key in sorted({r.manager for r in batch}):
            records = [r for r in batch if r.manager == key]
            manager = self.managers.get(key)
            if manager is None:
                continue
            try:
                states = manager.unit_states([r.unit for r in records])
                if any(states[r.unit].load_state != "masked" for r in records if r.unit in states):
                    manager.reload()
                    for r in records:
                        r.note("manager reloaded to load the mask")
                    states = manager.unit_states([r.unit for r in records])
            except ManagerError as e:
                for r in records:
                    self._problem(r, f"verify: {e}")
                continue
            for r in records:
                st = states.get(r.unit)
                if st is not None and st.load_state == "masked":
                    self._blocked(r)
                elif st is not None and st.active_state not in SETTLED:
                    r.step = "settle"  # something started it again before the mask took
                    self._problem(r, f"verify: {r.ref} is {st.active_state} again")
                else:
                    try:
                        shadow = shadowing_file(
                            manager.unit_path_dirs,
                            os.path.dirname(r.mask_path),
                            r.unit,
                            self._owner(r),
                        )
                    except UnitFileError:
                        shadow = None
                    why = f"{shadow} outranks the mask" if shadow else "LoadState is not masked"
                    self._problem(
                        r, f"verify: {r.ref}: {why} (LoadState={st.load_state if st else '?'})"
                    )

    def _blocked(self, record: Record) -> None:
        record.step = "blocked"
        record.problem = ""
        self._reported.pop(str(record.ref), None)
        removed = [lr.path for lr in record.links if lr.removed]
        record.note("verified: LoadState=masked")
        self.log.warning(
            "unit-blocked",
            unit=str(record.ref),
            manager=record.manager,
            reason=record.reason,
            mask=record.mask_path,
            links_removed=removed,
            record=self.store.path_of(record.ref),
            msg=f"{record.ref} is stopped, masked and disabled ({record.reason}: "
            f"{record.detail}); undo with: spark-guard release {record.ref}",
        )

    # --- bookkeeping ----------------------------------------------------------

    def _problem(self, record: Record, problem: str) -> None:
        record.problem = problem
        key = str(record.ref)
        if self._reported.get(key) != problem:  # say it once, not on every retry
            self._reported[key] = problem
            record.note(f"problem: {problem}")
            self._event("block-failed", record, f"{key}: {problem}", error=problem)

    def _event(self, event: str, record: Record, msg: str, **fields: Any) -> None:
        level = self.log.error if event == "block-failed" else self.log.warning
        level(event, unit=str(record.ref), manager=record.manager, msg=msg, **fields)

    def _save(self, record: Record) -> None:
        try:
            self.store.save(record)
            self._on_disk.add(str(record.ref))
        except OSError as e:
            key = str(record.ref)
            problem = f"cannot write {self.store.path_of(record.ref)}: {e}"
            if self._reported.get(key) != problem:
                self._reported[key] = problem
                self._event("block-failed", record, f"{key}: {problem}", error=problem)
        self._generation = self.store.generation()

    def _refresh(self) -> None:
        """Re-read the records when another process (release) changed them."""
        generation = self.store.generation()
        if generation == self._generation:
            return
        self._generation = generation
        records, errors = self.store.all()
        for e in errors:
            if self._reported.get(str(e)) is None:
                self._reported[str(e)] = str(e)
                self.log.error("record-unreadable", error=str(e), msg=str(e))
        self.records = {str(r.ref): r for r in records}
        self._on_disk = set(self.records)
        self._publish()

    def _publish(self) -> None:
        blocked = list(self.records.values())
        text = banner.render(blocked)
        if text == self._banner:
            return
        try:
            banner.publish(blocked, self.motd, self.issue)
            self._banner = text
        except OSError as e:
            self.log.error("banner-failed", error=str(e), msg=f"cannot write the login note: {e}")
