"""decide(): plain snapshots in, plain actions out."""

from dataclasses import replace

from spark_guard.containers import image_evidence
from spark_guard.core.config import Config, parse
from spark_guard.core.policy import STEADY, STRICT, brake, decide, phase, slope
from spark_guard.core.snapshot import (
    CONTAINER,
    ContainerFacts,
    Memory,
    RescueGroup,
    SeenUnit,
    Snapshot,
    UnitRef,
    parse_ref,
)

GiB = 1024**3
SPARK = 121 * GiB
SSH = (RescueGroup(("ssh.service", "ssh.socket"), present=True, active_since=None),)
SSH_UP = (RescueGroup(("ssh.service", "ssh.socket"), present=True, active_since=10.0),)


def loader(
    name, *, manager="system", rss=0, gpu=0, since=1.0, model=None, growth=0.0, state="active"
):
    argv = ("llama-server", "-m", model) if model else ("llama-server",)
    return SeenUnit(
        UnitRef(manager, name),
        state,
        pids=(100,),
        rss=rss,
        gpu=gpu,
        exec_start=(argv,),
        active_since=since,
        growth=growth,
    )


def snap(available, *units, now=20.0, rescue=SSH, history=(), total=SPARK, started=0.0):
    return Snapshot(
        now=now,
        memory=Memory(total, available),
        units=units,
        rescue=rescue,
        history=history or ((now, available),),
        guard_started=started,
    )


def footprints(**sizes):
    lines = "".join(f'"{k}.service" = "{v}GiB"\n' for k, v in sizes.items())
    return parse("[loaders.footprint]\n" + lines)


# --- phase ---------------------------------------------------------------


def test_strict_until_rescue_active_plus_grace():
    c = Config()  # grace 60 s
    assert phase(snap(100 * GiB, rescue=SSH), c) == STRICT
    assert phase(snap(100 * GiB, rescue=SSH_UP, now=69.0), c) == STRICT
    assert phase(snap(100 * GiB, rescue=SSH_UP, now=70.0), c) == STEADY


def test_every_present_group_must_be_up_and_absent_groups_are_skipped():
    gui_down = RescueGroup(("graphical.target",), present=True, active_since=None)
    absent = RescueGroup(("sshd.service",), present=False, active_since=None)
    assert phase(snap(1, rescue=(*SSH_UP, gui_down), now=500), Config()) == STRICT
    assert phase(snap(1, rescue=(*SSH_UP, absent), now=500), Config()) == STEADY


def test_without_any_rescue_unit_boot_is_guarded_for_one_grace_from_start():
    none = (RescueGroup(("ssh.service",), present=False, active_since=None),)
    assert phase(snap(1, rescue=none, now=30, started=0), Config()) == STRICT
    assert phase(snap(1, rescue=none, now=61, started=0), Config()) == STEADY


# --- strict phase ------------------------------------------------------------


def test_strict_stops_a_loader_whose_footprint_would_breach_the_reserve():
    # The incident: 115 GiB model, 110 GiB available at boot.
    c = footprints(**{"llama-ds4-0731": 115})
    d = decide(snap(110 * GiB, loader("llama-ds4-0731.service")), c)
    assert d.phase == STRICT
    assert [(a.kind, a.unit.name, a.reason) for a in d.actions] == [
        ("stop", "llama-ds4-0731.service", "footprint")
    ]
    assert d.actions[0].figures["expected"] == 115 * GiB
    assert d.actions[0].figures["reserve"] == d.reserve == int(SPARK * 0.07)


def test_strict_admits_a_loader_that_fits_and_counts_what_it_already_holds():
    c = footprints(small=40)
    assert decide(snap(60 * GiB, loader("small.service")), c).actions == ()
    # 30 GiB of its 40 are loaded, so 10 more must fit in 20 available: fine.
    assert decide(snap(20 * GiB, loader("small.service", gpu=30 * GiB)), c).actions == ()
    # Counted as fresh, the same 40 GiB would not fit in 20 GiB.
    assert decide(snap(20 * GiB, loader("small.service")), c).actions != ()


def test_strict_admits_oldest_first_and_stops_the_one_that_does_not_fit():
    c = footprints(a=50, b=50)
    d = decide(snap(100 * GiB, loader("b.service", since=2.0), loader("a.service", since=1.0)), c)
    assert [a.unit.name for a in d.actions] == ["b.service"]


def test_strict_trend_stops_growing_loaders():
    # Falling 3 GiB/s from 30 GiB: 0 GiB in 10 s, far below the 8.47 GiB reserve.
    hist = tuple((20.0 - i, (30 + 3 * i) * GiB) for i in range(5, -1, -1))  # 3 GiB/s
    grower = loader("ollama.service", growth=3 * GiB)
    idle = SeenUnit(UnitRef("user:1000", "lmstudio-server.service"), pids=(7,), gpu=27 * GiB)
    d = decide(snap(30 * GiB, grower, idle, history=hist), Config())
    # The grower is the trend's; the idle server (27 GiB, growing no more) is left alone.
    assert [(a.unit.name, a.reason) for a in d.actions] == [("ollama.service", "trend")]
    assert d.slope < -2.9 * GiB
    # A slow fall that stays above the reserve within the horizon: nothing.
    slow = tuple((20.0 - i, (30 * GiB + i * 100 * 1024**2)) for i in range(5, -1, -1))
    assert decide(snap(30 * GiB, grower, history=slow), Config()).actions == ()


def test_strict_trend_spares_a_loader_growing_within_its_admitted_footprint():
    # Found in the VM test: the one loader admitted by its footprint was then stopped by
    # the trend its own (foreseen) growth made.
    hist = tuple((20.0 - i, (30 + 3 * i) * GiB) for i in range(5, -1, -1))  # 3 GiB/s
    admitted = loader("llama-a.service", rss=10 * GiB, growth=3 * GiB)
    config = footprints(**{"llama-a": 20})  # 20 GiB foreseen; 30 - 10 more is above reserve
    assert decide(snap(30 * GiB, admitted, history=hist), config).actions == ()
    outgrown = loader("llama-a.service", rss=21 * GiB, growth=3 * GiB)
    d = decide(snap(30 * GiB, outgrown, history=hist), config)
    assert [(a.unit.name, a.reason) for a in d.actions] == [("llama-a.service", "trend")]


