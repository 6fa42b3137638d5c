"""step(): the guard's judgement across passes, as transcripts of plain snapshots.

As h11 tests a connection: a sequence of what the guard saw, and after each one
what it decided, what it would say in the journal and what it would stop. No
manager, no /proc, no root.
"""

from dataclasses import replace

import pytest

from spark_guard.core.config import Config, parse
from spark_guard.core.policy import STEADY, STRICT
from spark_guard.core.snapshot import (
    Action,
    Decision,
    Foreseen,
    Memory,
    Reason,
    RescueGroup,
    SeenUnit,
    Snapshot,
    UnitRef,
)
from spark_guard.core.step import HISTORY_MAX, GuardState, remember, step, take
from spark_guard.foresight.predict import PENDING

GiB = 1024**3
SPARK = 121 * GiB
SSH_DOWN = (RescueGroup(("ssh.service",), present=True, active_since=None),)


def ssh_up(since: float) -> tuple[RescueGroup, ...]:
    return (RescueGroup(("ssh.service",), present=True, active_since=since),)


def llama(
    name, *, since=None, rss=0, predicted=None, starting=False, prediction="estimate", pending=False
):
    foreseen = (
        Foreseen.PENDING
        if pending
        else Foreseen.KNOWN
        if predicted is not None
        else Foreseen.UNKNOWN
    )
    prediction = PENDING if pending else prediction
    return SeenUnit(
        UnitRef("system", f"{name}.service"),
        "activating" if starting else "active",
        pids=() if starting else (100,),
        rss=rss,
        exec_start=(("llama-server", "-m", f"/srv/models/{name}.gguf"),),
        active_since=since,
        predicted=predicted,
        prediction=prediction if predicted is not None or pending else "",
        foreseen=foreseen,
        starting=starting,
    )


def seen(now, available, *units, rescue=SSH_DOWN):
    return Snapshot(
        now=now, memory=Memory(SPARK, available), units=units, rescue=rescue, guard_started=0.0
    )


def replay(transcript, config=None, *, dry_run=False):
    """Feed each snapshot to step(); yield what each pass decided, said and stopped."""
    config = config or Config()
    state = GuardState()
    for snapshot in transcript:
        out = step(state, snapshot, config, dry_run=dry_run)
        state = out.state
        yield out


def said(out):
    return [(e.kind, e.fields.get("unit")) for e in out.events]


def stopped(out):
    return [(str(a.unit), a.reason) for a in out.stops]


def test_a_whole_boot():
    """The incident's boot: a 115 GiB loader starts before ssh is up and is stopped before
    it allocates; a small one is admitted; ssh comes up and after the grace period boot
    is over for good; a restart of the small one is counted as a new run."""
    big = llama("llama-ds4", starting=True, predicted=115 * GiB)
    small = llama("llama-small", since=1.8, rss=2 * GiB, predicted=20 * GiB)
    transcript = [
        seen(1.0, 110 * GiB, big),  # 0: before any process: refused on its footprint
        seen(1.5, 110 * GiB, big),  # 1: its stop is in flight: not asked again
        seen(2.0, 108 * GiB, small),  # 2: the big one gone; the small one fits
        seen(10.0, 100 * GiB, small, rescue=ssh_up(10.0)),  # 3: ssh up, grace running
        seen(70.0, 100 * GiB, small, rescue=ssh_up(10.0)),  # 4: grace over: steady
        seen(71.0, 100 * GiB, small, rescue=SSH_DOWN),  # 5: ssh restarts: boot stays over
        seen(80.0, 100 * GiB, replace(small, active_since=79.0)),  # 6: Restart= again
    ]
    passes = list(replay(transcript))

    assert [p.decision.phase for p in passes] == [STRICT] * 4 + [STEADY] * 3
    assert stopped(passes[0]) == [("llama-ds4.service", "footprint")]
    assert said(passes[0]) == [
        ("loader-seen", "llama-ds4.service"),
        ("decision", "llama-ds4.service"),
    ]
    assert passes[1].decision.actions == passes[0].decision.actions  # still wanted...
    assert (stopped(passes[1]), said(passes[1])) == ([], [])  # ...but not asked twice
    assert (stopped(passes[2]), said(passes[2])) == ([], [("loader-seen", "llama-small.service")])
    assert said(passes[3]) == []
    assert said(passes[4]) == [("phase-changed", None)]
    assert all(said(p) == [] and stopped(p) == [] for p in passes[5:])

    last = passes[-1].state
    assert last.boot_over and passes[-1].snapshot.boot_over
    # Runs counted by their start time: the big one never started; the small one twice.
    assert last.starts == {"llama-small.service": 2}
    assert last.counts == {"stop": 1}
    assert last.last_action == "stop llama-ds4.service (footprint)"
    assert last.told == {UnitRef("system", "llama-small.service")}
    # The brake's "new" loaders: the small one only on the pass it appeared.
    assert [p.state.new_loaders for p in passes[2:4]] == [
        {UnitRef("system", "llama-small.service")},
        frozenset(),
    ]


