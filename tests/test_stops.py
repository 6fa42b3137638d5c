"""The stop-only machine (core/stops.py) as transcripts of plain values, in h11's style.

Each test feeds advance() what an executor would read, pass by pass, and checks what it
says to do: no files, no managers, no clock. A line of a transcript is (seconds since
the stop, what was seen) and what came out, written as a user would read the journal:
"kill unit" (KillUnit SIGKILL through its manager), "kill cgroup" (the kernel's kill),
"failed" (the stop could not go through; its cgroup killed), "said <event>".
"""

from __future__ import annotations

from spark_guard.core import stops
from spark_guard.core.snapshot import CONTAINER, UnitRef
from spark_guard.core.stops import Kill, Limits, Say, Seen, Stop

REF = UnitRef("system", "llama.service")
BOX = UnitRef(CONTAINER, "llm")
CGROUP = "/system.slice/llama.service"
LIMITS = Limits(stop_timeout=10.0, kill_timeout=5.0)
SERVER, NEW = (100, 7), (200, 9)  # (pid, start) of the run the stop went to, of a new run
GiB = 1 << 30
SHORT = (1 * GiB, 4 * GiB)  # the judged figure below the reserve


def words(commands: tuple[stops.Command, ...]) -> list[str]:
    out = []
    for c in commands:
        if isinstance(c, Say):
            out.append(f"said {c.event.kind}")
        elif isinstance(c, stops.Settled):
            out.append("settled" if c.waited is not None else "settled quietly")
        elif isinstance(c, stops.GiveUp):
            out.append(f"gave up: {c.why}")
        elif c.failed:
            out.append("failed")
        else:
            out.append("kill unit" if c.unit else "kill cgroup")
    return out


def transcript(stop: Stop | None, lines: list[tuple[float, Seen]]) -> list[tuple[float, list[str]]]:
    """What advance() says at each line; "forgotten" once it returns None."""
    out = []
    for at, seen in lines:
        assert stop is not None, f"advanced after it was forgotten, at {at}"
        stop, commands = stops.advance(stop, seen, at, LIMITS)
        out.append((at, words(commands) + (["forgotten"] if stop is None else [])))
    return out


def sent() -> Stop:
    """A unit's stop that went out at 0 to the server's one process."""
    stop, _ = stops.sent(REF, CGROUP, 0.0, "footprint", job="/j/1", went_to=frozenset({SERVER}))
    return stop


def running() -> Seen:
    return Seen(left=frozenset({SERVER}), active_state="active", load_state="loaded")


def test_a_stop_that_is_ignored_is_killed_on_time_then_its_cgroup_then_rests_and_again():
    assert transcript(
        sent(),
        [
            (1.0, Seen(left=frozenset({SERVER}), active_state="deactivating")),
            (9.9, Seen(left=frozenset({SERVER}), active_state="deactivating")),
            (10.0, Seen(left=frozenset({SERVER}), active_state="deactivating")),
            (15.0, Seen(left=frozenset({SERVER}), active_state="deactivating")),
            (20.0, Seen(left=frozenset({SERVER}), active_state="deactivating")),
            (24.9, Seen(left=frozenset({SERVER}), active_state="deactivating")),  # resting
            (25.0, Seen(left=frozenset({SERVER}), active_state="deactivating")),
            (25.1, Seen(active_state="inactive")),
        ],
    ) == [
        (1.0, []),
        (9.9, []),
        (10.0, ["kill unit"]),
        (15.0, ["kill cgroup"]),
        (20.0, ["said unit-stop-failed"]),
        (24.9, []),
        (25.0, ["kill unit"]),
        (25.1, ["said unit-stopped", "forgotten"]),
    ]


def test_below_the_reserve_the_waiting_is_skipped():
    deactivating = Seen(left=frozenset({SERVER}), active_state="deactivating", memory=SHORT)
    assert transcript(sent(), [(0.1, deactivating), (0.3, deactivating), (0.6, deactivating)]) == [
        (0.1, ["kill unit"]),
        (0.3, []),  # KILL_GRACE after the SIGKILL
        (0.6, ["kill cgroup"]),
    ]