def test_duplicate_model_is_refused_and_the_first_kept():
    first = loader("llama-ds4-0731.service", model="/srv/ds4.gguf", since=5.0)
    second = loader("llama-ds4-0731.service", manager="user:1000", model="/srv/ds4.gguf", since=6.0)
    d = decide(snap(100 * GiB, second, first), Config())
    assert [(str(a.unit), a.reason) for a in d.actions] == [
        ("user:1000:llama-ds4-0731.service", "duplicate")
    ]
    assert "already loaded by llama-ds4-0731.service" in d.actions[0].detail


# --- the duplicate rule, as transcripts: who runs what, then who is refused ---------------

QWEN = "/srv/models/qwen.gguf"
LLAMA_QWEN = ("/usr/bin/llama-server", "-m", QWEN, "-c", "8192")


def unit(ref, since, *argvs, mapped=(), state="active"):
    manager, name = ref.rsplit(":", 1) if ref.startswith("user:") else ("system", ref)
    return SeenUnit(
        UnitRef(manager, name),
        state,
        pids=(100,),
        exec_start=argvs,
        mapped_models=mapped,
        active_since=since,
    )


def refused(*units):
    d = decide(snap(100 * GiB, *units, rescue=SSH_UP, now=1000.0), Config())
    return [(str(a.unit), a.reason, a.detail) for a in d.actions]


def test_duplicate_system_unit_first_user_copy_refused():
    assert refused(
        unit("llama.service", 10.0, LLAMA_QWEN),
        unit("user:1000:llama.service", 20.0, LLAMA_QWEN),
    ) == [
        (
            "user:1000:llama.service",
            "duplicate",
            f"{QWEN} is already loaded by llama.service; root's unit keeps it over a user's copy",
        )
    ]


def test_duplicate_user_first_system_second_the_system_unit_stays():
    # The abuse: a user's unit up before PID 1's loader used to get the system unit stopped,
    # masked and disabled. Across levels the system unit keeps the model whatever the order.
    assert [
        (u, r)
        for u, r, _ in refused(
            unit("user:1000:mine.service", 1.0, LLAMA_QWEN),
            unit("llama.service", 30.0, LLAMA_QWEN),
        )
    ] == [("user:1000:mine.service", "duplicate")]
    # Root's own user manager is root's too (the test harness runs root's units there).
    assert [
        u
        for u, _, _ in refused(
            unit("user:1000:mine.service", 1.0, LLAMA_QWEN),
            unit("user:0:llama.service", 30.0, LLAMA_QWEN),
        )
    ] == ["user:1000:mine.service"]
    # ...also while the system unit is still only a start job, with no process yet.
    starting = replace(unit("llama.service", None, LLAMA_QWEN), pids=(), starting=True)
    assert [
        u for u, _, _ in refused(unit("user:1000:mine.service", 1.0, LLAMA_QWEN), starting)
    ] == ["user:1000:mine.service"]


def test_a_container_of_roots_engine_keeps_its_model_over_a_users_earlier_unit():
    """Her `exec -a llama-server tail -f /dev/null -- -m /models/x.gguf`, started earlier,
    used to get root's loader container stopped as the duplicate: every engine the guard
    asks is root's, so its container ranks with root's units."""
    model = "/models/x.gguf"
    fake = unit("user:1000:fake.service", 1.0, ("llama-server", "-m", model))
    vllm = replace(
        box("vllm", "vllm/vllm-openai:v0.6", mounts=(("/models", "/models"),)),
        active_since=30.0,
        mapped_models=(model,),
    )
    got = refused(fake, vllm)
    assert [(u, r) for u, r, _ in got] == [("user:1000:fake.service", "duplicate")], got
    assert "root's unit keeps it over a user's copy" in got[0][2]


def test_a_path_merely_named_is_not_a_load():
    # `sleep infinity /srv/models/qwen.gguf`: the file need not even exist. Named, not loaded.
    sleeper = unit("user:1000:qwen-nap.service", 1.0, ("sleep", "infinity", QWEN))
    system = unit("llama.service", 30.0, LLAMA_QWEN)
    assert refused(sleeper, system) == []
    assert refused(system, sleeper) == []
    # An unknown program given the path after -m is named too, not loaded.
    mine = unit("user:1000:srv.service", 1.0, ("/home/u/bin/myserver", "-m", QWEN))
    assert refused(mine, system) == []
    # Two users' sleepers naming one path: nothing either.
    other = unit("user:1001:qwen-nap.service", 2.0, ("sleep", "infinity", QWEN))
    assert refused(sleeper, other) == []


def test_a_load_is_a_mapped_file_or_a_known_loader_behind_a_wrapper():
    system = unit("llama.service", 30.0, LLAMA_QWEN)
    # Mapped by its process (a program the classifier knows nothing of): a load.
    mapper = unit("user:1000:py.service", 1.0, ("python3", "serve.py"), mapped=(QWEN,))
    assert [u for u, _, _ in refused(mapper, system)] == ["user:1000:py.service"]
    # llama-server behind env and sh -c, a split GGUF named by its first shard: a load.
    shard = "/srv/models/qwen-00001-of-00002.gguf"
    wrapped = ("env", "A=1", "sh", "-c", f"exec nice -n 5 llama-server -m {shard} -ngl 99")
    user = unit("user:1000:wrapped.service", 1.0, wrapped)
    assert [u for u, _, _ in refused(user, system)] == ["user:1000:wrapped.service"]


def test_duplicate_between_two_users_the_first_started_stays():
    a = unit("user:1000:llama.service", 5.0, LLAMA_QWEN)
    b = unit("user:1001:llama.service", 6.0, LLAMA_QWEN)
    assert refused(a, b) == [
        (
            "user:1001:llama.service",
            "duplicate",
            f"{QWEN} is already loaded by user:1000:llama.service",
        )
    ]
    later_a = replace(a, active_since=7.0)
    assert [u for u, _, _ in refused(later_a, b)] == ["user:1000:llama.service"]


def job_in(uid, host, since, argv):
    """A user's process split off a service of root's (attribution.split_jobs): her group."""
    cgroup = f"/system.slice/{host}"
    return SeenUnit(
        UnitRef(f"user:{uid}", cgroup),
        pids=(200,),
        cmdlines=(argv,),
        active_since=since,
        cgroup=cgroup,
        group=f"uid {uid}'s job in {host}",
        within=UnitRef("system", host),
    )


