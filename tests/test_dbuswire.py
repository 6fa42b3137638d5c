"""A user's unit properties, read bounded: dbuswire against a real systemd --user.

pystemd reads a reply whole with the GIL held; a user's unit with 60
Environment= lines of 1 MB each cost the guard 134 MiB and half a second (and
systemd 3.7 s to send). Here the reply's header is read first, a reply over the
cap is refused unread, the whole call has a deadline, and only the variables
foresight reads are kept.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from lab.harness import UserManager
from spark_guard.core.argv.environment import KEPT_MAX, needed
from spark_guard.system import dbuswire
from spark_guard.system.managers import (
    DETAILS_CAP,
    DETAILS_TIMEOUT,
    ManagerError,
    ManagerSilent,
    connect_to,
)


def test_only_what_foresight_reads_is_kept():
    env = [
        "LLAMA_ARG_CTX_SIZE=8192",
        "OLLAMA_MODELS=/srv/ollama",
        "HOME=/home/a",
        "MODEL_ID=meta/llama",
        "MY_MODEL=/m/x.gguf",
        "PAD=" + "x" * 100,
        "LLAMA_ARG_MODEL=" + "y" * 10_000,  # no setting is that long
        "noequals",
    ]
    assert needed(env, [("llama-server", "-m", "${MY_MODEL}")]) == (
        "LLAMA_ARG_CTX_SIZE=8192",
        "OLLAMA_MODELS=/srv/ollama",
        "HOME=/home/a",
        "MODEL_ID=meta/llama",
        "MY_MODEL=/m/x.gguf",
    )
    assert "MY_MODEL=/m/x.gguf" not in needed(env, [("llama-server", "-m", "/m/x.gguf")])
    # Any number of wanted names: the last KEPT_MAX, as the last assignment wins.
    padded = [f"LLAMA_ARG_X{i}=1" for i in range(10_000)] + ["LLAMA_ARG_CTX_SIZE=131072"]
    kept = needed(padded)
    assert len(kept) == KEPT_MAX and kept[-1] == "LLAMA_ARG_CTX_SIZE=131072"


def test_a_malformed_reply_is_one_error_not_a_crash():
    body = struct.pack("<I", 1 << 30) + b"abc"  # a string that claims a gigabyte
    with pytest.raises(dbuswire.WireError, match="ends inside a value"):
        dbuswire.unmarshal("s", body, "<")
    with pytest.raises(dbuswire.WireError, match="array runs past"):
        dbuswire.unmarshal("as", struct.pack("<I", 1 << 20), "<")
    nested = "a" * 40 + "s"
    with pytest.raises(dbuswire.WireError, match="nested too deep"):
        dbuswire.unmarshal(nested, struct.pack("<I", 4) * 41, "<")


def reply(body: bytes, signature: bytes, *, serial: int = 1, sig_type: bytes = b"g") -> bytes:
    """A method return to call `serial`, its header's SIGNATURE field of type `sig_type`
    (a peer may send any type there), as a hostile peer would write it."""
    fields = bytearray()
    fields += bytes([dbuswire.F_REPLY_SERIAL, 1]) + b"u\0" + struct.pack("<I", serial)
    fields += b"\0" * (-len(fields) % 8)
    fields += bytes([dbuswire.F_SIGNATURE, len(sig_type)]) + sig_type + b"\0"
    if sig_type == b"g":
        fields += bytes([len(signature)]) + signature + b"\0"
    else:
        fields += b"\0" * (-len(fields) % 4) + struct.pack("<I", len(signature)) + signature + b"\0"
    head = b"l" + bytes([dbuswire.METHOD_RETURN, 0, 1])
    head += struct.pack("<III", len(body), 2, len(fields)) + bytes(fields)
    head += b"\0" * (-len(head) % 8)
    return head + body


def answer(message: bytes, signature: str = "as") -> object:
    a, b = socket.socketpair()
    try:
        a.sendall(message)
        return dbuswire.read_reply(b, 1, time.monotonic() + 2, 1 << 18, signature)
    finally:
        a.close()
        b.close()


def test_a_hostile_reply_is_one_wire_error_never_a_hang_or_a_crash():
    """Only signatures the guard chose are parsed: a peer's `a()` (an array that never
    ends), 5,000 nested arrays (RecursionError), a signature sent as a string, a value of
    another type than asked: each is one WireError, at once."""
    good = struct.pack("<B", 2) + b"as\0" + struct.pack("<I", 8)
    good += struct.pack("<I", 3) + b"A=1\0"
    assert answer(reply(good, b"v")) == ("ok", ["A=1"])
    hostile = [
        reply(struct.pack("<B", 3) + b"a()\0" + struct.pack("<I", 8) + b"\0" * 8, b"v"),
        reply(b"\0" * 16, b"a" * 200 + b"y"),
        reply(b"\0" * 16, b"a" * 5000 + b"y", sig_type=b"s"),
        reply(struct.pack("<B", 1) + b"i\0\0" + struct.pack("<i", 7), b"v"),  # not `as`
        reply(struct.pack("<I", 1) + b"x\0", b"s"),
    ]
    for message in hostile:
        began = time.monotonic()
        with pytest.raises(dbuswire.WireError):
            answer(message)
        assert time.monotonic() - began < 1.0


def test_a_peer_that_never_answers_is_no_answer_within_the_deadline():
    """Silence is its own error (the caller marks the manager silent for SILENT_FOR, so
    a stopped or slow manager costs one deadline, not one per unit); a refusal is not."""
    a, b = socket.socketpair()
    try:
        began = time.monotonic()
        with pytest.raises(dbuswire.WireError) as silent:
            dbuswire.read_reply(b, 1, time.monotonic() + 0.3, 1 << 18, "as")
        assert 0.25 < time.monotonic() - began < 1.0
        assert dbuswire.timed_out(silent.value)
        a.sendall(reply(b"\0" * 16, b"a" * 200 + b"y"))
        with pytest.raises(dbuswire.WireError) as refused:
            dbuswire.read_reply(b, 1, time.monotonic() + 1, 1 << 18, "as")
        assert not dbuswire.timed_out(refused.value)
    finally:
        a.close()
        b.close()


@pytest.mark.systemd
def test_a_users_huge_environment_is_refused_unread_and_a_real_unit_read_as_pystemd_does():
    big = "".join(f"Environment=PAD{i}={'x' * 200_000}\n" for i in range(4))
    huge = "".join(f"Environment=PAD{i}={'x' * 1_000_000}\n" for i in range(60))
    with UserManager() as um:
        um.write_unit(
            "llama-a.service",
            "[Service]\nExecStart=/bin/sleep 3600 -m '${MODEL}'\n"
            "Environment=LLAMA_ARG_CTX_SIZE=8192 MODEL=/m/x.gguf PAD=1 HOME=/h\nUser=nobody\n",
        )
        for name, env in (("llama-big", big), ("llama-huge", huge)):
            um.write_unit(f"{name}.service", f"[Service]\nExecStart=/bin/sleep 3600\n{env}")
            um.systemctl("start", f"{name}.service")  # loaded, as a running loader is
        m = connect_to("user:0", "/nonexistent", str(um.user_runtime))
        try:
            details = m.unit_details("llama-a.service")
            assert details.exec_start == (("/bin/sleep", "3600", "-m", "${MODEL}"),)
            assert details.environment == (
                "LLAMA_ARG_CTX_SIZE=8192",
                "MODEL=/m/x.gguf",
                "HOME=/h",
            )
            assert details.user == "nobody"
            # 800 kB: its size is in the reply's header, and nothing more is read.
            with pytest.raises(ManagerError, match=r"reading its properties: Environment: a reply"):
                m.unit_details("llama-big.service")
            # 60 MB: systemd takes seconds to send it; the deadline comes first.
            began = time.monotonic()
            with pytest.raises(
                ManagerError,
                match=r"its properties: (Environment: a reply of \d+ bytes|no answer within)",
            ) as refused:
                m.unit_details("llama-huge.service")
            assert time.monotonic() - began < DETAILS_TIMEOUT + 0.5
            if isinstance(refused.value, ManagerSilent):
                # Slow as a frozen manager is: silent for SILENT_FOR, so thirty units of
                # hers cost one deadline, not thirty. The next read fails at once.
                began = time.monotonic()
                with pytest.raises(ManagerSilent, match="not asked"):
                    m.unit_details("llama-a.service")
                assert time.monotonic() - began < 0.2
            else:
                # The connection the guard keeps is untouched: the next read answers.
                assert m.unit_details("llama-a.service") == details
        finally:
            m.close()
    assert DETAILS_CAP < 800_000


@pytest.mark.systemd
def test_a_users_unit_details_held_have_a_budget_across_her_units():
    """Each unit's ExecStart= within 64 KiB is no limit on forty of them: what the guard
    holds of one user's units' command lines and environment is DETAILS_OWNER_BUDGET in
    all; past it a new unit's are not read, and its footprint says why."""
    from lab.guardunit import guard_manager, write_config
    from spark_guard import config as config_mod
    from spark_guard import log
    from spark_guard.sense import Sensor
    from spark_guard.sense.asking import DETAILS_OWNER_BUDGET
    from spark_guard.sense.units import DETAILS_RETRY

    args = " ".join(f"a{i:05}{'x' * 40}" for i in range(1000))  # 47 KiB, 1,000 arguments
    n = 30
    with guard_manager() as um:
        for i in range(n):
            um.write_unit(
                f"fat-{i:02}.service", f"[Service]\nExecStart=/bin/sh -c 'exec sleep 3600' {args}\n"
            )
        um.systemctl("daemon-reload")
        um.systemctl("start", *(f"fat-{i:02}.service" for i in range(n)))
        write_config(um)
        now = [time.monotonic()]
        sensor = Sensor(
            config_mod.load(str(um.base / "guard.toml")), log.get_logger(), clock=lambda: now[0]
        )
        try:
            sensor.refresh_managers()
            units = {str(u.ref): u for u in sensor.snapshot().units}
            # A unit refused now is asked again later, not left unread for its whole run:
            # once the others are gone, its details fit and are read.
            left = [r for r, u in units.items() if r.startswith("user:0:fat-") and not u.exec_start]
            why = sensor.units.units[units[left[0]].ref].details if left else None
            others = [r.split(":")[-1] for r in units if r.startswith("user:0:fat-")]
            um.systemctl("stop", *(n for n in others if f"user:0:{n}" not in left))
            now[0] += DETAILS_RETRY
            later = {str(u.ref): u for u in sensor.snapshot().units}
        finally:
            for m in sensor.managers.values():
                m.close()
        assert left and all(later[r].exec_start for r in left), left
        assert "user:0:fat-00.service" in units, sorted(units)
        fat = [units[f"user:0:fat-{i:02}.service"] for i in range(n)]
        held = sum(len(a) + 1 for u in fat for row in u.exec_start for a in row)
        assert 0 < held <= DETAILS_OWNER_BUDGET + 64 * 1024, held  # the last one read may pass it
        refused = [u for u in fat if not u.exec_start]
        assert refused and len(refused) < n, len(refused)
        assert why is not None and "over 1024 KiB: not read" in why.unreadable