def test_settled_means_stopped_and_nothing_left_in_its_cgroup():
    """F3: with KillMode=process the unit reads inactive while its server (a child of its
    wrapper) keeps the memory: it is escalated until nothing is left."""
    left = Seen(left=frozenset({(101, 8)}), active_state="inactive")
    assert transcript(
        sent(), [(1.0, left), (10.0, left), (10.5, Seen(active_state="inactive"))]
    ) == [
        (1.0, []),
        (10.0, ["kill unit"]),
        (10.5, ["said unit-stopped", "forgotten"]),
    ]


def test_a_run_the_stop_never_went_to_is_not_killed():
    """F8: StopUnit is answered before its job runs, and a fast Restart= reads `active` at
    every look: a run with none of the processes the stop went to is a new decision's."""
    new_run = Seen(left=frozenset({NEW}), active_state="active")
    assert transcript(sent(), [(10.0, new_run)]) == [(10.0, ["said unit-stopped", "forgotten"])]
    # The same stop whose job waits behind another (its run still there): escalated.
    assert transcript(sent(), [(10.0, running())]) == [(10.0, ["kill unit"])]


def test_active_again_after_it_was_seen_deactivating_is_a_new_run():
    stop = stops.Stop(REF, CGROUP, sent().stopping)  # its processes unknown
    assert transcript(
        stop,
        [(0.5, Seen(left=frozenset({SERVER}), active_state="deactivating")), (10.0, running())],
    ) == [(0.5, []), (10.0, ["said unit-stopped", "forgotten"])]


def test_an_earlier_guards_stop_waits_for_its_manager_and_does_not_keep_the_loop_busy():
    """F11: a stop kept on disk by an earlier guard, its manager silent or gone: which run is
    there cannot be told, so it is never escalated blind, and it waits (not busy)."""
    stop = stops.restored(REF, CGROUP, 0.0, "b00t", "b00t", now=3.0)
    assert stop is not None and stop.restored
    after, commands = stops.advance(
        stop, Seen(left=frozenset({SERVER}), manager=False), 60.0, LIMITS
    )
    assert after is not None and after.waiting and commands == ()
    after, commands = stops.advance(
        after, Seen(left=frozenset({SERVER}), answered=False), 61.0, LIMITS
    )
    assert after is not None and after.waiting and commands == ()
    # Its manager answers: active, long after the stop, is a new run, never this stop's.
    assert transcript(after, [(62.0, running())]) == [(62.0, ["said unit-stopped", "forgotten"])]


def test_this_guards_stop_escalates_while_its_manager_is_silent():
    silent = Seen(left=frozenset({SERVER}), answered=False)
    assert transcript(sent(), [(10.0, silent), (15.0, silent)]) == [
        (10.0, ["kill unit"]),
        (15.0, ["kill cgroup"]),
    ]
    # Its manager gone meanwhile: nothing can start a new run; the kill is the kernel's.
    gone = Seen(left=frozenset({SERVER}), manager=False)
    stop, commands = stops.advance(sent(), gone, 10.0, LIMITS)
    assert words(commands) == ["kill cgroup"] and stop is not None and not stop.waiting
    assert transcript(stop, [(10.5, Seen(manager=False))]) == [
        (10.5, ["said unit-stopped", "forgotten"])
    ]


def test_only_this_boots_stops_of_units_are_taken_over():
    assert stops.restored(REF, CGROUP, 5.0, "old", "b00t", now=1.0) is None
    assert stops.restored(REF, CGROUP, 5.0, "", "", now=1.0) is None
    assert stops.restored(BOX, "/docker/x", 5.0, "b00t", "b00t", now=1.0) is None
    stop = stops.restored(REF, CGROUP, 5.0, "b00t", "b00t", now=1.0)
    assert stop is not None and stop.stopping.sent == 1.0  # never from the future


def test_a_frozen_loader_that_ignores_sigterm_is_killed_at_once():
    stop, commands = stops.sent(REF, CGROUP, 0.0, "footprint", frozen=True, ignores_sigterm=True)
    assert words(commands) == ["said unit-stop-requested", "kill unit"]
    # Its escalation goes on from the SIGKILL: the cgroup's kill is next.
    assert transcript(stop, [(5.0, running())]) == [(5.0, ["kill cgroup"])]
    _, commands = stops.sent(REF, CGROUP, 0.0, "footprint", frozen=False, ignores_sigterm=True)
    assert words(commands) == ["said unit-stop-requested"]