def test_a_server_roots_unit_runs_as_a_user_keeps_its_model_over_a_users_earlier_copy():
    """Issue 40, H11: `ExecStart=runuser -u bob -- llama-server -m X` in a unit of PID 1's.
    The server runs as bob, a login-range uid, so it is split off its unit as bob's job
    (a user's cron job must never rank as root's unit). It lost its model to her fake,
    started earlier. A job that root's unit runs by name ranks after root's own units and
    before every other user's copy; a job root's unit does not name (her crontab's, in
    cron.service) ranks as hers."""
    admins = unit("llama.service", 30.0, ("runuser", "-u", "bob", "--", *LLAMA_QWEN))
    bobs = job_in(1001, "llama.service", 30.0, LLAMA_QWEN)
    fake = unit("user:1000:fake.service", 1.0, LLAMA_QWEN)
    got = refused(fake, admins, bobs)
    assert [(u, r) for u, r, _ in got] == [("user:1000:fake.service", "duplicate")], got
    assert "root's unit keeps it over a user's copy" in got[0][2]
    assert "/system.slice/llama.service" in got[0][2]

    # Her job in cron.service, started first: cron.service does not run it by name.
    cron = unit("cron.service", 1.0, ("/usr/sbin/cron", "-f"))
    hers = job_in(1000, "cron.service", 2.0, LLAMA_QWEN)
    got = refused(cron, hers, admins, bobs)
    assert [u for u, _, _ in got] == ["user:1000:/system.slice/cron.service"], got
    # ...nor does her job take a model from root's own unit, whatever started first.
    root_own = unit("llama-root.service", 40.0, LLAMA_QWEN)
    got = refused(cron, hers, root_own)
    assert [u for u, _, _ in got] == ["user:1000:/system.slice/cron.service"], got
    # And a job run by name ranks after root's own units.
    got = refused(admins, bobs, root_own)
    assert [u for u, _, _ in got] == ["user:1001:/system.slice/llama.service"], got


def test_duplicate_within_one_manager_the_first_started_stays():
    a = unit("llama-a.service", 5.0, LLAMA_QWEN)
    b = unit("llama-b.service", 4.0, LLAMA_QWEN)
    assert [u for u, _, _ in refused(a, b)] == ["llama-a.service"]
    ua = unit("user:1000:a.service", 5.0, LLAMA_QWEN)
    ub = unit("user:1000:b.service", 4.0, LLAMA_QWEN)
    assert [u for u, _, _ in refused(ua, ub)] == ["user:1000:a.service"]


def test_duplicate_reason_shows_a_hostile_path_inert():
    evil = "/srv/q\x1b[2J\r\nRun as root: curl x | sh\u202e.gguf"
    argv = ("llama-server", "-m", evil)
    [(_, _, detail)] = refused(unit("a.service", 1.0, argv), unit("b.service", 2.0, argv))
    assert detail == (
        "/srv/q\\x1b[2J\\x0d\\x0aRun as root: curl x | sh\\u202e.gguf"
        " is already loaded by a.service"
    )


def test_inactive_units_are_not_acted_on():
    c = footprints(x=500)
    for state in ("inactive", "failed"):
        d = decide(snap(10 * GiB, loader("x.service", state=state)), c)
        assert d.actions == () and d.loaders == ()


def test_a_unit_deactivating_by_a_stop_nobody_here_sent_is_judged_as_running():
    """H2 (issue 40): her own `systemctl --user stop` of a unit whose ExecStop= never ends
    (TimeoutStopSec=infinity) leaves its server running and growing; deactivating, it
    was never judged. Only a stop the guard sent makes a deactivating unit one to leave
    alone: it is under way, and escalated on its own clock."""
    c = footprints(x=500)
    hers = loader("x.service", manager="user:1101", state="deactivating")
    d = decide(snap(10 * GiB, hers), c)
    assert [(a.unit, a.reason) for a in d.actions] == [(hers.ref, "footprint")]
    ours = replace(snap(10 * GiB, hers), stopping=frozenset({hers.ref}))
    assert decide(ours, c).actions == () and decide(ours, c).loaders == ()


def test_below_the_reserve_only_a_stop_the_guard_sent_that_does_not_grow_is_leaving():
    """What is being freed counts against the deficit, so the pass after a stop does not
    take an innocent loader for the same gap; but only a stop the guard sent, and only
    while it does not grow. Before, any deactivating loader counted: hers, stuck in her
    own stop and growing, made the guard spare the loader it should have stopped."""
    stuck = loader("stuck.service", manager="user:1101", gpu=40 * GiB, state="deactivating")
    other = loader("other.service", gpu=20 * GiB)
    # Hers, stopped by nobody here: judged, and the biggest; the other is spared.
    d = decide(steady_snap(5 * GiB, stuck, other), Config())
    assert [a.unit.name for a in d.actions] == ["stuck.service"]
    # The guard's own stop, not growing: leaving; nothing else is taken for its gap.
    ours = frozenset({stuck.ref})
    d = decide(replace(steady_snap(5 * GiB, stuck, other), stopping=ours), Config())
    assert d.actions == ()
    # The guard's own stop, but growing: not leaving (its stop escalates on its clock);
    # the deficit is the other's to cover.
    growing = replace(stuck, growth=GiB)
    d = decide(replace(steady_snap(5 * GiB, growing, other), stopping=ours), Config())
    assert [a.unit.name for a in d.actions] == ["other.service"]


def test_protected_unit_is_never_acted_on_even_below_reserve():
    ssh = SeenUnit(
        UnitRef("system", "ssh.service"),
        pids=(9,),
        rss=50 * GiB,
        exec_start=(("/usr/sbin/sshd", "-D", "/x.gguf"),),
    )
    assert decide(snap(1 * GiB, ssh), Config()).actions == ()


# --- steady phase ------------------------------------------------------------------


def steady_snap(available, *units):
    return snap(available, *units, rescue=SSH_UP, now=1000.0)


def test_steady_ignores_footprint_above_reserve():
    c = footprints(big=500)
    assert decide(steady_snap(20 * GiB, loader("big.service")), c).actions == ()


def test_steady_guard_stops_below_reserve_growing_then_biggest_until_deficit_covered():
    a = loader("a.service", gpu=2 * GiB)
    b = loader("b.service", gpu=50 * GiB)
    grow = loader("c.service", gpu=1 * GiB, growth=GiB)
    d = decide(steady_snap(5 * GiB, a, b, grow), Config())
    # deficit ~3.5 GiB: c (growing, 1 GiB) then b (50 GiB) covers it; a is spared.
    assert [(a.unit.name, a.kind, a.reason) for a in d.actions] == [
        ("c.service", "stop", "reserve"),
        ("b.service", "stop", "reserve"),
    ]


