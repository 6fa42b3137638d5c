"""Records on disk, the login note, and choosing what to release: plain files, no systemd."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from spark_guard import log
from spark_guard.block import banner
from spark_guard.block.blocker import Blocker
from spark_guard.block.records import LinkRecord, Record, RecordError, RecordStore
from spark_guard.block.release import ReleaseError, select
from spark_guard.core.config import Config


def record(manager: str = "system", unit: str = "llama.service", **kw: object) -> Record:
    r = Record(
        unit=unit,
        manager=manager,
        reason="footprint",
        detail="expects 115GiB",
        phase="strict",
        figures={"expected": 115 * 2**30},
        at="2026-11-30T08:00:00Z",
    )
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_a_record_survives_the_round_trip_and_replacing_it_is_atomic(tmp_path):
    store = RecordStore(str(tmp_path))
    r = record(
        step="blocked", links=[LinkRecord("/etc/x.wants/llama.service", "/etc/l", 0, 0, True)]
    )
    r.note("stop requested")
    store.save(r)
    store.save(r)  # replaced, not appended: no temporary file is left behind
    assert sorted(os.listdir(store.blocked)) == ["llama.service.json"]
    (back,), errors = store.all()
    assert not errors and back == r
    assert store.load(r.ref) == r


def test_a_user_record_is_named_by_its_manager(tmp_path):
    store = RecordStore(str(tmp_path))
    r = record(manager="user:1000")
    store.save(r)
    assert os.listdir(store.blocked) == ["user:1000:llama.service.json"]
    loaded = store.load(r.ref)
    assert loaded is not None and loaded.uid == 1000


def test_a_corrupt_record_is_named_kept_and_the_others_still_read(tmp_path):
    store = RecordStore(str(tmp_path))
    store.save(record(unit="good.service"))
    bad = os.path.join(store.blocked, "bad.service.json")
    with open(bad, "w") as f:
        f.write('{"format": 1, "unit": "bad.service"')
    records, errors = store.all()
    assert [r.unit for r in records] == ["good.service"]
    (error,) = errors
    assert str(error).startswith(f"{bad}: unreadable record: ")
    assert os.path.exists(bad)  # never deleted: an admin may need it


def test_the_guard_reports_a_corrupt_record_once_and_goes_on(tmp_path):
    config = Config(
        state=str(tmp_path / "state"), motd=str(tmp_path / "motd"), issue=str(tmp_path / "issue")
    )
    store = RecordStore(config.state)
    store.save(record())
    with open(os.path.join(store.blocked, "bad.service.json"), "w") as f:
        f.write("not json")
    log.configure("console")
    blocker = Blocker({}, config, log.get_logger())
    with capture_logs() as events:
        blocker.advance()
        blocker.advance()
    unreadable = [e for e in events if e["event"] == "record-unreadable"]
    assert len(unreadable) == 1 and "bad.service.json: unreadable record" in unreadable[0]["msg"]
    assert list(blocker.records) == ["llama.service"]
    assert "llama.service  blocking (stop)" in (tmp_path / "motd").read_text()


def test_a_record_from_another_format_is_refused():
    with pytest.raises(RecordError, match=r"x\.json: unreadable record: not a format 1 record"):
        Record.from_json('{"format": 2}', "x.json")


def test_a_record_whose_manager_is_no_manager_key_is_refused():
    # Every reader (metrics labels, the owner's rights, release) turns the key into a uid.
    good = record("user:1000", "x.service").to_json()
    for bad in ("user:xyz", "user:", "root"):
        with pytest.raises(RecordError, match=r"r\.json: unreadable record: bad manager"):
            Record.from_json(good.replace('"user:1000"', f'"{bad}"'), "r.json")
    assert Record.from_json(good, "r.json").uid == 1000


def test_release_picks_units_by_full_name_bare_name_or_ref(tmp_path):
    store = RecordStore(str(tmp_path))
    records = [record(), record(manager="user:1000"), record(unit="qwen.service")]
    assert [str(r.ref) for r in select(records, ["qwen"], store)] == ["qwen.service"]
    assert [str(r.ref) for r in select(records, ["user:1000:llama.service"], store)] == [
        "user:1000:llama.service"
    ]
    assert [str(r.ref) for r in select(records, ["llama.service"], store)] == ["llama.service"]
    with pytest.raises(ReleaseError, match=r"^nope: not blocked by spark-guard \(no record in "):
        select(records, ["nope"], store)
    only_user = [record(manager="user:1000"), record(manager="user:1001")]
    with pytest.raises(
        ReleaseError,
        match=r"more than one manager \(user:1000:llama.service, "
        r"user:1001:llama.service\); name one",
    ):
        select(only_user, ["llama"], store)


def test_the_login_note_says_what_why_and_how_to_undo_and_goes_when_empty(tmp_path):
    motd, issue = str(tmp_path / "motd.d" / "spark-guard"), str(tmp_path / "issue")
    blocked = [
        record(step="blocked", unit="llama\\x2dds4.service"),
        record(manager="user:1000", step="settle", problem="still running"),
    ]
    banner.publish(blocked, motd, issue)
    text = Path(motd).read_text()
    assert "  llama\\x2dds4.service  blocked since 2026-11-30T08:00:00Z: footprint: " in text
    assert "  user:1000:llama.service  blocking (settle) since" in text
    assert "      problem: still running" in text
    assert "spark-guard release UNIT" in text
    # agetty reads backslash escapes: the issue copy has them doubled.
    assert "llama\\\\x2dds4.service" in Path(issue).read_text()
    banner.publish([], motd, issue)
    assert not os.path.exists(motd) and not os.path.exists(issue)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.update(unit=["llama.service"]), "unit: list, not str"),
        (lambda d: d.update(mask_made="yes"), "mask_made: str, not bool"),
        (
            lambda d: d.update(links=[{"path": 1, "target": "/x", "uid": 0, "gid": 0}]),
            "links[0].path: int, not str",
        ),
        (lambda d: d.update(links={"path": "/x"}), "links: dict, not list"),
        (lambda d: d.update(history=[["t"]]), "history[0]: 1 items, not 2"),
        (lambda d: d.update(figures={"expected": "115GiB"}), "figures.expected: str"),
        (lambda d: d.update(figures={"expected": True}), "figures.expected: bool"),
        (lambda d: d.update(clients=[None]), "clients[0]: NoneType, not str"),
        (lambda d: d.update(container=[]), "container: list, not an object"),
        (lambda d: d.pop("reason"), "no reason"),
        (lambda d: d.update(stopping={"sent": "soon"}), "stopping.sent: str, not float"),
        (lambda d: d.update(stopping={"sent": 1, "stage": 7}), "stopping.stage: 7 is not a Stage"),
        (lambda d: d.update(stopping={"sent": 1, "when": 2}), "stopping: no field 'when'"),
        (lambda d: d.update(step="stopped"), "step: 'stopped' is not a Step"),
    ],
)
def test_a_record_with_a_field_of_the_wrong_type_is_named_not_raised(tmp_path, edit, named):
    """A hand edit or a corruption that stays valid JSON: one RecordError naming the file
    and the field, and the other records still read (never a TypeError in a pass)."""
    import json

    store = RecordStore(str(tmp_path))
    store.save(record(unit="good.service"))
    data = json.loads(record(unit="bad.service", links=[LinkRecord("/l", "/t", 0, 0)]).to_json())
    edit(data)
    bad = os.path.join(store.blocked, "bad.service.json")
    Path(bad).write_text(json.dumps(data))
    records, errors = store.all()
    assert [r.unit for r in records] == ["good.service"]
    (error,) = errors
    assert str(error).startswith(f"{bad}: unreadable record: ") and named in str(error)


def test_fields_of_a_newer_version_are_kept_and_written_back():
    import json

    data = json.loads(record().to_json())
    data["undo_hint"] = {"from": "a later spark-guard"}
    back = Record.from_json(json.dumps(data), "r.json")
    assert back.unit == "llama.service"
    assert json.loads(back.to_json())["undo_hint"] == {"from": "a later spark-guard"}
    assert back.to_json() == Record.from_json(back.to_json(), "r.json").to_json()


def test_two_releases_in_one_second_keep_both_archives(tmp_path):
    store = RecordStore(str(tmp_path))
    first = store.archive(record())
    second = store.archive(record(detail="released again"))
    assert first != second and second.endswith("-2.json")
    assert Record.from_json(Path(first).read_text(), first).detail == "expects 115GiB"
    assert Record.from_json(Path(second).read_text(), second).detail == "released again"


def test_what_a_dead_writer_left_is_swept_once_it_is_a_minute_old(tmp_path):
    """A kill between a write and its rename leaves a temporary file; a release killed
    between the record's removal and its mark's leaves the mark. The sweep takes both,
    and leaves a young temporary file (a live writer's) and everything else."""
    store = RecordStore(str(tmp_path))
    store.save(record())
    blocked = Path(store.blocked)
    dead = blocked / ".system:llama.service.json.0123456789ab.tmp"
    young = blocked / ".system:other.service.json.ba9876543210.tmp"
    orphan = blocked / "system:gone.service.json.releasing"
    fresh_mark = Path(store.path_of(record().ref) + ".releasing")
    note = tmp_path / "notes.txt"  # not the store's: never touched
    for p in (dead, young, orphan, fresh_mark, note):
        p.write_text("")
    os.utime(dead, (0, 0))
    os.utime(note, (0, 0))
    assert sorted(store.sweep()) == sorted([str(dead), str(orphan)])
    assert young.exists() and fresh_mark.exists() and note.exists()
    assert store.load(record().ref) is not None
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "motd").write_text("note")
    left = etc / ".motd.00000000abcd.tmp"
    theirs = etc / ".motd.backup.tmp"  # not a name the guard writes
    for p in (left, theirs):
        p.write_text("")
        os.utime(p, (0, 0))
    assert banner.sweep(str(etc / "motd"), str(etc / "issue")) == [str(left)]
    assert theirs.exists() and (etc / "motd").read_text() == "note"


