"""Properties that must hold for any input, searched by hypothesis."""

from hypothesis import given, settings
from hypothesis import strategies as st

from spark_guard.core.config import Config, ConfigError, parse
from spark_guard.core.policy import decide
from spark_guard.core.snapshot import Memory, RescueGroup, SeenUnit, Snapshot, UnitRef

GiB = 1024**3

values = st.one_of(
    st.integers(-5, 2**70),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=12),
    st.lists(st.text(max_size=5), max_size=3),
)
keys = st.sampled_from(
    [
        "reserve",
        "reserve_percent",
        "steady",
        "grace",
        "min",
        "max",
        "patterns",
        "enabled",
        "dry_run",
        "proc",
        "rescue_units",
        "nope",
    ]
)
sections = st.sampled_from(
    [
        "budget",
        "boot",
        "poll",
        "loaders",
        "gpu",
        "guard",
        "paths",
        "protected",
        "loaders.footprint",
        "x",
    ]
)


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) != float("inf") else "nan"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return str(v)


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_any_text_parses_or_fails_with_a_config_error(text):
    try:
        parse(text, "f.toml")
    except ConfigError as e:  # parsing may succeed too, so pytest.raises does not fit
        assert str(e).startswith("f.toml")  # noqa: PT017


@given(st.lists(st.tuples(sections, keys, values), max_size=6))
@settings(max_examples=300, deadline=None)
def test_any_table_parses_or_names_the_key(entries):
    text = ""
    for section, key, value in entries:
        text += f"[{section}]\n{key} = {toml_value(value)}\n"
    try:
        parse(text, "f.toml")
    except ConfigError as e:  # parsing may succeed too, so pytest.raises does not fit
        assert str(e).startswith("f.toml")  # noqa: PT017


# Protected units, and a scope (only services are loaders).
NEVER_ACTED_ON = [
    "ssh.service",
    "sshd.service",
    "getty@tty1.service",
    "dbus.service",
    "spark-guard.service",
    "user@1000.service",
    "x.scope",
]
names = st.sampled_from(
    [*NEVER_ACTED_ON, "llama-a.service", "ollama.service", "worker.service", "vllm.service"]
)
units = st.builds(
    SeenUnit,
    ref=st.builds(UnitRef, st.sampled_from(["system", "user:1000"]), names),
    active_state=st.sampled_from(["active", "activating", "deactivating"]),
    pids=st.just((1,)),
    rss=st.integers(0, 200 * GiB),
    gpu=st.integers(0, 200 * GiB),
    gpu_pids=st.sampled_from([(), (1,)]),
    exec_start=st.sampled_from(
        [(), (("llama-server", "-m", "/m/a.gguf"),), (("sleep", "infinity", "/m/a.gguf"),)]
    ),
    mapped_models=st.sampled_from([(), ("/m/a.gguf",)]),
    active_since=st.one_of(st.none(), st.floats(0, 100)),
    growth=st.floats(-1e10, 1e10),
)


@given(
    available=st.integers(0, 128 * GiB),
    units=st.lists(units, max_size=8),
    history=st.lists(st.tuples(st.floats(0, 100), st.integers(0, 128 * GiB)), max_size=10),
    ssh_since=st.one_of(st.none(), st.floats(0, 100)),
    steady=st.sampled_from(["guard", "warn", "off"]),
    ours=st.sets(st.integers(0, 7)),
)
@settings(max_examples=400, deadline=None)
def test_decide_never_touches_protected_units_and_acts_only_on_live_loaders(
    available, units, history, ssh_since, steady, ours
):
    config = Config(steady=steady, footprint={"llama-*.service": 60 * GiB})
    snap = Snapshot(
        now=100.0,
        memory=Memory(121 * GiB, available),
        units=tuple(units),
        history=tuple(sorted(history)),
        rescue=(RescueGroup(("ssh.service",), True, ssh_since),),
        # The stops the guard sent: any of the units, whatever their state.
        stopping=frozenset(u.ref for i, u in enumerate(units) if i in ours),
    )
    d = decide(snap, config)
    # Deactivating by the guard's own stop: under way, never acted on again.
    live = {
        u.ref for u in units if not (u.active_state == "deactivating" and u.ref in snap.stopping)
    }
    for action in d.actions:
        # PID 1's protected names; a user's unit of the same name is hers (not a scope).
        if action.unit.manager == "system" or action.unit.name == "x.scope":
            assert action.unit.name not in NEVER_ACTED_ON
        assert action.unit in live
        assert action.kind in ("stop", "warn")
    if d.phase == "steady" and steady == "off":
        assert d.actions == ()
    if available >= d.reserve and d.phase == "steady":
        assert all(a.reason == "duplicate" for a in d.actions)
    # A user's unit never gets a system unit refused as a duplicate: only another system
    # unit that loads the same model can.
    for action in d.actions:
        if action.reason == "duplicate" and action.unit.manager == "system":
            assert "already loaded by user:" not in action.detail