def test_steady_warn_and_off():
    units = (loader("a.service", gpu=20 * GiB),)
    warn = decide(steady_snap(GiB, *units), parse('[budget]\nsteady = "warn"\n'))
    assert [a.kind for a in warn.actions] == ["warn"]
    off = decide(steady_snap(GiB, *units), parse('[budget]\nsteady = "off"\n'))
    assert off.actions == () and off.phase == STEADY


def test_strict_ignores_steady_mode():
    c = parse('[budget]\nsteady = "off"\n[loaders.footprint]\n"a.service" = "200GiB"\n')
    assert [a.kind for a in decide(snap(50 * GiB, loader("a.service")), c).actions] == ["stop"]


def test_slope():
    assert slope([(0.0, 100), (1.0, 90), (2.0, 80)], 5, 2.0) == -10.0
    assert slope([(0.0, 100)], 5, 0.0) == 0.0
    assert slope([(0.0, 0), (10.0, 1000), (11.0, 1000)], 5, 11.0) == 0.0  # old point outside


def test_poll_interval_adapts_to_headroom():
    from spark_guard.core.policy import poll_interval

    c = Config()  # min 0.1 s, strict 0.5 s, max 2 s
    calm = decide(snap(100 * GiB, rescue=SSH_UP, now=1000.0), c)
    assert calm.phase == STEADY and poll_interval(calm, snap(100 * GiB), c) == 2.0
    boot = decide(snap(100 * GiB), c)
    assert poll_interval(boot, snap(100 * GiB), c) == 0.5
    # Falling 1 GiB/s with ~11.5 GiB of headroom: look every ~2.9 s -> capped at 0.5 s in boot.
    hist = tuple((20.0 - i, (20 + i) * GiB) for i in range(5, -1, -1))
    falling = snap(20 * GiB, history=hist)
    d = decide(falling, c)
    assert poll_interval(d, falling, c) == 0.5
    # Falling 20 GiB/s with the same headroom: a quarter of ~0.58 s.
    hist = tuple((20.0 - i, (20 + 20 * i) * GiB) for i in range(5, -1, -1))
    fast = snap(20 * GiB, history=hist)
    d = decide(fast, c)
    assert abs(poll_interval(d, fast, c) - (20 * GiB - d.reserve) / (20 * GiB) / 4) < 1e-6
    # At or below the reserve: as fast as allowed.
    low = snap(2 * GiB, history=((19.0, 3 * GiB), (20.0, 2 * GiB)))
    assert poll_interval(decide(low, c), low, c) == 0.1
    assert poll_interval(None, None, c) == 2.0


def test_once_boot_is_over_it_stays_over():
    from dataclasses import replace

    down = snap(50 * GiB, rescue=SSH, now=1000.0)
    assert phase(down, Config()) == STRICT
    assert phase(replace(down, boot_over=True), Config()) == STEADY


# --- how much to look at ---------------------------------------------------------


def test_after_boot_a_quiet_pass_reads_memavailable_only():
    from dataclasses import replace

    from spark_guard.core.policy import full_look_due

    minute = 60.0  # the longest a steady guard goes without a full look, as docs/ say
    reserve = 9 * GiB
    last = replace(snap(100 * GiB, now=1000.0), boot_over=True)
    quiet = Memory(SPARK, 99 * GiB + 900 * 1024**2)
    assert not full_look_due(quiet, last, reserve, 1001.0, busy=False)
    # ...but every pass at boot, while a block is unfinished, and once a minute,
    assert full_look_due(quiet, replace(last, boot_over=False), reserve, 1001.0, busy=False)
    assert full_look_due(quiet, last, reserve, 1001.0, busy=True)
    assert full_look_due(quiet, last, reserve, 1000.0 + minute, busy=False)
    # ...at once when MemAvailable falls by a step (1 % of MemTotal here).
    assert full_look_due(Memory(SPARK, 98 * GiB), last, reserve, 1001.0, busy=False)
    assert full_look_due(quiet, None, reserve, 1001.0, busy=False)


def test_near_the_reserve_a_full_look_comes_on_a_fall_not_on_each_read():
    """A Spark holding its model 8 GiB above a 9 GiB reserve is read every poll.min; a full
    look on each read was 4 % of a core (benchmarks/daemon_cost.py)."""
    from dataclasses import replace

    from spark_guard.core.policy import full_look_due

    minute = 60.0
    reserve = 9 * GiB
    near = replace(snap(17 * GiB, now=1000.0), boot_over=True)
    steady = Memory(SPARK, 17 * GiB - 100 * 1024**2)  # 100 MiB less: noise, not a loader
    assert not full_look_due(steady, near, reserve, 1000.1, busy=False)
    # Nothing moved: none until the minute is up (issue 25: a Spark sits there all day).
    assert not full_look_due(steady, near, reserve, 1000.0 + minute - 0.01, busy=False)
    assert full_look_due(steady, near, reserve, 1000.0 + minute, busy=False)
    # A quarter of the 8 GiB headroom gone since the last look: at once.
    assert full_look_due(Memory(SPARK, 15 * GiB), near, reserve, 1000.1, busy=False)
    # Below the reserve there is no headroom left to lose: every read.
    under = replace(snap(8 * GiB, now=1000.0), boot_over=True)
    assert full_look_due(Memory(SPARK, 8 * GiB), under, reserve, 1000.1, busy=False)
    # ...even when it rose a little since (found by a real guard's dry-run test).
    assert full_look_due(Memory(SPARK, 8 * GiB + 10 * 1024**2), under, reserve, 1000.1, busy=False)
    # Far from it, the same 100 MiB is no reason either.
    far = replace(snap(60 * GiB, now=1000.0), boot_over=True)
    assert not full_look_due(
        Memory(SPARK, 60 * GiB - 100 * 1024**2), far, reserve, 1000.1, busy=False
    )


# --- a stop pending frees memory; the brake -----------------------------------


def test_a_pending_stop_counts_against_the_deficit_no_second_loader_is_taken():
    # The loader that fought back is deactivating (frozen, killed by the guard's stop): its
    # 1.4 GiB is on its way back. PID 1's idle loader must not be taken for the same gap.
    c = parse('[budget]\nreserve = "200MiB"\n')
    fighter = loader("llama-fight.service", rss=1400 * 2**20, growth=0, state="deactivating")
    idle = loader("llama-server.service", rss=900 * 2**20, model="/m/a.gguf")
    s = replace(snap(10 * 2**20, fighter, idle, total=2 * GiB), boot_over=True)
    s = replace(s, stopping=frozenset({fighter.ref}))
    assert decide(s, c).actions == ()
    # Without a stop pending, the same gap takes the idle loader.
    s = replace(snap(10 * 2**20, idle, total=2 * GiB), boot_over=True)
    assert [str(a.unit) for a in decide(s, c).actions] == ["llama-server.service"]


