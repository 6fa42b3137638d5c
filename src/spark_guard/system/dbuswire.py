"""One D-Bus call in plain Python, bounded in size and time.

pystemd (sd-bus) reads a reply whole, however big, with the GIL held: a user's
unit with 60 Environment= lines of 1 MB each made one read 60 MB and 0.5 s, and
the guard held 134 MiB for it. Here the reply's header says its size before
its body is read: a reply over `cap` is refused unread, and the whole call has
a deadline kept in Python (a socket timeout), so a manager that stops
answering costs the caller that deadline and nothing else.

The same for FreezeUnit, which systemd answers only once the kernel has frozen the
cgroup: a loader in an uninterruptible wait (an NVIDIA ioctl) holds the answer back,
and pystemd would hold the GIL, and every thread of the guard, the whole bus timeout.

Every call to a user's manager goes this way (managers.py), and PID 1's FreezeUnit:
marshal one method call (arguments of the basic types and arrays of them), read
messages until its reply, unmarshal the basic types, arrays, structs and variants
systemd's unit properties and Manager methods use. The D-Bus specification, "Message
Protocol": a 16-byte fixed header, header fields a(yv), the body 8-aligned after them.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.text import printable

FIXED = 16  # endian, type, flags, version, body length, serial, header fields' length
METHOD_CALL, METHOD_RETURN, ERROR = 1, 2, 3
# Header field codes.
F_PATH, F_INTERFACE, F_MEMBER, F_ERROR_NAME, F_REPLY_SERIAL = 1, 2, 3, 4, 5
F_DESTINATION, F_SIGNATURE = 6, 8
HEADER_FIELDS_MAX = 64 * 1024  # a reply's header fields: names and a signature
_ALIGN = {"y": 1, "b": 4, "n": 2, "q": 2, "i": 4, "u": 4, "x": 8, "t": 8, "d": 8}
_ALIGN |= {"s": 4, "o": 4, "g": 1, "a": 4, "(": 8, "{": 8, "v": 1, "h": 4}
_FORMAT = {"y": "B", "b": "I", "n": "h", "q": "H", "i": "i", "u": "I", "x": "q", "t": "Q"}
_FORMAT |= {"d": "d", "h": "I"}
MAX_DEPTH = 32


class WireError(Exception):
    """The call could not be made or its reply not read: str() says why, in one line."""


class TooBig(WireError):
    """The reply is over the caller's cap: refused unread. `serial`: the call it answers."""

    def __init__(self, text: str, serial: int = 0) -> None:
        super().__init__(text)
        self.serial = serial


class NoAnswer(WireError):
    """The peer did not answer within the deadline (stopped, frozen, or slow)."""


class NoReply(NoAnswer):
    """The call went out, and no reply came within the deadline (it may yet be done)."""


def timed_out(e: WireError) -> bool:
    return isinstance(e, NoAnswer)


# --- marshalling (what Properties.Get and FreezeUnit need) --------------------------------------


def _pad(buf: bytearray, align: int) -> None:
    buf.extend(b"\0" * (-len(buf) % align))


def _put_string(buf: bytearray, code: str, text: bytes) -> None:
    if code == "g":
        buf.append(len(text))
    else:
        _pad(buf, 4)
        buf.extend(struct.pack("<I", len(text)))
    buf.extend(text + b"\0")


def _put(buf: bytearray, code: str, value: Any) -> None:
    """One value of the complete type `code`: the basic types, and arrays of them."""
    if code[0] == "a":
        _pad(buf, 4)
        at = len(buf)
        buf.extend(b"\0\0\0\0")
        _pad(buf, _ALIGN.get(code[1], 1))
        start = len(buf)
        for item in value:
            _put(buf, code[1:], item)
        buf[at : at + 4] = struct.pack("<I", len(buf) - start)
        return
    if code in "sog":
        _put_string(buf, code, value.encode() if isinstance(value, str) else bytes(value))
        return
    if code not in _FORMAT:
        raise WireError(f"D-Bus type {code!r} not written here")
    _pad(buf, _ALIGN[code])
    buf.extend(struct.pack("<" + _FORMAT[code], int(value)))


