"""Events reach a real systemd-journald as fields an admin can filter on.

journald runs inside a private mount namespace with tmpfs over its runtime
and storage directories, so the host's logs are never touched. The guard
runs with its stderr on a journal stream and JOURNAL_STREAM set the way
systemd sets it, so its automatic choice of the journal is tested too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_guard.core.events import MESSAGE_IDS, EventKind

pytestmark = pytest.mark.journald

SRC = Path(__file__).parent.parent / "src" / "spark_guard"

DECISION = """
from spark_guard import log
from spark_guard.core.events import tell
from spark_guard.core.config import Config
from spark_guard.core.snapshot import Action, Decision, UnitRef
from spark_guard.core.step import GuardState, take
log.configure("journal")
a = Action("stop", UnitRef("user:1000", "llama-ds4-0731.service"), "footprint",
           "expects 115.0GiB", {"mem_available": 110 * 2**30, "reserve": 9094593249})
decision = Decision("strict", 9094593249, (), (a,))
_, events, _, _ = take(GuardState(), decision, 0.0, Config(), dry_run=True)
tell(log.get_logger(), *events)
"""

# A journald of its own in a private mount namespace (never the host's); $JPID is its pid.
JOURNALD_UP = """
set -e
mount -t tmpfs tmpfs /run/systemd
mount -t tmpfs tmpfs /run/log
mkdir -p /var/log/journal && mount -t tmpfs tmpfs /var/log/journal
/lib/systemd/systemd-journald >/dev/null 2>&1 &
JPID=$!
for i in $(seq 200); do [ -S /run/systemd/journal/socket ] && break; sleep 0.05; done
"""

SCRIPT = (
    JOURNALD_UP
    + """
printf '[boot]\\ngrace = "1h"\\n[paths]\\nruntime = "%s/run"\\nstate = "%s/state"\\n' \\
  "$WORK" "$WORK" > "$WORK/guard.toml"
# As systemd starts a service: stderr on a journal stream, JOURNAL_STREAM=dev:ino of it.
systemd-cat -t spark-guard-stream sh -c \
  'export JOURNAL_STREAM=$(stat -L -c %d:%i /proc/$$/fd/2);
   exec timeout -s TERM 3 "$PY" -m spark_guard run --dry-run --config "$WORK/guard.toml"' || true