def peer(path: str, answer: bytes | None) -> threading.Thread:
    """A listener at `path` that does the D-Bus handshake, reads one call, and sends
    `answer` to it (None: never answers, as systemd's FreezeUnit while the kernel has
    not frozen the cgroup)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn, server:
            conn.recv(4096)  # AUTH EXTERNAL ... BEGIN
            conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
            conn.recv(4096)  # the call
            if answer is not None:
                conn.sendall(answer)
            conn.recv(1)  # until the caller hangs up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def empty_return() -> bytes:
    fields = bytes([dbuswire.F_REPLY_SERIAL, 1]) + b"u\0" + struct.pack("<I", 1)
    head = b"l" + bytes([dbuswire.METHOD_RETURN, 0, 1])
    return head + struct.pack("<III", 0, 2, len(fields)) + fields


def test_a_call_that_returns_nothing_is_answered_or_given_up_with_the_gil_free(tmp_path):
    """F4: FreezeUnit on a connection of its own. Answered: ok, no value. Not answered: one
    NoAnswer at the deadline, and meanwhile the guard's other threads ran (pystemd held
    the GIL for the whole bus timeout: every thread of the guard stopped)."""
    args = (b"/org/freedesktop/systemd1", b"org.freedesktop.systemd1.Manager", b"FreezeUnit")
    served = peer(str(tmp_path / "answers"), empty_return())
    assert (
        dbuswire.call(
            str(tmp_path / "answers"), *args, b"x.service", reply=None, timeout=2, cap=1 << 16
        )
        is None
    )
    served.join(2)

    ticks = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count, daemon=True)
    peer(str(tmp_path / "silent"), None)
    counter.start()
    began = time.monotonic()
    try:
        with pytest.raises(dbuswire.NoAnswer):
            dbuswire.call(
                str(tmp_path / "silent"), *args, b"x.service", reply=None, timeout=0.5, cap=1 << 16
            )
        took = time.monotonic() - began
    finally:
        stop.set()
        counter.join()
    assert 0.45 < took < 1.5
    assert ticks[0] > 10_000  # the counting thread ran throughout the wait