def method_call(
    serial: int,
    destination: bytes,
    path: bytes,
    interface: bytes,
    member: bytes,
    *args: Any,
    signature: str | None = None,
) -> bytes:
    """A little-endian method call whose body is `args`, of `signature` (the basic types
    and arrays of them; None: each a string, 's')."""
    if signature is None:
        signature = "s" * len(args)
    body = bytearray()
    j = 0
    for a in args:
        k = _complete(signature, j)
        _put(body, signature[j:k], a)
        j = k
    if j != len(signature):
        raise WireError(f"{len(args)} arguments for signature {signature!r}")
    fields = bytearray()
    items: list[tuple[int, str, bytes]] = [
        (F_PATH, "o", path),
        (F_INTERFACE, "s", interface),
        (F_MEMBER, "s", member),
        (F_DESTINATION, "s", destination),
    ]
    if signature:
        items.append((F_SIGNATURE, "g", signature.encode()))
    for code, kind, value in items:
        _pad(fields, 8)
        fields.append(code)
        _put_string(fields, "g", kind.encode())
        _put_string(fields, kind, value)
    head = bytearray(b"l" + bytes([METHOD_CALL, 0, 1]))
    head += struct.pack("<III", len(body), serial, len(fields))
    head += fields
    _pad(head, 8)
    return bytes(head + body)


# --- unmarshalling --------------------------------------------------------------------------


def _complete(signature: str, i: int) -> int:
    """The end of the single complete type starting at signature[i]."""
    c = signature[i]
    if c == "a":
        return _complete(signature, i + 1)
    if c in "({":
        close = ")" if c == "(" else "}"
        j = i + 1
        while signature[j] != close:
            j = _complete(signature, j)
        return j + 1
    return i + 1


class _Reader:
    """Values of signatures this module chose, never the peer's: a variant is read only
    when its signature is one of `variants` (a peer's signature could nest a thousand
    levels, or name an empty struct whose array never ends)."""

    def __init__(
        self, data: bytes, endian: str, base: int = 0, variants: frozenset[str] = frozenset()
    ) -> None:
        self.data = data
        self.endian = endian
        self.pos = base  # offsets count from the message's start: alignment is relative to it
        self.base = base
        self.variants = variants

    def _align(self, n: int) -> None:
        self.pos += -self.pos % n

    def _take(self, n: int) -> bytes:
        start = self.pos - self.base
        if start + n > len(self.data):
            raise WireError("a D-Bus message ends inside a value")
        self.pos += n
        return self.data[start : start + n]

    def value(self, signature: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise WireError("a D-Bus value nested too deep")
        c = signature[0]
        self._align(_ALIGN.get(c, 1))
        if c in _FORMAT:
            fmt = self.endian + _FORMAT[c]
            (v,) = struct.unpack(fmt, self._take(struct.calcsize(fmt)))
            return bool(v) if c == "b" else v
        if c in "so":
            (n,) = struct.unpack(self.endian + "I", self._take(4))
            text = self._take(n + 1)[:-1]
            return text.decode(errors="replace")
        if c == "g":
            (n,) = self._take(1)
            return self._take(n + 1)[:-1].decode(errors="replace")
        if c == "v":
            inner = self.value("g", depth + 1)
            if inner not in self.variants:
                raise WireError(f"a D-Bus variant of signature {inner[:32]!r}, not one asked for")
            return self.value(inner, depth + 1)
        if c == "a":
            (n,) = struct.unpack(self.endian + "I", self._take(4))
            element = signature[1 : _complete(signature, 1)]
            self._align(_ALIGN.get(element[0], 1))
            end = self.pos + n
            if end - self.base > len(self.data):
                raise WireError("a D-Bus array runs past its message")
            items = []
            while self.pos < end:
                before = self.pos
                items.append(self.value(element, depth + 1))
                if self.pos == before:
                    raise WireError("a D-Bus array of empty elements")
            return items
        if c in "({":
            inner = signature[1 : _complete(signature, 0) - 1]
            out, j = [], 0
            while j < len(inner):
                k = _complete(inner, j)
                out.append(self.value(inner[j:k], depth + 1))
                j = k
            return tuple(out)
        raise WireError(f"D-Bus type {c!r} not read here")


def unmarshal(
    signature: str,
    body: bytes,
    endian: str,
    base: int = 0,
    variants: frozenset[str] = frozenset(),
) -> list[Any]:
    """The values of `body`, each complete type of `signature` (the caller's own) in turn;
    a variant only of a signature in `variants`."""
    reader = _Reader(body, endian, base, variants)
    out, j = [], 0
    try:
        while j < len(signature):
            k = _complete(signature, j)
            out.append(reader.value(signature[j:k]))
            j = k
    except (IndexError, struct.error, RecursionError, ValueError) as e:
        raise WireError(f"a malformed D-Bus message: {type(e).__name__}") from None
    return out


HEADER_VARIANTS = frozenset({"o", "s", "u", "g"})  # the types header fields have


# --- one call on a connected socket ----------------------------------------------------------


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoAnswer("no answer within the deadline")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 16))
        except TimeoutError:
            raise NoAnswer("no answer within the deadline") from None
        except OSError as e:
            raise WireError(f"the connection failed: {e.strerror or e}") from None
        if not chunk:
            raise WireError("the manager closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_reply(
    sock: socket.socket,
    serial: int,
    deadline: float,
    cap: int,
    signature: str | None,
    returns: str | None = None,
) -> tuple[str, Any]:
    """The reply to call `serial`, a variant of `signature` (None: a reply with no value),
    or, given `returns`, one value of that signature (a method's out-argument):
    ("ok", its value) or ("error", its name and text). Other messages (the signals systemd
    sends every client) are read past, each one bounded; another signature is an error."""
    return read_replies(sock, {serial: (signature, returns)}, deadline, cap)[serial]