def test_an_action_is_not_repeated_within_repeat_after_but_a_restart_is_acted_on_at_once():
    unit = UnitRef("system", "llama-ds4-0731.service")

    def decision(since):
        a = Action(
            "stop", unit, Reason.FOOTPRINT, "expects 115GiB", {"mem_available": 1}, since=since
        )
        return Decision(STRICT, 8, (), (a,))

    config, state, runs = Config(), GuardState(), []
    for now, since in [(0.0, 10.0), (1.0, 10.0), (2.0, 12.0), (40.0, 12.0)]:
        state, events, taken, stops = take(state, decision(since), now, config, dry_run=True)
        runs.append(([e.kind for e in events], len(taken), stops))
    assert runs == [
        (["decision", "dry-run"], 1, ()),  # a dry run says it, stops nothing
        ([], 0, ()),  # same run, within repeat_after (30 s)
        (["decision", "dry-run"], 1, ()),  # Restart= brought it back: a new run
        (["decision", "dry-run"], 1, ()),  # still there 38 s later: once more
    ]
    assert state.counts == {"dry-run": 3}
    # Only what can still suppress a repeat is kept: not every action ever taken.
    assert list(state.done) == [("llama-ds4-0731.service", "dry-run", "footprint", 12.0)]
    # Dry run turned off (a reload): what was only said is done at once, not in 30 s.
    state, events, taken, stops = take(state, decision(12.0), 41.0, config, dry_run=False)
    assert [e.kind for e in events] == ["decision"] and [a.unit for a in stops] == [unit]


def test_a_loader_whose_model_is_being_read_is_told_once_the_read_answers():
    reading = llama("llama-slow", since=1.0, rss=GiB, pending=True)
    answered = replace(reading, predicted=30 * GiB, prediction="estimate", foreseen=Foreseen.KNOWN)
    passes = list(replay([seen(1.0, 100 * GiB, reading), seen(1.5, 100 * GiB, reading)])) + list(
        replay([seen(2.0, 100 * GiB, answered)])
    )
    assert [said(p) for p in passes[:2]] == [[], []]  # the trend guards it meanwhile
    assert said(passes[2]) == [("loader-seen", "llama-slow.service")]
    unknown = replace(
        reading,
        prediction="model file unreadable: /srv/models/x.gguf",
        foreseen=Foreseen.UNKNOWN,
    )
    (out,) = replay([seen(3.0, 100 * GiB, unknown)])
    assert said(out) == [
        ("loader-seen", "llama-slow.service"),
        ("footprint-unknown", "llama-slow.service"),
    ]
    assert "model file unreadable" in out.events[1].msg


def test_the_remembered_fall_is_the_trend_that_stops_an_unknown_loader():
    """No footprint known: MemAvailable falls 2 GiB/s, pass after pass; the first pass
    whose projection crosses the reserve within the horizon stops the growing loader.
    (Its boot allowance for an unknown footprint, [boot] unsized, set out of the way:
    this is the trend's transcript.)"""
    config = parse('[boot]\nunsized = "1TiB"\n')
    transcript = [
        seen(
            float(t),
            (40 - 2 * t) * GiB,
            llama("llama-x", since=0.5, rss=(2 * t + 1) * GiB)
            if t == 0
            else replace(llama("llama-x", since=0.5, rss=(2 * t + 1) * GiB), growth=2 * GiB),
        )
        for t in range(8)
    ]
    passes = list(replay(transcript, config))
    assert [round(p.decision.slope / GiB, 1) for p in passes] == [0.0] + [-2.0] * 7
    # 40 - 2t GiB left, 20 GiB more gone within the 10 s horizon: under the reserve
    # (8.5 GiB) first at t = 6. Stopped then, and once: the next pass is the same run.
    assert [[a.reason for a in p.taken] for p in passes] == [[]] * 6 + [["trend"], []]
    assert (40 - 12 - 20) * GiB < Config().reserve_for(SPARK) < (40 - 10 - 20) * GiB
    assert len(passes[-1].snapshot.history) == 8  # the trend window is 5 s: kept twice