def test_releasing_one_of_a_server_and_its_client_names_the_other():
    """A server blocked for a client's load keeps the client in its record; where the
    client is blocked too (its own rule), each is released on its own, and the release
    of one names the other still blocked, with the command that releases it."""
    from spark_guard.tools.release_cli import _same_load

    server = record("user:1000", "ollama.service", clients=["user:1000:preload.service"])
    client = record("user:1000", "preload.service")
    other = record("system", "llama.service")
    assert _same_load([server], [client, other]) == [
        "user:1000:preload.service asked the load user:1000:ollama.service was blocked for, "
        "and is still blocked: spark-guard release user:1000:preload.service"
    ]
    assert _same_load([client], [server, other]) == [
        "user:1000:ollama.service, blocked for the load user:1000:preload.service asked, is "
        "still blocked: spark-guard release user:1000:ollama.service"
    ]
    assert _same_load([server, client], [other]) == []


def test_her_thousand_blocks_are_a_few_lines_of_the_login_note_not_a_thousand(tmp_path):
    """Issue 40, H8: 200 duplicate units of hers made 199 records and a 203-line note at
    every ssh login and on the console, and 10,000 a 10,000-line one. A manager shows
    ROWS_PER_MANAGER rows and the note ROWS in all; the rest is counted, and root's own
    blocks are never pushed out by hers."""
    motd, issue = str(tmp_path / "motd"), str(tmp_path / "issue")
    hers = [record(manager="user:1101", unit=f"llama-{i}.service") for i in range(10_000)]
    others = [record(manager=f"user:{1200 + i}", unit="x.service") for i in range(40)]
    banner.publish([*hers, record(unit="llama-root.service"), *others], motd, issue)
    text = Path(motd).read_text()
    lines = text.splitlines()
    assert len(lines) <= banner.ROWS + 6, len(lines)
    assert "  llama-root.service  blocking (stop) since" in text
    assert sum("user:1101:" in ln for ln in lines) == banner.ROWS_PER_MANAGER
    shown = sum(" since 2026-11-30T08:00:00Z: " in ln for ln in lines)
    assert shown == banner.ROWS
    assert (
        f"  ... and {10_041 - shown} more (spark-guard release --all --dry-run lists them; " in text
    )
    assert "in all: user:1101 10000)" in text
    assert "spark-guard release UNIT" in text