def read_replies(
    sock: socket.socket,
    wanted: dict[int, tuple[str | None, str | None]],
    deadline: float,
    cap: int,
) -> dict[int, tuple[str, Any]]:
    """The replies to the calls `wanted` (serial -> read_reply's `signature`, `returns`),
    in whatever order they come, each read as read_reply reads one."""
    out: dict[int, tuple[str, Any]] = {}
    while len(out) < len(wanted):
        fixed = _recv_exactly(sock, FIXED, deadline)
        endian = {b"l"[0]: "<", b"B"[0]: ">"}.get(fixed[0])
        if endian is None:
            raise WireError("not a D-Bus message")
        kind = fixed[1]
        body_len, _, fields_len = struct.unpack(endian + "III", fixed[4:16])
        if fields_len > HEADER_FIELDS_MAX:
            raise TooBig(f"a reply's header of {fields_len} bytes")
        fields_raw = _recv_exactly(sock, fields_len + (-(FIXED + fields_len) % 8), deadline)
        (fields,) = unmarshal(
            "a(yv)",
            struct.pack(endian + "I", fields_len) + fields_raw,
            endian,
            12,
            HEADER_VARIANTS,
        )
        header = dict(fields)
        serial = header.get(F_REPLY_SERIAL)
        if not isinstance(serial, int) or serial in out or kind not in (METHOD_RETURN, ERROR):
            serial = 0  # (a signal, a reply already read, a peer's string for a serial)
        mine = serial in wanted
        if body_len > cap:
            if mine:
                raise TooBig(f"a reply of {body_len} bytes, over {cap}", serial)
            raise TooBig(f"a message of {body_len} bytes before the reply")
        body = _recv_exactly(sock, body_len, deadline)
        if mine:
            at = FIXED + len(fields_raw)
            out[serial] = _answer(kind, header, body, endian, at, *wanted[serial])
    return out


def _answer(
    kind: int,
    header: dict[int, Any],
    body: bytes,
    endian: str,
    at: int,
    signature: str | None,
    returns: str | None,
) -> tuple[str, Any]:
    said = header.get(F_SIGNATURE, "")
    if kind == ERROR:
        text = unmarshal("s", body, endian, at)[0] if said == "s" else ""
        name = printable(str(header.get(F_ERROR_NAME, "?")), 128)
        return "error", f"{name}: {printable(text, 256)}"
    if returns is not None and said == returns:
        (value,) = unmarshal(returns, body, endian, at)
        return "ok", value
    if signature is None and returns is None and not said:
        return "ok", None
    if said != "v" or signature is None:
        wanted = returns or signature
        raise WireError(f"a reply of signature {printable(str(said), 32)!r}, not {wanted!r}")
    (value,) = unmarshal("v", body, endian, at, frozenset({signature}))
    return "ok", value