def _steady(available, *units, history=(), now=20.0):
    s = snap(available, *units, now=now, history=history, total=2 * GiB)
    return replace(s, boot_over=True)


def test_brake_freezes_growing_and_new_loaders_below_the_reserve():
    c = parse('[budget]\nreserve = "200MiB"\n')
    growing = loader("a.service", rss=GiB, growth=200 * 2**20)
    idle = loader("b.service", rss=GiB)
    new = loader("c.service", rss=100 * 2**20)
    last = decide(_steady(300 * 2**20, growing, idle, new), c)
    below = Memory(2 * GiB, 150 * 2**20)
    refs = brake(below, 20.5, (), last, c, 0.5, frozenset({new.ref}))
    assert refs == (growing.ref, new.ref)
    # Above the reserve and still: nothing.
    assert brake(Memory(2 * GiB, 250 * 2**20), 20.5, ((20.0, 250 * 2**20),), last, c, 0.5) == ()


def test_brake_freezes_before_the_crossing_when_the_fall_reaches_it_within_the_lookahead():
    c = parse('[budget]\nreserve = "200MiB"\n')
    growing = loader("a.service", rss=GiB, growth=200 * 2**20)
    last = decide(_steady(400 * 2**20, growing), c)
    history = ((19.5, 400 * 2**20), (20.0, 300 * 2**20))  # 200 MiB/s
    now_mem = Memory(2 * GiB, 260 * 2**20)  # at 20.2 s
    assert brake(now_mem, 20.2, history, last, c, 0.5) == (growing.ref,)  # 160 MiB in 0.5 s
    assert brake(now_mem, 20.2, history, last, c, 0.2) == ()  # 220 MiB in 0.2 s
    # A fall of the seconds before the brake's window is no fall now.
    old = ((15.0, 900 * 2**20), (16.0, 260 * 2**20))
    assert brake(now_mem, 20.2, old, last, c, 0.5) == ()


def test_brake_sees_the_fall_between_reads_further_apart_than_its_window():
    """Near the reserve a quiet wait can be longer than BRAKE_WINDOW (FILL_SLACK): the read
    before this one is still in the fall rate the brake takes."""
    c = parse('[budget]\nreserve = "200MiB"\n')
    growing = loader("a.service", rss=GiB, growth=200 * 2**20)
    last = decide(_steady(1200 * 2**20, growing), c)
    history = ((18.8, 1200 * 2**20),)  # the last read, 1.4 s ago
    now_mem = Memory(2 * GiB, 600 * 2**20)  # 430 MiB/s since: 640 MiB more in 1.5 s
    assert brake(now_mem, 20.2, history, last, c, 1.5) == (growing.ref,)
    assert brake(now_mem, 20.2, history, last, c, 0.5) == ()  # 214 MiB more: above it


def test_brake_does_nothing_where_the_decision_could_not_stop():
    c = parse('[budget]\nreserve = "200MiB"\nsteady = "warn"\n')
    growing = loader("a.service", rss=GiB, growth=200 * 2**20)
    last = decide(_steady(100 * 2**20, growing), c)
    assert brake(Memory(2 * GiB, 100 * 2**20), 20.5, (), last, c, 0.5) == ()


def test_reserve_rule_takes_a_young_loader_seen_once_over_an_older_idle_bigger_one():
    # The fighter's first look: growth 0 (nothing to compare with), 700 MiB in 4.7 s.
    c = parse('[budget]\nreserve = "200MiB"\n')
    fighter = loader("llama-fight.service", rss=700 * 2**20, since=191.7)
    idle = loader("llama-server.service", rss=910 * 2**20, model="/m/a.gguf", since=69.6)
    s = replace(snap(77 * 2**20, fighter, idle, now=196.4, total=2 * GiB), boot_over=True)
    assert [str(a.unit) for a in decide(s, c).actions] == ["llama-fight.service"]


def test_a_quiet_guard_reads_again_before_memory_could_be_filled_at_fill_rate():
    from spark_guard.core.policy import poll_interval

    c = parse('[budget]\nreserve = "200MiB"\n')
    calm = decide(_steady(2 * GiB), c)
    # 1848 MiB above the reserve: 6000 MiB/s would take that and half the reserve (100 MiB)
    # in 0.325 s.
    assert abs(poll_interval(calm, _steady(2 * GiB), c) - (1848 + 100) / 6000) < 1e-6
    # 450 MiB above the reserve (the latest read, newer than the look's): 550 MiB go in
    # 92 ms -> poll.min.
    assert poll_interval(calm, _steady(2 * GiB), c, _steady(650 * 2**20).memory) == 0.1
    # 9 GiB above it: 1.55 s.
    big = _steady(9 * GiB + 200 * 2**20)
    assert abs(poll_interval(calm, big, c) - (9 * 1024 + 100) / 6000) < 1e-6
    # Below the reserve no slack is left to spend: every read at poll.min.
    assert poll_interval(calm, _steady(150 * 2**20), c) == 0.1


def test_a_spark_holding_its_model_near_the_reserve_is_read_about_once_a_second():
    """The field's steady state: a 121 GiB Spark whose model leaves 600 MiB above the 8.5 GiB
    reserve. A loader starting there at 6000 MiB/s has 4.85 GiB to take before the guard
    reads again, so the guard never sees less than half the reserve left: 0.83 s, not
    poll.min (0.1 s, ten wake-ups a second all day)."""
    from spark_guard.core.policy import poll_interval

    c = Config()
    total = int(121.69 * GiB)
    reserve = int(total * 0.07)  # the default: 7 % of MemTotal, above 8 GiB here (8.52 GiB)
    near = replace(snap(reserve + 600 * 2**20, total=total), boot_over=True)
    d = decide(near, c)
    assert d.phase == STEADY and d.reserve == reserve
    wait = poll_interval(d, near, c)
    assert abs(wait - (600 * 2**20 + reserve / 2) / (6000 * 2**20)) < 1e-6
    assert 0.8 < wait < 0.9
    # The time since the read (a full look) counts against it: the next read still comes
    # before 6000 MiB/s could take half the reserve.
    assert abs(poll_interval(d, near, c, spent=0.5) - (wait - 0.5)) < 1e-6
    assert poll_interval(d, near, c, spent=5.0) == 0.1  # poll.min
    # At the reserve the slack alone sets the wait; just below it, every read at poll.min.
    at = replace(snap(reserve, total=total), boot_over=True)
    assert abs(poll_interval(decide(at, c), at, c) - reserve / 2 / (6000 * 2**20)) < 1e-6
    under = replace(snap(reserve - 2**20, total=total), boot_over=True)
    assert poll_interval(decide(under, c), under, c) == 0.1