def test_history_keeps_twice_the_trend_window_and_at_most_history_max_reads():
    config = Config(trend_window=5.0)
    state = GuardState()
    for i in range(40):
        state = remember(state, i * 0.5, 100 - i, config)
    assert state.history[0] == (9.5, 81) and state.history[-1] == (19.5, 61)  # the last 10 s
    state = GuardState()
    for i in range(HISTORY_MAX + 50):
        state = remember(state, i * 0.001, i, config)
    assert len(state.history) == HISTORY_MAX and state.history[-1][1] == HISTORY_MAX + 49


def test_step_changes_nothing_it_is_given():
    big = llama("llama-ds4", starting=True, predicted=115 * GiB)
    before = GuardState()
    snapshot = seen(1.0, 110 * GiB, big)
    first = step(before, snapshot, Config(), dry_run=False)
    again = step(before, snapshot, Config(), dry_run=False)
    assert before == GuardState() and snapshot.history == ()
    assert first == again  # the same inputs, the same outcome: nothing hidden in between
    with pytest.raises(TypeError):
        first.state.done[("x", "stop", "r", None)] = 0.0  # type: ignore[index]


def test_a_load_a_client_asked_for_is_foreseen_on_top_of_what_the_server_held():
    """`lms load` asks the user's LM Studio server for a 60 GiB model that fits: while the
    server takes it, pass after pass, the guard remembers what the server held before
    (2 GiB) and sees the load arrive as foreseen, not as 60 GiB more to come."""
    client = SeenUnit(
        UnitRef("user:1000", "lms-load.service"),
        pids=(7,),
        exec_start=(("lms", "load", "qwen/qwen3-30b-a3b"),),
        active_since=1.0,
        predicted=60 * GiB,
    )

    def server(holds):
        return SeenUnit(
            UnitRef("user:1000", "lmstudio-server.service"),
            pids=(8,),
            gpu=holds,
            exec_start=(("llmster",),),
            active_since=0.5,
        )

    transcript = [
        seen(1.0 + i, (100 - 20 * i) * GiB, server((2 + 20 * i) * GiB), client) for i in range(4)
    ]
    passes = list(replay(transcript))
    assert [p.taken for p in passes] == [()] * 4
    ref = server(0).ref
    assert [next(ld.expected for ld in p.decision.loaders if ld.ref == ref) for p in passes] == [
        62 * GiB
    ] * 4
    assert passes[0].state.charge_bases == {client.ref: 2 * GiB}
    assert said(passes[0]) == [
        ("loader-seen", "user:1000:lmstudio-server.service"),
        ("loader-seen", "user:1000:lms-load.service"),
    ]
    assert "lands in user:1000:lmstudio-server.service" in passes[0].events[1].msg
    # Without the remembered base, the last pass would take the loaded 62 GiB for the
    # base and see 60 GiB more to come: a refusal of a load that fit and is done.
    (alone,) = replay([transcript[-1]])
    assert [str(a.unit) for a in alone.taken] == ["user:1000:lmstudio-server.service"]
    # The client gone, its charge is forgotten.
    after = step(passes[-1].state, seen(9.0, 40 * GiB, server(62 * GiB)), Config(), dry_run=False)
    assert after.state.charge_bases == {}


