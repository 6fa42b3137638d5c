"""The incident, as the regression gate: the report's machine booted in the orders a real
boot produces, with the .deb installed and systemd as PID 1, on Debian 12 and Ubuntu 24.04.

lab/incident.py lays the machine out and replays it (three boots of one tree per
layout: her manager up before the guard's first look, a normal boot where it comes up
after, and a second boot of the same tree), recording what an admin would look at. Each
test holds one case of the matrix to it: the loaders that must not load are stopped,
masked and disabled (no wants link left), never restarted, their unit files byte for
byte as written, the rescue path answers, and `spark-guard release --all` puts every
link back exactly. A red case says every check it failed, with the guard's journal.

Two layouts per OS share the boots: A (the 115 GB model with her copy second, the model
that fits with her copy first, her LM Studio and Ollama servers with their clients) and
B (the other way round). About 20 s a layout when every case holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lab.incident import (
    HER_DS4,
    HER_QWEN,
    LMS_LOAD,
    LMS_SERVER,
    OLLAMA_PRELOAD,
    OLLAMA_SERVER,
    PHASES,
    SYS_DS4,
    SYS_QWEN,
    VARIANTS,
    Phase,
    Replay,
    Unit,
    replay,
)

pytestmark = pytest.mark.nspawn

SUITES = {"debian-12": "bookworm", "ubuntu-24.04": "noble"}
ORDERS = ("user-copy-first", "user-copy-second")
MANAGER = ("manager-before", "manager-after")
GiB = 1024**3


@pytest.fixture(scope="module")
def replays(deb: Path) -> Callable[[str, str], Replay]:
    """Each layout replayed once, on first use; its cases read what it recorded."""
    done: dict[tuple[str, str], Replay] = {}

    def get(os_id: str, key: str) -> Replay:
        if (os_id, key) not in done:
            done[(os_id, key)] = replay(SUITES[os_id], VARIANTS[key], deb)
        return done[(os_id, key)]

    return get


class Checks:
    """Every check of a case, failed ones listed together with the guard's journal."""

    def __init__(self, r: Replay, phase: Phase) -> None:
        self.r = r
        self.phase = phase
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)

    def done(self) -> None:
        if not self.failed:
            return
        lines = [f"{len(self.failed)} check(s) failed:", *(f"  - {f}" for f in self.failed)]
        lines.append(
            f"({self.r.suite}, layout {self.r.variant.key}, phase {self.phase.name}: "
            f"settled={self.phase.settled} after {self.phase.waited:.1f}s; "
            f"guard {self.phase.guard})"
        )
        lines.append(f"--- journalctl -b -u spark-guard ({self.phase.name}) ---")
        lines.append(self.phase.journal[-12000:])
        lines.append(f"--- what the managers logged of the loaders ({self.phase.name}) ---")
        lines.append(self.phase.unit_log[-6000:])
        pytest.fail("\n".join(lines), pytrace=False)


def phase_of(r: Replay, name: str) -> Phase:
    if name not in r.phases:
        pytest.fail(f"{r.suite} {r.variant.key}: phase {name} not reached:\n{r.error}")
    return r.phases[name]


def files_of(tree: dict[str, tuple[object, ...]], units: tuple[Unit, ...]) -> dict[str, object]:
    """The units' own files in a tree: unit files, drop-ins and wants links."""
    names = {u.name for u in units} | {u.name + ".d" for u in units}
    return {p: v for p, v in tree.items() if names & set(p.split("/"))}


