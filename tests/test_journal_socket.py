"""The guard's journal writes never wait: a journald that stops reading costs entries,
counted and said once it reads again, never the guard's threads.

A datagram socket bound here stands in for journald's /run/systemd/journal/socket,
with journald's own behaviour when it does not read: its queue fills and a
blocking sendmsg() would wait until it does.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import structlog

from spark_guard import log
from spark_guard.core.events import MESSAGE_IDS, Event, EventKind, tell
from spark_guard.journal import JournalSocket, encode
from tests.journal_wire import decode


@pytest.fixture
def journald(tmp_path):
    path = str(tmp_path / "socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    yield path, sock
    sock.close()
    structlog.reset_defaults()


def drain(sock: socket.socket) -> list[dict[str, str]]:
    out = []
    while True:
        try:
            out.append(decode(sock.recv(1 << 20)))
        except BlockingIOError:
            return out


def test_the_native_protocol_carries_newlines_and_binary_safe_lengths():
    entry = encode({"MESSAGE": "one\ntwo", "SG_UNIT": "a.service", "SKIPPED": None})
    assert decode(entry) == {"MESSAGE": "one\ntwo", "SG_UNIT": "a.service"}


def test_a_journald_that_stops_reading_never_holds_the_guard(journald):
    path, sock = journald
    assert log.configure("journal", journal_socket=path) == "journal"
    logger = log.get_logger()
    done = threading.Event()

    def flood() -> None:
        # Far more than journald's datagram queue holds (net.unix.max_dgram_qlen, 512).
        for i in range(5000):
            tell(logger, Event.of(EventKind.DECISION, "warning", msg=f"entry {i}", unit="x"))
        done.set()

    began = time.monotonic()
    threading.Thread(target=flood, daemon=True).start()
    assert done.wait(10), "a log write waited on journald"
    assert time.monotonic() - began < 10
    got = drain(sock)
    assert 0 < len(got) < 5000  # the queue filled: the rest was dropped, not waited for
    dropped = 5000 - len(got)
    # journald reads again: the next entry goes through, and the count is said once.
    tell(logger, Event.of(EventKind.DECISION, "warning", msg="after", unit="x"))
    after = drain(sock)
    assert len(after) == 2 and after[0]["MESSAGE"] == "after"
    note = after[1]
    assert note["SG_EVENT"] == "journal-dropped" and note["SG_DROPPED"] == str(dropped)
    assert note["MESSAGE_ID"] == MESSAGE_IDS[EventKind.JOURNAL_DROPPED]
    tell(logger, Event.of(EventKind.DECISION, "warning", msg="again", unit="x"))
    assert [e["SG_EVENT"] for e in drain(sock)] == ["decision"]  # said once


def test_no_journald_at_all_is_dropped_and_counted_not_raised(tmp_path):
    gone = JournalSocket(str(tmp_path / "nothing-listens-here"))
    assert gone.send({"MESSAGE": "x"}) is False
    assert gone.take_dropped() == 1 and gone.take_dropped() == 0


def test_a_field_name_never_breaks_the_framing():
    entry = encode({"SG_ODD\nKEY=x": "v", "SG_ÜBER": "w", "MESSAGE": "m"})
    assert decode(entry) == {"SG_ODD_KEY_X": "v", "SG__BER": "w", "MESSAGE": "m"}