def test_a_users_groups_are_not_counted_after_they_are_gone():
    """A group of a user's processes is named by its cgroup, which she names: a loader
    count kept for each would grow the guard with every cgroup she makes."""

    def group(path, since):
        return SeenUnit(
            UnitRef("user:1000", path),
            pids=(300,),
            cmdlines=(("llama-server", "-m", "/srv/models/x.gguf"),),
            active_since=since,
            cgroup=path,
            group="a cgroup of her own",
        )

    base = "/user.slice/user-1000.slice/user@1000.service"
    passes = [seen(float(i), 100 * GiB, group(f"{base}/h{i}", float(i))) for i in range(1, 40)]
    for out in replay(passes):
        state = out.state
    assert list(state.starts) == [f"user:1000:{base}/h39"]
    assert len(state.started_at) == 1


def test_a_groups_kill_is_not_held_back_by_repeat_after():
    """A kill holds nothing down: her loader started again in the same group (its start,
    first seen, unchanged) is killed on the next pass, not 30 s later."""
    group = UnitRef("user:1000", "/user.slice/user-1000.slice/user@1000.service/hideout")
    action = Action(
        "stop", group, Reason.RESERVE, "grows", {"mem_available": 1}, since=5.0, how="kill"
    )
    decision = Decision(STRICT, 8, (), (action,))
    state = GuardState()
    kills = []
    for now in (10.0, 10.5, 11.0):
        state, _, _, stops = take(state, decision, now, Config(), dry_run=False)
        kills.append(len(stops))
    assert kills == [1, 1, 1]


def test_a_loader_told_of_with_an_unknown_footprint_is_told_again_once_it_is_known():
    """The incident at boot: her copy is seen before her manager answers, from what the
    kernel shows, and its size is not yet known; once her manager answers and the model's
    header is read, the journal says the footprint, and that copy is stopped for it."""
    first = llama("llama-ds4-0731", since=1.0, rss=GiB // 2)
    first = replace(first, exec_start=(), prediction="no model file or size in its command line")
    known = replace(
        first,
        exec_start=(("llama-server", "-m", "/srv/models/ds4.gguf"),),
        predicted=118 * GiB,
        prediction="estimate",
        foreseen=Foreseen.KNOWN,
    )
    passes = list(
        replay(
            [seen(1.0, 100 * GiB, first), seen(1.5, 100 * GiB, first), seen(2.0, 100 * GiB, known)]
        )
    )
    assert said(passes[0]) == [
        ("loader-seen", "llama-ds4-0731.service"),
        ("footprint-unknown", "llama-ds4-0731.service"),
    ]
    assert said(passes[1]) == []
    assert ("loader-seen", "llama-ds4-0731.service") in said(passes[2])
    assert passes[2].events[0].fields["expected"] == 118 * GiB
    assert stopped(passes[2]) == [("llama-ds4-0731.service", "footprint")]


def test_a_loader_told_of_by_the_kernels_view_is_told_again_in_her_managers_words():
    """Her manager is out of view (busy with a daemon-reload of a 60 MB unit) when her
    loader starts: it is told from what the kernel shows. When her manager answers, it is
    told again with what the manager said, here why its ExecStart= could not be read; and
    a loss of view after that says nothing new."""
    user = UnitRef("user:4200", "llama-env.service")
    kernel = replace(
        llama("llama-env", since=None, rss=GiB // 2),
        ref=user,
        exec_start=(),
        unmanaged="its manager is out of view",
        prediction="",
    )
    refused = replace(
        kernel,
        unmanaged="",
        active_since=1.2,
        prediction="user:4200: reading Environment: a reply of 60000727 bytes, over 262144",
    )
    passes = list(
        replay(
            [
                seen(1.0, 100 * GiB, kernel),
                seen(1.5, 100 * GiB, kernel),
                seen(2.0, 100 * GiB, refused),
                seen(2.5, 100 * GiB, refused),
                seen(3.0, 100 * GiB, kernel),
                seen(3.5, 100 * GiB, refused),
            ]
        )
    )
    told = [("loader-seen", str(user)), ("footprint-unknown", str(user))]
    assert [said(p) for p in passes] == [told, [], told, [], [], []]
    assert "its manager is out of view" in passes[0].events[0].msg
    assert "no model file or size in its command line" in passes[0].events[1].msg
    assert "its manager is out of view" not in passes[2].events[0].msg
    assert "reading Environment: a reply of 60000727 bytes" in passes[2].events[1].msg