def _authenticate(sock: socket.socket, deadline: float) -> None:
    """SASL's EXTERNAL, answered OK within the deadline. BEGIN with the AUTH, as sd-bus's
    own clients send it, and the call only after the OK: a call that reaches systemd in
    one read with BEGIN is left in its buffer until the next event on the socket
    (measured: answered only when the client hung up)."""
    uid = str(os.geteuid()).encode().hex().encode()
    sock.sendall(b"\0AUTH EXTERNAL " + uid + b"\r\nBEGIN\r\n")
    line = b""
    while not line.endswith(b"\r\n"):
        line += _recv_exactly(sock, 1, deadline)
        if len(line) > 512:
            raise WireError("no D-Bus handshake")
    if not line.startswith(b"OK "):
        raise WireError("the D-Bus handshake was refused")


@dataclass(frozen=True)
class Request:
    """One method call: `args` of `signature` (None: strings), its answer a variant of
    `reply` or one value of `returns` (both None: a method that returns nothing)."""

    path: bytes
    interface: bytes
    member: bytes
    args: tuple[Any, ...] = ()
    signature: str | None = None
    reply: str | None = None
    returns: str | None = None

    def message(self, serial: int, destination: bytes) -> bytes:
        return method_call(
            serial,
            destination,
            self.path,
            self.interface,
            self.member,
            *self.args,
            signature=self.signature,
        )


def _named(e: TooBig, requests: list[Request]) -> TooBig:
    """A reply over the cap, named by what it answers (one of several calls: a property)."""
    if len(requests) < 2 or not 0 < e.serial <= len(requests):
        return e
    asked = requests[e.serial - 1]
    label = asked.args[-1] if asked.args else asked.member
    what = label.decode(errors="replace") if isinstance(label, bytes) else str(label)
    return TooBig(f"{what}: {e}", e.serial)


def call(
    address: str,
    path: bytes,
    interface: bytes,
    member: bytes,
    *args: Any,
    reply: str | None,
    signature: str | None = None,
    returns: str | None = None,
    **how: Any,
) -> Any:
    """One method call (calls()'s `how`): its value, or WireError with what it answered."""
    request = Request(path, interface, member, args, signature, reply, returns)
    kind, value = calls(address, [request], **how)[0]
    if kind == "error":
        raise WireError(value)
    return value


def calls(
    address: str,
    requests: list[Request],
    *,
    timeout: float,
    cap: int,
    peer_pid: int = 0,
    destination: bytes = b"org.freedesktop.systemd1",
    vouch: Callable[[socket.socket], None] | None = None,
) -> list[tuple[str, Any]]:
    """Method calls on one fresh peer-to-peer connection to `address` (a manager's private
    socket), in plain Python: the GIL is free while it waits, and no signal of the
    manager's is left queued after it. Each answer ("ok", its value) or ("error", what
    the manager said), in the order asked; each reply refused over `cap` bytes, or of
    another type; all given up after `timeout` seconds (NoAnswer). `peer_pid`: the
    process that must answer (SO_PEERCRED), when known; `vouch`: a check of the
    connection once the peer has answered the handshake (raises), before any call."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except OSError as e:  # out of fds or memory: this read fails, not the pass
        raise WireError(f"cannot connect: {e.strerror or e}") from None
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(address)
            pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            if peer_pid and pid != peer_pid:
                raise WireError(f"pid {pid} answers, not the manager's pid {peer_pid}")
            _authenticate(sock, deadline)
            if vouch is not None:  # (its /proc reads are not the peer's time)
                vouch(sock)
                deadline = time.monotonic() + timeout
            sock.sendall(b"".join(r.message(n, destination) for n, r in enumerate(requests, 1)))
        except TimeoutError:
            raise NoAnswer("no answer within the deadline") from None
        except OSError as e:
            raise WireError(f"cannot connect: {e.strerror or e}") from None
        wanted = {n: (r.reply, r.returns) for n, r in enumerate(requests, 1)}
        try:
            answers = read_replies(sock, wanted, deadline, cap)
        except NoAnswer:
            raise NoReply("no reply within the deadline") from None
        except TooBig as e:
            raise _named(e, requests) from None
    finally:
        sock.close()
    return [answers[n] for n in range(1, len(requests) + 1)]
