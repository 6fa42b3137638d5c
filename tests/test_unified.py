"""Unified memory (issue 25): the device headroom judged, room made before any stop.

Plain-data snapshots in, plain decisions and room plans out. The figures of the
field's own cases are from the public reports docs/unified-memory.md names.
"""

from dataclasses import replace

import pytest

from spark_guard.core.config import Config, parse
from spark_guard.core.policy import brake, decide
from spark_guard.core.room import RECLAIM_MIN, plan_room
from spark_guard.core.snapshot import (
    Memory,
    MemoryRule,
    RescueGroup,
    SeenUnit,
    Snapshot,
    UnitRef,
    judged,
)
from spark_guard.system.procfs import parse_buddyinfo

GiB = 1024**3
MiB = 1024**2
SPARK = int(121.69 * GiB)  # MemTotal of a stock DGX Spark
GB10 = MemoryRule(unified=True, make_room=True)
GB10_NO_ROOM = MemoryRule(unified=True, make_room=False)
DISCRETE = MemoryRule()
SSH_UP = (RescueGroup(("ssh.service",), present=True, active_since=1.0),)


def vllm(*, used=60 * GiB, growth=3 * GiB, since=100.0):
    return SeenUnit(
        UnitRef("system", "vllm.service"),
        pids=(100,),
        rss=used,
        exec_start=(("vllm", "serve", "/srv/models/glm"),),
        active_since=since,
        growth=growth,
    )


def steady(memory, rule, *units, now=1000.0):
    return Snapshot(
        now=now,
        memory=memory,
        units=units,
        rescue=SSH_UP,
        history=((now, judged(memory, rule)),),
        boot_over=True,
        rule=rule,
    )


# The field's case (vllm issue 54200): the driver logged NV_ERR_NO_MEMORY with MemAvailable
# at 22.5 GiB; MemFree was 2.5 GiB, the rest page cache, and a loader was growing.
def field_case(file_clean):
    return Memory(SPARK, int(22.5 * GiB), free=int(2.5 * GiB), file_clean=file_clean)


def test_the_fields_case_with_clean_cache_makes_room_and_stops_nothing():
    memory = field_case(file_clean=20 * GiB)
    config = Config()
    floor = config.floor_for(SPARK)
    assert 7.9 * GiB < floor < 8.1 * GiB  # the field's 8 GiB on a 121 GiB Spark
    decision = decide(steady(memory, GB10, vllm()), config)
    assert decision.actions == ()
    assert decision.headroom == int(22.5 * GiB)  # MemFree + the cache that can be dropped
    plan = plan_room(
        memory, config, GB10, loading=True, now=1000.0, last_reclaim=None, last_compact=None
    )
    assert plan is not None and plan.compact
    # Two floors' worth above MemFree: the floor, and a floor for the load to grow into.
    assert plan.reclaim == 2 * floor - memory.free
    assert "MemFree 2.5GiB under 1.5x the device floor" in plan.why


def test_the_fields_case_without_cache_to_drop_stops_the_growing_loader_on_the_device_headroom():
    # The same MemAvailable, but what is cached is dirty or tmpfs: no room can be made.
    memory = replace(field_case(file_clean=0), dirty=20 * GiB)
    decision = decide(steady(memory, GB10, vllm()), Config())
    (action,) = decision.actions
    assert (action.unit.name, action.kind, action.reason) == ("vllm.service", "stop", "reserve")
    assert action.detail.startswith("device headroom 2.5GiB is below the reserve")
    assert action.figures["mem_available"] == int(22.5 * GiB)
    assert action.figures["mem_free"] == int(2.5 * GiB)
    assert action.figures["headroom"] == int(2.5 * GiB)
    assert (
        plan_room(memory, Config(), GB10, loading=True, now=0, last_reclaim=None, last_compact=None)
        is None
    )  # nothing to drop


def test_on_a_discrete_card_nothing_changes():
    memory = field_case(file_clean=20 * GiB)
    decision = decide(steady(memory, DISCRETE, vllm()), Config())
    assert decision.actions == () and decision.headroom == memory.available
    assert decision.floor == 0
    assert (
        plan_room(
            memory, Config(), DISCRETE, loading=True, now=0, last_reclaim=None, last_compact=None
        )
        is None
    )