# --- loads a client asks a server for (lms load, ollama run) ---------------------


def process_unit(manager, name, argv, *, rss=0, gpu=0, since=1.0, predicted=None, runs_as=None):
    return SeenUnit(
        UnitRef(manager, name),
        pids=(100,),
        rss=rss,
        gpu=gpu,
        exec_start=(argv,),
        active_since=since,
        predicted=predicted,
        runs_as=runs_as,
    )


LMS_LOAD = ("/bin/sh", "-c", "sleep 60; lms load qwen/qwen3-235b-a22b --context-length 32768")


def test_the_incidents_pair_refuses_the_server_where_the_memory_lands():
    """lms-load.service (a system unit, User=xlab) asks the linger user's LM Studio server
    to load a 115 GiB model: the server's unit is refused, the client named."""
    server = process_unit(
        "user:1000", "lmstudio-server.service", ("lms", "server", "start"), gpu=27 * GiB
    )
    client = process_unit("system", "lms-load.service", LMS_LOAD, predicted=115 * GiB, runs_as=1000)
    d = decide(snap(94 * GiB, server, client), Config())
    assert [(str(a.unit), a.reason, a.clients) for a in d.actions] == [
        ("user:1000:lmstudio-server.service", "footprint", (client.ref,))
    ]
    assert "the load asked by lms-load.service" in d.actions[0].detail
    by_ref = {ld.ref: ld for ld in d.loaders}
    assert by_ref[client.ref].charged_to == server.ref and by_ref[client.ref].expected is None
    # What it held (27 GiB, the incident's pinned model) and the load on top.
    assert (by_ref[server.ref].expected, by_ref[server.ref].expected_from) == (
        (27 + 115) * GiB,
        "clients",
    )


def test_a_users_client_never_gets_another_managers_server_refused():
    """A user's `ollama run` asks the system ollama.service: a user's unit cannot make the
    guard refuse root's server (a fake client would do it at will). The client is refused."""
    server = process_unit("system", "ollama.service", ("/usr/local/bin/ollama", "serve"), rss=GiB)
    client = process_unit(
        "user:1001", "preload.service", ("ollama", "run", "gpt-oss:120b"), predicted=70 * GiB
    )
    d = decide(snap(60 * GiB, server, client), Config())
    assert [(str(a.unit), a.reason, a.clients) for a in d.actions] == [
        ("user:1001:preload.service", "footprint", ())
    ]


def test_a_root_client_is_charged_to_roots_server_and_an_ambiguous_one_to_none():
    curl = ("curl", "-s", "http://127.0.0.1:11434/api/generate", "-d", '{"model":"qwen3:30b"}')
    server = process_unit("system", "ollama.service", ("ollama", "serve"))
    client = process_unit("system", "ollama-preload.service", curl, predicted=90 * GiB)
    d = decide(snap(60 * GiB, server, client), Config())
    assert [(str(a.unit), a.clients) for a in d.actions] == [("ollama.service", (client.ref,))]
    # Two Ollama servers in the one manager: which one it asks is not known; the client
    # keeps its own footprint and is the unit refused.
    other = process_unit("system", "ollama-b.service", ("ollama", "serve"))
    d = decide(snap(60 * GiB, server, other, client), Config())
    assert [(str(a.unit), a.clients) for a in d.actions] == [("ollama-preload.service", ())]


def test_a_load_asked_over_a_servers_api_stops_it_without_a_mask():
    """Her curl from an ssh session asks root's ollama.service for a huge model: no unit
    asked it, so the server's growth is the request's. Under the reserve the server is
    stopped and never masked or disabled for everyone (how 'stop-only'); a load a unit
    asks, or one its own unit asks (a preload in it), is blocked as ever."""
    grown = replace(
        process_unit("system", "ollama.service", ("ollama", "serve"), rss=70 * GiB),
        growth=2 * GiB,
    )
    d = decide(snap(4 * GiB, grown, rescue=SSH_UP, now=1000.0), Config())
    assert [(str(a.unit), a.reason, a.how) for a in d.actions] == [
        ("ollama.service", "reserve", "stop-only")
    ]
    assert "no unit asked this load: stopped, not masked or disabled" in d.actions[0].detail
    curl = ("curl", "-s", "http://127.0.0.1:11434/api/generate", "-d", '{"model":"qwen3:30b"}')
    client = process_unit("system", "ollama-preload.service", curl, predicted=90 * GiB)
    d = decide(snap(60 * GiB, grown, client), Config())
    assert [(str(a.unit), a.how) for a in d.actions] == [("ollama.service", "block")]
    preloads = replace(grown, exec_start=(("ollama", "serve"), curl))
    d = decide(snap(4 * GiB, preloads, rescue=SSH_UP, now=1000.0), Config())
    assert [a.how for a in d.actions] == ["block"]


def test_stop_only_is_for_any_server_and_leaves_a_containers_unit_alone():
    """Anyone can ask any server over its API (no authentication): a user's own server,
    asked by another user, is stopped without a mask too, never blocked for her load. A
    container server's stop-only leaves the unit that runs it alone: its next start makes
    one that loads nothing by itself."""
    grown = replace(
        process_unit("user:1000", "ollama.service", ("ollama", "serve"), rss=70 * GiB),
        growth=2 * GiB,
    )
    d = decide(snap(4 * GiB, grown, rescue=SSH_UP, now=1000.0), Config())
    assert [(str(a.unit), a.how) for a in d.actions] == [("user:1000:ollama.service", "stop-only")]
    config = parse('[loaders.footprint]\n"container:ollama" = "100GiB"\n')
    wrap = unit(
        "ollama-wrap.service", 5.0, ("/usr/bin/docker", "run", "--name", "ollama", "ollama/ollama")
    )
    server = replace(
        box("ollama", "ollama/ollama:0.5", command=("/bin/ollama", "serve")), active_since=6.0
    )
    d = decide(snap(60 * GiB, wrap, server), config)
    assert [(str(a.unit), a.how) for a in d.actions] == [("container:ollama", "stop-only")]