def test_a_stop_its_manager_refuses_kills_its_cgroup_and_says_so():
    kill = stops.refused(REF, CGROUP, "Connection timed out")
    assert not kill.unit and kill.failed
    event = kill.event("cgroup.kill")
    assert event.kind == "unit-stop-failed" and event.level == "error"
    assert event.msg == "cannot stop llama.service: Connection timed out; cgroup.kill"


def test_a_containers_stop_is_its_engines_until_it_fails():
    stop, commands = stops.sent(BOX, "/docker/x", 0.0, "footprint", engine="/run/docker.sock")
    assert words(commands) == ["said unit-stop-requested"]
    assert "through /run/docker.sock" in commands[0].event.msg  # type: ignore[union-attr]
    # Under way in its engine, past the stop timeout: killed from the kernel's side (no
    # KillUnit: it is no unit), as the engine would after its own timeout.
    busy = Seen(left=frozenset({SERVER}), busy=True)
    assert transcript(stop, [(9.0, busy), (10.0, busy)]) == [(9.0, []), (10.0, ["kill cgroup"])]
    # The engine failed: killed from the kernel's side, said, and forgotten.
    failed = Seen(left=frozenset({SERVER}), error="no answer within 5s")
    assert transcript(stop, [(31.0, failed)]) == [(31.0, ["failed", "forgotten"])]
    # Stopped by it: said, forgotten.
    assert transcript(stop, [(2.0, Seen())]) == [(2.0, ["said unit-stopped", "forgotten"])]
    # No engine known and no cgroup: said so, nothing to kill.
    box, _ = stops.sent(BOX, "", 0.0, "footprint", engine="")
    _, commands = stops.advance(box, Seen(error="no engine known for it"), 0.1, LIMITS)
    assert words(commands) == ["said unit-stop-failed"]
    assert commands[0].event.fields["how"] == "no cgroup known"  # type: ignore[union-attr]


def test_kills_are_said_with_how_they_went():
    kill = Kill(REF, CGROUP, "it did not stop within 10s", unit=True)
    event = kill.event("KillUnit SIGKILL")
    assert event.kind == "unit-killed" and event.fields["how"] == "KillUnit SIGKILL"
    assert event.msg == "llama.service: KillUnit SIGKILL: it did not stop within 10s"


def block(quiet: bool = False) -> Stop:
    """A unit's block at its settle step, its stop sent at 0 (quiet: none was sent)."""
    return Stop(REF, CGROUP, sent().stopping, kind=stops.Kind.BLOCK, quiet=quiet)


def test_a_blocks_stop_is_escalated_until_stopped_and_its_cgroup_empty():
    """F3 for a block: inactive with its server left in the cgroup is not settled; and a
    new run is as much its to stop as the first (the block stands until its mask holds)."""
    left = Seen(left=frozenset({NEW}), active_state="inactive")
    assert transcript(
        block(),
        [
            (1.0, running()),
            (10.0, Seen(left=frozenset({NEW}), active_state="active")),
            (15.0, left),
            (20.0, left),
            (24.0, Seen(active_state="inactive")),
        ],
    ) == [
        (1.0, []),
        (10.0, ["kill unit"]),
        (15.0, ["kill cgroup"]),
        (20.0, ["gave up: still running after stop, SIGKILL and cgroup kill"]),
        (24.0, ["settled", "said unit-stopped"]),
    ]


def test_a_blocks_stop_whose_manager_is_silent_runs_on_its_deadlines():
    silent = Seen(left=frozenset({SERVER}), answered=False, active_state="inactive")
    gone = Seen(manager=False)  # nothing can be read of it: never taken for stopped
    assert transcript(block(), [(5.0, gone), (10.0, silent), (15.0, gone)]) == [
        (5.0, []),
        (10.0, ["kill unit"]),
        (15.0, ["kill cgroup"]),
    ]


def test_a_block_found_stopped_with_no_stop_sent_says_nothing_and_a_rewind_kills_at_once():
    assert transcript(block(quiet=True), [(3.0, Seen(active_state="inactive"))]) == [
        (3.0, ["settled quietly"])
    ]
    # Settled, then running again (a rewind to settle): escalated from the stop it was
    # sent, whose timeout is long past: SIGKILL at once.
    stop, _ = stops.advance(block(), Seen(active_state="inactive"), 2.0, LIMITS)
    assert stop is not None
    assert transcript(stop, [(30.0, running())]) == [(30.0, ["kill unit"])]