def test_where_no_room_can_be_made_mem_free_alone_is_judged():
    memory = field_case(file_clean=20 * GiB)
    assert judged(memory, GB10_NO_ROOM) == int(2.5 * GiB)
    (action,) = decide(steady(memory, GB10_NO_ROOM, vllm()), Config()).actions
    assert action.reason == "reserve"
    # The config says no: none is made. (A rule without make-room while reclaims free
    # little still plans: that is how they are tried again, at the backed-off pace.)
    off = parse("[memory]\nmake_room = false\n")
    assert plan(memory, config=off, rule=GB10_NO_ROOM, loading=True) is None
    assert plan(memory, rule=GB10_NO_ROOM, loading=True) is not None


def test_mapped_cache_counts_as_room_only_once_memory_reclaim_was_seen_to_work():
    # 20 GiB of clean cache, 15 GiB of it mapped (a model in use): drop_caches leaves
    # mapped pages; memory.reclaim takes them.
    memory = replace(field_case(file_clean=20 * GiB), mapped=15 * GiB)
    assert judged(memory, GB10) == int(7.5 * GiB)
    assert judged(memory, replace(GB10, reclaims_mapped=True)) == int(22.5 * GiB)
    # Backed off: asked again only after the longer wait.
    assert plan(memory, now=100.0, last_reclaim=95.0, every=8.0) is None
    assert plan(memory, now=100.0, last_reclaim=92.0, every=8.0) is not None


def test_the_headroom_is_never_above_mem_available():
    # Clean cache beyond what MemAvailable counts (its low-watermark share): MemAvailable wins.
    memory = Memory(SPARK, 30 * GiB, free=10 * GiB, file_clean=25 * GiB)
    assert judged(memory, GB10) == 30 * GiB


def test_the_strict_fit_rule_takes_the_device_headroom():
    # Boot: a 20 GiB loader, MemAvailable 40 GiB but only 10 GiB MemFree and no clean cache
    # (a tmpfs full of model copies): on a discrete card it fits, on unified memory it does not.
    config = parse('[loaders.footprint]\n"vllm.service" = "20GiB"\n')
    memory = Memory(SPARK, 40 * GiB, free=10 * GiB, file_clean=0, shmem=30 * GiB)
    boot = [RescueGroup(("ssh.service",), present=True, active_since=None)]
    unit = vllm(used=0, growth=0)
    snap = replace(steady(memory, GB10, unit), boot_over=False, rescue=tuple(boot))
    (action,) = decide(snap, config).actions
    assert action.reason == "footprint"
    assert "of device headroom" in action.detail
    assert decide(replace(snap, rule=DISCRETE), config).actions == ()


def test_the_brake_freezes_on_the_device_headroom():
    config = Config()
    memory = Memory(SPARK, 40 * GiB, free=4 * GiB, file_clean=1 * GiB)
    last = decide(steady(Memory(SPARK, 60 * GiB, free=30 * GiB), GB10, vllm()), config)
    assert brake(memory, 1000.5, (), last, config, 1.0) == (UnitRef("system", "vllm.service"),)
    discrete = replace(last, rule=DISCRETE)
    assert brake(memory, 1000.5, (), discrete, config, 1.0) == ()


def test_the_trend_is_taken_over_the_judged_figure():
    config = Config()
    unit = vllm(used=10 * GiB)
    memory = Memory(SPARK, 60 * GiB, free=12 * GiB, file_clean=0)
    # MemFree (and so the headroom) fell 2 GiB/s for 5 s; MemAvailable stayed flat.
    history = tuple((995.0 + i, (22 - 2 * i) * GiB) for i in range(6))
    snap = replace(
        steady(memory, GB10, unit),
        boot_over=False,
        history=history,
        rescue=(RescueGroup(("ssh.service",), present=True, active_since=None),),
    )
    decision = decide(snap, config)
    assert decision.slope == pytest.approx(-2 * GiB)
    (action,) = decision.actions
    assert action.reason == "trend"
    assert action.detail.startswith("device headroom falling 2.0GiB/s")


# --- when room is made ------------------------------------------------------------------


def plan(
    memory,
    *,
    loading=False,
    now=100.0,
    last_reclaim=None,
    last_compact=None,
    config=None,
    rule=GB10,
    every=None,
):
    return plan_room(
        memory,
        config or Config(),
        rule,
        loading=loading,
        now=now,
        last_reclaim=last_reclaim,
        last_compact=last_compact,
        every=every,
    )