"$PY" -c "$DECISION"
journalctl --sync 2>/dev/null || sleep 0.5
journalctl --no-pager -o json SYSLOG_IDENTIFIER=spark-guard > "$WORK/entries.json"
journalctl --no-pager -o json SYSLOG_IDENTIFIER=spark-guard-stream > "$WORK/stream.json"
kill $JPID
"""
)


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    work = tmp_path_factory.mktemp("journal")
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "PY": sys.executable,
        "WORK": str(work),
        "DECISION": DECISION,
    }
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", SCRIPT],
        env=env,
        check=True,
        timeout=60,
    )
    rows = [json.loads(line) for line in (work / "entries.json").read_text().splitlines()]
    stream = (work / "stream.json").read_text()
    return rows, stream


def by_event(rows, event):
    found = [r for r in rows if r.get("SG_EVENT") == event]
    assert found, f"no {event} entry in {[r.get('SG_EVENT') for r in rows]}"
    return found[0]


def test_guard_chooses_the_journal_under_systemd_and_prints_nothing_to_the_stream(entries):
    rows, stream = entries
    started = by_event(rows, "guard-started")
    # No manager answers in this namespace: the start says so, not only "watching".
    assert started["MESSAGE"] == (
        "spark-guard watching (dry run: deciding, not acting); no systemd manager reached "
        "yet: no unit can be seen or stopped until one answers (systemd not PID 1, or no "
        "right to its private socket)"
    )
    assert started["PRIORITY"] == "6"
    assert started["MESSAGE_ID"] == MESSAGE_IDS[EventKind.GUARD_STARTED]
    assert started["SG_DRY_RUN"] == "True"
    assert stream.strip() == ""  # no duplicate key=value copy on stderr
    by_event(rows, "guard-stopping")


def test_code_location_is_the_real_caller(entries):
    rows, _ = entries
    started = by_event(rows, "guard-started")
    assert started["CODE_FILE"].endswith("spark_guard/daemon.py")
    lines = (SRC / "daemon.py").read_text().splitlines()
    at = int(started["CODE_LINE"]) - 1  # the line of the call that builds the event
    assert "Event" in lines[at] and "EventKind.GUARD_STARTED" in " ".join(lines[at : at + 2])
    assert started["CODE_FUNC"] == "_pass"  # a pass of the loop
    # Built by the GPU reader and relayed by the sensor: the journal names the reader.
    gpu = by_event(rows, "gpu-accounting-off")
    assert gpu["CODE_FILE"].endswith("spark_guard/system/gpu.py")
    assert gpu["PRIORITY"] == "4"  # warning


def test_decision_fields_are_filterable(entries):
    rows, _ = entries
    decision = by_event(rows, "decision")
    assert decision["MESSAGE"] == "stop user:1000:llama-ds4-0731.service: expects 115.0GiB"
    assert decision["MESSAGE_ID"] == MESSAGE_IDS[EventKind.DECISION]
    assert decision["PRIORITY"] == "4"
    assert decision["SG_UNIT"] == "user:1000:llama-ds4-0731.service"
    assert decision["SG_MANAGER"] == "user:1000"
    assert decision["SG_REASON"] == "footprint"
    assert decision["SG_MEM_AVAILABLE"] == str(110 * 2**30)
    assert decision["CODE_FILE"].endswith("spark_guard/core/step.py")  # built there, told by act
    dry = by_event(rows, "dry-run")
    assert dry["SG_UNIT"] == "user:1000:llama-ds4-0731.service"


@pytest.mark.systemd
def test_unit_blocked_carries_the_figures_of_the_decision():
    """README: `journalctl SG_EVENT=unit-blocked` has SG_UNIT, SG_REASON, SG_MEM_AVAILABLE, ...
    A real block, by the guard as a unit of a user manager whose journald is its own."""
    from lab.guardunit import GUARD, PY, loader_unit, write_config
    from lab.harness import UserManager

    with UserManager(journald=True) as um:
        write_config(um, '[loaders.footprint]\n"llama-journal.service" = "100TiB"\n')
        um.write_unit("rescue-ssh.service", "[Service]\nExecStart=/bin/sleep infinity\n")
        um.write_unit(
            GUARD,
            f"[Service]\nType=notify\nNotifyAccess=main\n"
            f"ExecStart={PY} -m spark_guard run --config {um.base}/guard.toml\n",
        )
        loader_unit(um, "llama-journal.service", 20)
        um.systemctl("start", "llama-journal.service")
        um.systemctl("start", GUARD)
        deadline = time.monotonic() + 30
        rows: list[dict[str, str]] = []
        while not rows:
            assert time.monotonic() < deadline, um.log.read_text()[-3000:]
            time.sleep(0.3)
            query = ["--directory", str(um.journal_dir), "-o", "json", "SG_EVENT=unit-blocked"]
            out = subprocess.run(
                ["journalctl", "--no-pager", *query],
                capture_output=True,
                text=True,
                timeout=30,
            )
            rows = [json.loads(line) for line in out.stdout.splitlines()]
        um.systemctl("stop", GUARD)
        figures = json.loads(
            (um.base / "state" / "blocked" / "user:0:llama-journal.service.json").read_text()
        )["figures"]
    blocked = rows[0]
    assert blocked["MESSAGE_ID"] == MESSAGE_IDS[EventKind.UNIT_BLOCKED]
    assert blocked["SG_UNIT"] == "user:0:llama-journal.service"
    assert blocked["SG_REASON"] == "footprint"
    assert int(blocked["SG_MEM_AVAILABLE"]) == figures["mem_available"] > 0
    assert int(blocked["SG_RESERVE"]) == figures["reserve"]
    assert int(blocked["SG_EXPECTED"]) == 100 * 1024**4


FLOOD = """
import json, os, sys, time
from spark_guard import log
from spark_guard.core.events import Event, EventKind, tell
assert log.configure("journal") == "journal"
logger = log.get_logger()
began = time.monotonic()
for i in range(5000):
    tell(logger, Event.of(EventKind.DECISION, "warning", msg=f"entry {i}", unit="x"))
took = time.monotonic() - began
os.kill(int(sys.argv[1]), 18)  # SIGCONT: journald reads again
time.sleep(1.0)
tell(logger, Event.of(EventKind.DECISION, "warning", msg="after", unit="x"))
print(json.dumps({"took": took}))
"""

STOPPED = (
    JOURNALD_UP
    + """
kill -STOP $JPID
"$PY" -c "$FLOOD" $JPID > "$WORK/flood.json"
journalctl --sync 2>/dev/null || sleep 0.5
journalctl --no-pager -o json SYSLOG_IDENTIFIER=spark-guard > "$WORK/entries.json"
kill $JPID
"""
)


@pytest.mark.journald
def test_a_stopped_journald_holds_no_write_and_the_loss_is_said_once_it_reads(tmp_path):
    """The real journald, stopped (SIGSTOP) as under memory pressure: 5000 entries, far more
    than its socket queues, go out without waiting; once it reads again the next entry gets
    through, with one journal-dropped entry counting what was lost."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PY": sys.executable, "WORK": str(tmp_path)}
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", STOPPED],
        env=env | {"FLOOD": FLOOD},
        check=True,
        timeout=120,
    )
    took = json.loads((tmp_path / "flood.json").read_text())["took"]
    assert took < 10, f"the writes waited on journald: {took:.1f}s"
    rows = [json.loads(line) for line in (tmp_path / "entries.json").read_text().splitlines()]
    messages = [r.get("MESSAGE") for r in rows]
    assert "after" in messages
    kept = sum(1 for m in messages if isinstance(m, str) and m.startswith("entry "))
    assert 0 < kept < 5000  # its queue took some; the rest was dropped, not waited for
    dropped = [r for r in rows if r.get("SG_EVENT") == "journal-dropped"]
    assert len(dropped) == 1, dropped
    assert int(dropped[0]["SG_DROPPED"]) == 5000 - kept
    assert dropped[0]["MESSAGE_ID"] == MESSAGE_IDS[EventKind.JOURNAL_DROPPED]