def check_blocked(check: Checks, phase: Phase, unit: Unit) -> None:
    """Stopped, masked, disabled, never restarted: what `systemctl show` and `ls` say."""
    seen = phase.units[unit.ref]
    p = seen.props
    check(p.get("ActiveState") in ("inactive", "failed"), f"{unit.ref} not stopped: {p}")
    check(p.get("LoadState") == "masked", f"{unit.ref} not masked: {p}")
    check(p.get("UnitFileState") == "masked-runtime", f"{unit.ref} UnitFileState: {p}")
    check(not seen.linked, f"{unit.ref} still enabled: {unit.link} is there")
    check(
        seen.record is not None and seen.record.get("step") == "blocked",
        f"{unit.ref}: no finished block recorded: {seen.record}",
    )
    settled = phase.at_settle.get(unit.ref, {})
    check(
        p.get("NRestarts") == "0" and settled.get("NRestarts") == "0",
        f"{unit.ref} restarted: NRestarts {settled.get('NRestarts')} then {p.get('NRestarts')}",
    )
    runs, restarts = phase.runs.get(unit.ref, -1), phase.restarts.get(unit.ref, -1)
    check(
        restarts == 0 and 0 <= runs <= 1,
        f"{unit.ref} restarted: its manager started it {runs} time(s) this boot, "
        f"{restarts} by Restart=",
    )
    check(
        p.get("InvocationID") == settled.get("InvocationID"),
        f"{unit.ref} ran again after it was stopped: InvocationID "
        f"{settled.get('InvocationID')} -> {p.get('InvocationID')}",
    )


def check_common(check: Checks, r: Replay, phase: Phase, units: tuple[Unit, ...]) -> None:
    """The rescue path, the guard itself, and the unit files as the admin wrote them."""
    check(phase.ssh.startswith("SSH-2.0-"), f"sshd does not answer: {phase.ssh}")
    check(
        phase.guard.get("ActiveState") == "active" and phase.guard.get("NRestarts") == "0",
        f"the guard is not up, or restarted: {phase.guard}",
    )
    blocked_links = {u.link for u in units if phase.units[u.ref].props.get("LoadState") == "masked"}
    expected = {p: v for p, v in files_of(r.before, units).items() if p not in blocked_links}
    now = files_of(phase.tree, units)
    changed = sorted(p for p in set(expected) | set(now) if expected.get(p) != now.get(p))
    check(not changed, f"unit files or links changed beyond the disabled links: {changed}")


def check_release(check: Checks, r: Replay, phase: Phase, units: tuple[Unit, ...]) -> None:
    """`spark-guard release --all`: every mask gone, every link back, owner and mode."""
    rel = phase.released
    if rel is None:
        check(False, f"no release after {phase.name}")
        return
    check(rel.rc == 0, f"spark-guard release --all exited {rel.rc}: {rel.output}")
    for u in units:
        if phase.units[u.ref].props.get("LoadState") == "masked":
            check(f"released {u.ref}: " in rel.output, f"{u.ref} not released: {rel.output}")
        state = rel.units.get(u.ref, {})
        check(
            state == {"LoadState": "loaded", "UnitFileState": "enabled"},
            f"{u.ref} after release: {state}",
        )
    before, after = files_of(r.before, units), files_of(rel.tree, units)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    check(not changed, f"release left these not as they were: {changed}")


def check_order(check: Checks, phase: Phase, user_first: bool, system: Unit, hers: Unit) -> None:
    """The boot gave them the order the case is named for (when both started at all)."""
    times = phase.started or {
        ref: int(seen.props.get("ExecMainStartTimestampMonotonic", "0") or 0)
        for ref, seen in phase.units.items()
    }
    a, b = times.get(system.ref, 0), times.get(hers.ref, 0)
    if a and b:
        check((b < a) == user_first, f"start order not as named: system {a}, hers {b}")


def replay_for(replays, os_id: str, pair: str, order: str) -> Replay:
    """The layout that has this pair in this order (lab/incident.py: A and B)."""
    user_first = order == "user-copy-first"
    if pair == "ds4":
        return replays(os_id, "B" if user_first else "A")
    return replays(os_id, "A" if user_first else "B")