def test_room_is_made_under_the_floor_and_only_from_clean_cache():
    floor = Config().floor_for(SPARK)
    above = Memory(SPARK, 100 * GiB, free=floor + GiB, file_clean=80 * GiB)
    assert plan(above) is None
    under = replace(above, free=floor - GiB)
    made = plan(under)
    assert made is not None and made.reclaim == floor + GiB
    # Never more than there is to drop, and nothing for a few MiB.
    little = replace(under, file_clean=3 * GiB)
    assert plan(little).reclaim == 3 * GiB
    assert plan(replace(under, file_clean=RECLAIM_MIN - 1)) is None


def test_while_a_loader_loads_room_is_made_earlier():
    floor = Config().floor_for(SPARK)
    memory = Memory(SPARK, 100 * GiB, free=int(1.2 * floor), file_clean=80 * GiB)
    assert plan(memory) is None
    assert plan(memory, loading=True) is not None


def test_reclaims_and_compactions_are_rate_limited():
    floor = Config().floor_for(SPARK)
    memory = Memory(SPARK, 100 * GiB, free=floor // 2, file_clean=80 * GiB)
    assert plan(memory, now=100.0, last_reclaim=99.5) is None  # make_room_every 1 s
    again = plan(memory, now=100.0, last_reclaim=99.0, last_compact=99.0)
    assert again is not None and again.reclaim and not again.compact  # compact: 5 s
    slow = parse('[memory]\nmake_room_every = "10s"\n')
    assert plan(memory, now=100.0, last_reclaim=95.0, config=slow) is None


def test_fragmented_free_memory_is_compacted_without_a_reclaim():
    # MemFree is fine but almost none of it in 2 MiB blocks (MiaAI-Lab issue 23: 0 of order
    # 10 on wedged nodes): the driver's 2 MiB allocations fail, compaction brings them back.
    memory = Memory(SPARK, 100 * GiB, free=40 * GiB, file_clean=50 * GiB, huge_free=GiB)
    made = plan(memory)
    assert made is not None and (made.reclaim, made.compact) == (0, True)
    assert "fragmented" in made.why
    assert plan(replace(memory, huge_free=30 * GiB)) is None
    # MemFree just above the floor and most of it in large blocks is no fragmentation (seen
    # in the VM: compactions that moved pages for nothing).
    floor = Config().floor_for(SPARK)
    near = replace(memory, free=floor + GiB, huge_free=floor - GiB // 2)
    assert plan(near) is None


def test_the_floor_is_the_admins_where_set():
    config = parse('[memory]\nfloor = "16GiB"\n')
    assert config.floor_for(SPARK) == 16 * GiB
    assert parse("[memory]\nfloor_percent = 10\n").floor_for(100 * GiB) == 10 * GiB


# --- /proc/buddyinfo ----------------------------------------------------------------------

BUDDYINFO = b"""\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1    3
Node 0, zone    DMA32      4      1      2      2      2      2      1      4      4      2    752
Node 0, zone   Normal    994    961    883   1062    690    433    263     44     37     96    425
"""


def test_buddyinfo_counts_blocks_of_2_mib_and_larger_in_every_zone():
    # 4 KiB pages: order 9 is 2 MiB, order 10 is 4 MiB.
    two, four = 2 * MiB, 4 * MiB
    expected = (1 * two + 3 * four) + (2 * two + 752 * four) + (96 * two + 425 * four)
    assert parse_buddyinfo(BUDDYINFO, 4096) == expected
    # 64 KiB pages (an arm64 kernel built so): 2 MiB is order 5.
    line = b"Node 0, zone   Normal   0 0 0 0 0 7 1\n"
    assert parse_buddyinfo(line, 65536) == 7 * 2 * MiB + 1 * 4 * MiB
    assert parse_buddyinfo(b"", 4096) == 0


def test_without_make_room_the_models_page_cache_counts_in_the_strict_fit():
    # A 30 GiB GGUF (estimate 34 GiB) at boot with 60 GiB of headroom: it fits when the guard
    # drops the cache its read fills; without make-room that cache takes MemFree too.
    memory = Memory(SPARK, 60 * GiB, free=60 * GiB, file_clean=0)
    unit = replace(vllm(used=0, growth=0), predicted=34 * GiB, page_cache=30 * GiB)
    boot = (RescueGroup(("ssh.service",), present=True, active_since=None),)
    snap = replace(steady(memory, GB10, unit), boot_over=False, rescue=boot)
    assert decide(snap, Config()).actions == ()
    (action,) = decide(replace(snap, rule=GB10_NO_ROOM), Config()).actions
    assert action.reason == "footprint" and action.figures["expected"] == 64 * GiB
    assert decide(replace(snap, rule=DISCRETE), Config()).actions == ()


def test_reclaims_that_free_little_back_off_and_stop_counting_the_cache_as_room():
    from spark_guard.core.room import BACKOFF_MAX, Pace, paced

    base = Config().make_room_every
    pace = Pace(base)
    asked = 4 * GiB
    # A reclaim that freed its quarter keeps the pace.
    assert paced(pace, asked, GiB, base) == Pace(base)
    # One that freed almost nothing doubles the wait; the second stops the cache counting.
    once = paced(pace, asked, 10 * MiB, base)
    assert (once.every, once.counts) == (2 * base, True)
    twice = paced(once, asked, 0, base)
    assert (twice.every, twice.counts) == (4 * base, False)
    slowest = twice
    for _ in range(10):
        slowest = paced(slowest, asked, 0, base)
    assert slowest.every == BACKOFF_MAX
    # One that frees again is back at once.
    assert paced(slowest, asked, 2 * GiB, base) == Pace(base)
    # A small ask is judged against what it asked, not against a quarter of 4 GiB.
    assert paced(pace, 100 * MiB, 30 * MiB, base) == Pace(base)


def test_audit_says_what_a_gpu_allocation_can_get_and_what_to_do():
    from spark_guard.tools.audit import unified_findings

    floor = Config().floor_for(SPARK)
    low = Memory(SPARK, 40 * GiB, free=2 * GiB, file_clean=30 * GiB, huge_free=GiB)
    (finding,) = unified_findings(low, GB10, Config())
    assert finding.code == "memfree-low" and finding.unit == ""
    assert "MemFree 2.0GiB is under the device floor" in finding.message
    assert "--make-room" in finding.fix
    fragmented = replace(low, free=floor + 4 * GiB, huge_free=GiB)
    assert [f.code for f in unified_findings(fragmented, GB10, Config())] == ["fragmented"]
    codes = [f.code for f in unified_findings(fragmented, GB10_NO_ROOM, Config())]
    assert codes == ["fragmented", "no-make-room"]
    assert unified_findings(low, DISCRETE, Config()) == []


def test_memfree_nearing_the_floor_is_read_before_a_flood_could_take_half_the_floor():
    """make-room watches MemFree, not the headroom: with 60 GiB of cache to drop the
    headroom is far above the reserve, but a page-cache flood at FILL_RATE takes MemFree
    past the floor in a second. The guard reads again before it could take half the floor."""
    from spark_guard.core.policy import poll_interval

    c = Config()
    probe = decide(steady(Memory(SPARK, 80 * GiB, free=40 * GiB), GB10), c)
    floor = probe.floor
    assert floor > GiB
    near = Memory(SPARK, 80 * GiB, free=floor + GiB, file_clean=60 * GiB)
    s = steady(near, GB10)
    d = decide(s, c)
    assert d.headroom > 40 * GiB
    assert abs(poll_interval(d, s, c) - (GiB + floor / 2) / (6000 * MiB)) < 1e-6
    # Under the floor: poll.min (make-room is due); a discrete card has no floor: poll.max.
    under = steady(replace(near, free=floor - MiB), GB10)
    assert poll_interval(decide(under, c), under, c) == 0.1  # poll.min
    discrete = steady(near, DISCRETE)
    assert poll_interval(decide(discrete, c), discrete, c) == 2.0  # poll.max
    # With make-room off nothing makes room: MemFree is the judged figure itself, read as
    # the reserve asks (it is 1 GiB above the floor, about 0.5 GiB above the reserve).
    off = parse("[memory]\nmake_room = false\n")
    no_room = steady(near, GB10_NO_ROOM)
    d = decide(no_room, off)
    wait = (floor + GiB - d.reserve / 2) / (6000 * MiB)  # near.free
    assert abs(poll_interval(d, no_room, off) - wait) < 1e-6


def test_harden_writes_make_room_for_a_system_loader_on_unified_memory_where_allowed():
    from spark_guard.tools.harden import MAKE_ROOM, drop_in, makes_room

    c = Config()
    off = parse("[memory]\nmake_room = false\n")
    assert makes_room("system", c, unified=True)
    assert not makes_room("system", c, unified=False)  # a discrete card: the cache is no GPU's
    assert not makes_room("user:1000", c, unified=True)  # as root only; the guard makes hers
    assert not makes_room("system", off, unified=True)  # the admin said no
    text = drop_in("llama.service", c, GiB, "why", "2026-12-02", make_room=True)
    assert MAKE_ROOM in text.splitlines()
    assert MAKE_ROOM not in drop_in("llama.service", off, GiB, "why", "2026-12-02")