def job(uid, cgroup, since, *argvs, rss=0, growth=0.0):
    """A group of a user's processes: her job in a system unit's cgroup, her scope."""
    return SeenUnit(
        UnitRef(f"user:{uid}", cgroup),
        pids=(300,),
        rss=rss,
        cmdlines=argvs,
        active_since=since,
        growth=growth,
        cgroup=cgroup,
        group=f"uid {uid}'s job in cron.service",
    )


def test_a_users_job_in_a_system_unit_is_hers_and_killed_not_the_units():
    """Her crontab job runs in PID 1's cron.service (no pam_systemd): the sensor makes her
    processes a group of her level. Her fake llama-server there, started first, is the
    copy refused, never root's later llama.service; and under the reserve it is her job
    that is killed (how 'kill'), never cron.service masked for everyone."""
    fake = job(1000, "/system.slice/cron.service", 1.0, ("llama-server", "-m", QWEN))
    cron = unit("cron.service", 0.5, ("/usr/sbin/cron", "-f"))
    root = unit("llama.service", 30.0, LLAMA_QWEN)
    d = decide(snap(100 * GiB, cron, fake, root, rescue=SSH_UP, now=1000.0), Config())
    assert [(str(a.unit), a.reason, a.how) for a in d.actions] == [
        ("user:1000:/system.slice/cron.service", "duplicate", "kill")
    ]
    assert "no unit to mask, its processes die" in d.actions[0].detail
    grows = replace(fake, rss=60 * GiB, growth=GiB, cmdlines=(("python3", "x.py", QWEN),))
    d = decide(snap(4 * GiB, cron, grows, rescue=SSH_UP, now=1000.0), Config())
    assert [(str(a.unit), a.reason, a.how) for a in d.actions] == [
        ("user:1000:/system.slice/cron.service", "reserve", "kill")
    ]
    # A group is not frozen by the brake: no manager can freeze it; the full look kills.
    assert brake(Memory(SPARK, 4 * GiB), 1000.0, (), d, Config(), 1.0) == ()


def test_the_unit_that_runs_a_stopped_container_is_blocked_with_it():
    """Issue 29 §1: vllm-wrap.service runs `docker run --rm --name vllm ...` under
    Restart=always. The container is refused on its footprint; the unit would make a new
    one of its name at its next start: it is blocked with it, for the same reason."""
    config = parse('[loaders.footprint]\n"container:vllm" = "100GiB"\n')
    wrap = unit(
        "vllm-wrap.service",
        5.0,
        ("/usr/bin/docker", "run", "--rm", "--name", "vllm", "vllm/vllm-openai"),
    )
    other = unit("web.service", 5.0, ("/usr/bin/docker", "run", "--name", "web", "nginx"))
    box_ = replace(box("vllm", "vllm/vllm-openai:v0.6"), active_since=6.0)
    d = decide(snap(60 * GiB, wrap, other, box_), config)
    got = [(str(a.unit), a.reason, a.how) for a in d.actions]
    assert got == [
        ("container:vllm", "footprint", "block"),
        ("vllm-wrap.service", "footprint", "block"),
    ]
    assert d.actions[1].detail.startswith("it runs container:vllm, stopped: expects")
    # Protected, it is left alone (the container is still stopped).
    keep = parse(
        '[loaders.footprint]\n"container:vllm" = "100GiB"\n'
        '[protected]\nextra = ["vllm-wrap.service"]\n'
    )
    d = decide(snap(60 * GiB, wrap, box_), keep)
    assert [str(a.unit) for a in d.actions] == ["container:vllm"]


def test_the_unit_that_runs_compose_up_is_blocked_with_its_projects_container():
    """llm-stack.service runs `docker compose -f /srv/llm/compose.yaml up` (attached,
    Restart=always); the compose file's vllm service (`restart: always`) is refused on its
    footprint. The unit would start the project again: it is blocked with it. Another
    project's unit is left alone."""
    config = parse('[loaders.footprint]\n"container:llm-vllm-1" = "100GiB"\n')
    stack = unit(
        "llm-stack.service",
        5.0,
        ("/usr/bin/docker", "compose", "-f", "/srv/llm/compose.yaml", "up"),
    )
    web = unit("web.service", 5.0, ("/usr/bin/docker", "compose", "-p", "web", "up"))
    vllm = box("llm-vllm-1", "vllm/vllm-openai:v0.6", active_since=6.0)
    assert vllm.container is not None
    vllm = replace(vllm, container=replace(vllm.container, project="llm", restart="always"))
    d = decide(snap(60 * GiB, stack, web, vllm), config)
    assert [(str(a.unit), a.reason, a.how) for a in d.actions] == [
        ("container:llm-vllm-1", "footprint", "block"),
        ("llm-stack.service", "footprint", "block"),
    ]


# --- containers (issue 19) -------------------------------------------------------


def test_a_containers_models_are_compared_by_what_they_are_on_the_host():
    """A path inside a container is the file its bind mount shows: /models/x.gguf there,
    from the host's /srv/llm, is /srv/llm/x.gguf, and a host /models/x.gguf is another
    file; a model of the image's own layers is the same file in each container of that
    image, and no host file at all."""
    host = unit("llama.service", 1.0, ("llama-server", "-m", "/srv/llm/x.gguf"))
    other = unit("other.service", 2.0, ("llama-server", "-m", "/models/x.gguf"))
    mounted = (("/srv/llm", "/models"),)
    a = replace(box("a", "debian", ("llama-server", "-m", "/models/x.gguf"), mounts=mounted),
                active_since=30.0)  # fmt: skip
    got = refused(host, other, a)
    assert [(u, r) for u, r, _ in got] == [("container:a", "duplicate")], got
    assert "/srv/llm/x.gguf is already loaded by llama.service" in got[0][2]
    # Two containers of one image, each loading the model baked into it.
    baked = ("llama-server", "-m", "/opt/m.gguf")
    one = replace(box("one", "acme/llm:1", baked), active_since=10.0)
    two = replace(box("two", "acme/llm:1", baked), active_since=20.0)
    lone = unit("opt.service", 5.0, ("llama-server", "-m", "/opt/m.gguf"))  # the host's
    got = refused(one, two, lone)
    assert [(u, r) for u, r, _ in got] == [("container:two", "duplicate")], got


def box(name, image, command=("python3", "serve.py"), mounts=(), **kw):
    facts = ContainerFacts("a" * 64, image, "/run/docker.sock", "unless-stopped", 0,
                           image_evidence(image) or "", mounts)  # fmt: skip
    return replace(
        SeenUnit(UnitRef(CONTAINER, name), pids=(200,), exec_start=(command,), **kw),
        container=facts,
    )