@pytest.mark.parametrize("manager", MANAGER)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("os_id", SUITES)
def test_the_115gb_model_is_blocked_on_both_levels(replays, os_id, order, manager):
    """llama-ds4-0731.service, the system copy and hers (with a draft): a 115 GB GGUF on
    a machine with less memory. Both are refused by the footprint their command line and
    the model's header give (hers may be refused as root's duplicate first, when both
    run at once): stopped, masked, disabled, never restarted."""
    r = replay_for(replays, os_id, "ds4", order)
    phase = phase_of(r, manager)
    check = Checks(r, phase)
    check_order(check, phase, order == "user-copy-first", SYS_DS4, HER_DS4)
    for unit in (SYS_DS4, HER_DS4):
        check_blocked(check, phase, unit)
    for unit, reasons in ((SYS_DS4, ("footprint",)), (HER_DS4, ("footprint", "duplicate"))):
        rec = phase.units[unit.ref].record or {}
        check(rec.get("reason") in reasons, f"{unit.ref} reason {rec.get('reason')}")
        if rec.get("reason") == "footprint":
            figures = rec.get("figures", {})
            check(
                figures.get("expected", 0) > figures.get("mem_total", 0) > 0,
                f"{unit.ref}: expected not from the 115 GB header: {figures}",
            )
    units = (SYS_DS4, HER_DS4)
    check_common(check, r, phase, units)
    if manager == "manager-before":
        check_release(check, r, phase, units)
    else:  # released after the second boot of the same tree
        check_release(check, r, phase_of(r, "second-boot"), units)
    check.done()


@pytest.mark.parametrize("manager", MANAGER)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("os_id", SUITES)
def test_the_model_that_fits_is_loaded_once(replays, os_id, order, manager):
    """llama-qwen3.service on both levels, a Qwen3-0.6B GGUF: it fits, so only the
    duplicate rule refuses a copy. Root's copy keeps the model over a user's
    (docs/security.md, finding 7), whichever started first: hers is stopped, masked and
    disabled as the duplicate; the system copy runs on, enabled, never restarted."""
    r = replay_for(replays, os_id, "qwen3", order)
    phase = phase_of(r, manager)
    check = Checks(r, phase)
    check_order(check, phase, order == "user-copy-first", SYS_QWEN, HER_QWEN)
    check_blocked(check, phase, HER_QWEN)
    rec = phase.units[HER_QWEN.ref].record or {}
    check(rec.get("reason") == "duplicate", f"{HER_QWEN.ref} reason {rec.get('reason')}")
    kept = phase.units[SYS_QWEN.ref]
    p = kept.props
    check(
        (p.get("ActiveState"), p.get("LoadState"), p.get("UnitFileState"), p.get("NRestarts"))
        == ("active", "loaded", "enabled", "0"),
        f"{SYS_QWEN.ref} not running as enabled: {p}",
    )
    check(kept.linked and kept.record is None, f"{SYS_QWEN.ref} acted on: {kept.record}")
    check(
        p.get("InvocationID") == phase.at_settle[SYS_QWEN.ref].get("InvocationID")
        and phase.runs.get(SYS_QWEN.ref) == 1,
        f"{SYS_QWEN.ref} was started again: {phase.runs.get(SYS_QWEN.ref)} run(s)",
    )
    units = (SYS_QWEN, HER_QWEN)
    check_common(check, r, phase, units)
    release = phase if manager == "manager-before" else phase_of(r, "second-boot")
    check_release(check, r, release, units)
    check.done()


def check_server(r: Replay, manager: str, server: Unit, client: Unit) -> None:
    phase = phase_of(r, manager)
    check = Checks(r, phase)
    spool = f"/.fake-{'lms' if server is LMS_SERVER else 'ollama'}-spool/"
    reached = [p for p in phase.loads if spool in p]
    check(not reached, f"the 115 GB load reached {server.ref}: {reached}")
    check_blocked(check, phase, server)
    rec = phase.units[server.ref].record or {}
    check(rec.get("reason") == "footprint", f"{server.ref} reason {rec.get('reason')}")
    check(
        client.ref in (rec.get("clients") or []),
        f"{server.ref} not blocked for {client.ref}'s load: clients {rec.get('clients')}",
    )
    figures = rec.get("figures", {})
    check(
        figures.get("expected", 0) > 100 * GiB,
        f"{server.ref}: the load's 115 GB not charged: {figures}",
    )
    # Her client holds nothing: the guard may leave it, or block it once its server is
    # gone (it asks still, and no server is there to charge); either way, as a block.
    seen = phase.units[client.ref]
    if seen.props.get("LoadState") == "masked":
        check_blocked(check, phase, client)
    else:
        check(seen.linked, f"{client.ref} disabled without a mask: {seen.props}")
    units = (server, client)
    check_common(check, r, phase, units)
    release = phase if manager == "manager-before" else phase_of(r, "second-boot")
    check_release(check, r, release, units)
    check.done()