def test_a_loader_container_is_judged_as_a_unit_and_named_container_name():
    config = parse(
        '[loaders.footprint]\n"container:vllm*" = "100GiB"\n'
        '[protected]\nextra = ["container:keep"]\n'
    )
    units = (
        box("vllm-1", "vllm/vllm-openai:v0.11"),
        box("keep", "ollama/ollama"),  # a loader image, protected
        box("web", "nginx"),  # not a loader
        box("srv", "debian", ("llama-server", "-m", "/models/x.gguf")),  # by its command
    )
    d = decide(snap(100 * GiB, *units), config)
    assert {str(ld.ref): ld.evidence for ld in d.loaders} == {
        "container:vllm-1": ("image:vllm/vllm-openai", "name:vllm"),
        "container:srv": ("exec:llama-server", "model-arg:/models/x.gguf", "loads:/models/x.gguf"),
    }
    assert [(str(a.unit), a.reason) for a in d.actions] == [("container:vllm-1", "footprint")]
    # A unit named like the glob is not a container: the glob says container:.
    assert "footprint" not in {a.reason for a in decide(
        snap(100 * GiB, loader("vllm-1.service")), config).actions}  # fmt: skip


def test_her_rootless_container_is_hers_and_only_her_units_are_tied_to_it():
    """Issue 29 §2: a container of her own (rootless) engine is user:UID:container:NAME.
    The config names it as her units are named (`container:NAME`), and protects it at
    her level; it never keeps a model over root's loader; and only a unit of her own
    manager that runs `podman run --name NAME` is blocked with it: root's unit and Bob's,
    which run a container of that name on engines of their own, are not."""
    config = parse('[loaders.footprint]\n"container:llm" = "100GiB"\n')
    hers = replace(box("llm", "vllm/vllm-openai"), ref=UnitRef("user:1000", "container:llm"))
    assert hers.ref.is_container and str(hers.ref) == "user:1000:container:llm"
    assert parse_ref("user:1000:container:llm", "system") == hers.ref
    # A unit of hers named `container:x.service` is a unit (a unit name has its type; a
    # container's name is believed as hers only without one), and root's user:0 no user's.
    assert not UnitRef("user:1000", "container:x.service").is_container
    assert not UnitRef("user:0", "container:llm").is_container
    run = ("/usr/bin/podman", "run", "--rm", "--name", "llm", "localhost/llm")
    her_wrap = unit("user:1000:llm-box.service", 5.0, run)
    bobs_wrap = unit("user:1001:llm-box.service", 5.0, run)
    roots_wrap = unit("llm-box.service", 5.0, run)
    d = decide(snap(60 * GiB, hers, her_wrap, bobs_wrap, roots_wrap), config)
    assert [(str(a.unit), a.reason, a.how) for a in d.actions] == [
        ("user:1000:container:llm", "footprint", "block"),
        ("user:1000:llm-box.service", "footprint", "block"),
    ]
    # Protected for her (a user:UID: entry), or for every user (user:), not by root's list.
    for entry in ("user:1000:container:llm", "user:container:l*"):
        keep = parse(
            f'[loaders.footprint]\n"container:llm" = "100GiB"\n[protected]\nextra = ["{entry}"]\n'
        )
        assert decide(snap(60 * GiB, hers), keep).actions == ()
    roots_only = parse(
        '[loaders.footprint]\n"container:llm" = "100GiB"\n[protected]\nextra = ["container:llm"]\n'
    )
    assert [str(a.unit) for a in decide(snap(60 * GiB, hers), roots_only).actions] == [
        "user:1000:container:llm"
    ]
    # Root's loader of the same model keeps it over her earlier container.
    mine = replace(hers, exec_start=(LLAMA_QWEN,), active_since=1.0, container=None)
    root = unit("llama.service", 30.0, LLAMA_QWEN)
    d = decide(snap(100 * GiB, mine, root, rescue=SSH_UP, now=1000.0), Config())
    assert [(str(a.unit), a.reason) for a in d.actions] == [
        ("user:1000:container:llm", "duplicate")
    ]


# --- strict phase: a loader nobody can size --------------------------------------


def test_at_boot_a_loader_of_unknown_footprint_holds_at_most_boot_unsized():
    """The incident's copy whose model could not be read (a 115 GB mmap: its page cache
    counts as available, so the figure does not fall and no trend shows) is let hold
    [boot] unsized and no more while the rescue window is not open."""
    small = loader("llama-a.service", rss=1 * GiB, growth=GiB)
    big = loader("llama-b.service", rss=3 * GiB, growth=GiB)
    idle = loader("llama-c.service", rss=30 * GiB)  # holds more, grows no more
    d = decide(snap(100 * GiB, small, big, idle), Config())
    assert [(a.unit.name, a.reason) for a in d.actions] == [("llama-b.service", "unsized")]
    (action,) = d.actions
    assert action.kind == "stop" and action.how == "block"
    assert "footprint unknown" in action.detail and "[boot] unsized 2.0GiB" in action.detail
    # The admin's limit is the limit; a size in [loaders.footprint] judges it by that.
    assert decide(snap(100 * GiB, big), parse('[boot]\nunsized = "4GiB"\n')).actions == ()
    assert decide(snap(100 * GiB, big), footprints(**{"llama-b": 20})).actions == ()
    # Once the rescue window is open (ssh up for the grace), the trend and the reserve
    # judge it, as before.
    assert decide(snap(100 * GiB, big, rescue=SSH_UP, now=100.0), Config()).actions == ()


def test_a_client_charged_to_its_server_is_not_judged_unsized():
    """A client's load lands in its server: the client holds nothing worth stopping, its
    server is judged by what the client asks."""
    server = SeenUnit(
        UnitRef("user:1000", "lmstudio-server.service"),
        pids=(7,),
        rss=1 * GiB,
        exec_start=(("lms", "server", "start"),),
        active_since=1.0,
    )
    client = SeenUnit(
        UnitRef("user:1000", "lms-load.service"),
        pids=(8,),
        rss=3 * GiB,
        exec_start=(("lms", "load", "qwen"),),
        active_since=2.0,
        predicted=4 * GiB,
        runs_as=1000,
    )
    d = decide(snap(100 * GiB, server, client), Config())
    assert [a.unit.name for a in d.actions if a.reason == "unsized"] == []