@pytest.mark.parametrize("manager", MANAGER)
@pytest.mark.parametrize("os_id", SUITES)
def test_her_lm_studio_server_is_blocked_for_her_lms_load(replays, os_id, manager):
    """Her lmstudio-server.service (`lms server start`, linger) and the incident's
    lms-load.service, which asks it for the 115 GB model after a boot delay: the load is
    charged to the server, which is blocked before the load reaches it."""
    check_server(replays(os_id, "A"), manager, LMS_SERVER, LMS_LOAD)


@pytest.mark.parametrize("manager", MANAGER)
@pytest.mark.parametrize("os_id", SUITES)
def test_her_ollama_server_is_blocked_for_her_preload(replays, os_id, manager):
    """Her ollama.service (`ollama serve`) and a preload unit (`ollama run ds4-0731` after
    a boot delay): the same, for Ollama."""
    check_server(replays(os_id, "A"), manager, OLLAMA_SERVER, OLLAMA_PRELOAD)


@pytest.mark.parametrize("key", VARIANTS)
@pytest.mark.parametrize("os_id", SUITES)
def test_a_second_boot_starts_nothing_it_blocked(replays, os_id, key):
    """The same tree booted again: no loader that must not load starts (its link is gone,
    the guard lays its mask again before her manager could start it), root's copy of
    the model that fits starts as enabled, and the last `release --all` leaves
    /etc/systemd/system and her ~/.config/systemd exactly as they were laid out."""
    r = replays(os_id, key)
    after, again = phase_of(r, PHASES[1]), phase_of(r, PHASES[2])
    check = Checks(r, again)
    blocked = [
        u
        for u in r.variant.units
        if u in r.variant.blocked or after.units[u.ref].props.get("LoadState") == "masked"
    ]
    for unit in blocked:
        seen = again.units[unit.ref]
        p = seen.props
        check(
            p.get("ActiveEnterTimestampMonotonic") == "0"
            and p.get("ExecMainStartTimestampMonotonic") == "0",
            f"{unit.ref} started on the second boot: {p}",
        )
        check(p.get("LoadState") == "masked", f"{unit.ref} not masked again: {p}")
        check(not seen.linked, f"{unit.ref} enabled again: {unit.link}")
        check(p.get("NRestarts") == "0", f"{unit.ref} NRestarts {p.get('NRestarts')}")
        runs = again.runs.get(unit.ref, -1)
        check(runs == 0, f"{unit.ref}: its manager started it {runs} time(s) this boot")
    kept = again.units[SYS_QWEN.ref].props
    check(kept.get("ActiveState") == "active", f"{SYS_QWEN.ref} did not start: {kept}")
    check(again.ssh.startswith("SSH-2.0-"), f"sshd does not answer: {again.ssh}")
    check(
        again.guard.get("ActiveState") == "active" and again.guard.get("NRestarts") == "0",
        f"the guard is not up, or restarted: {again.guard}",
    )
    rel = again.released
    check(rel is not None and rel.rc == 0, f"release --all: {rel and rel.output}")
    if rel is not None:
        changed = sorted(
            p for p in set(r.before) | set(rel.tree) if r.before.get(p) != rel.tree.get(p)
        )
        check(not changed, f"after release --all, not as laid out: {changed}")
    check.done()
