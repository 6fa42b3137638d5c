"""A fake systemd user manager: a minimal D-Bus peer that lies, run by a hostile user.

    python3 fake_manager.py SOCKET CGROUP UNIT_PATH_DIR [UNIT...]

Listens on SOCKET (where systemd --user puts its private socket), speaks
D-Bus's peer-to-peer wire protocol (EXTERNAL auth, little-endian messages)
and answers what a guard would ask: the manager's ControlGroup is CGROUP
(someone else's), its UnitPath starts with UNIT_PATH_DIR (somewhere the
user wants a mask written), ListUnitsByNames says every UNIT is active,
and StopUnit/KillUnit fail, so a guard that believed it would fall back to
killing the cgroup it was told about. Everything else gets an error reply.
No library: the point is that anyone can write one.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
from typing import Any


def _pad(buf: bytearray, n: int) -> None:
    buf.extend(b"\0" * (-len(buf) % n))


_ALIGN = {"y": 1, "b": 4, "u": 4, "i": 4, "t": 8, "s": 4, "o": 4, "g": 1, "a": 4, "(": 8, "v": 1}


def _one(sig: str) -> tuple[str, str]:
    """The first complete type of `sig`, and the rest."""
    if sig[0] == "a":
        t, rest = _one(sig[1:])
        return "a" + t, rest
    if sig[0] == "(":
        depth = 0
        for i, c in enumerate(sig):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return sig[: i + 1], sig[i + 1 :]
    return sig[0], sig[1:]


def _types(sig: str) -> list[str]:
    out = []
    while sig:
        t, sig = _one(sig)
        out.append(t)
    return out


def marshal(buf: bytearray, sig: str, value: Any) -> None:
    c = sig[0]
    _pad(buf, _ALIGN[c])
    if c == "y":
        buf.append(value)
    elif c in "bu":
        buf += struct.pack("<I", int(value))
    elif c == "i":
        buf += struct.pack("<i", value)
    elif c == "t":
        buf += struct.pack("<Q", value)
    elif c in "so":
        raw = value.encode()
        buf += struct.pack("<I", len(raw)) + raw + b"\0"
    elif c == "g":
        raw = value.encode()
        buf += bytes([len(raw)]) + raw + b"\0"
    elif c == "v":
        inner, val = value
        marshal(buf, "g", inner)
        marshal(buf, inner, val)
    elif c == "a":
        start = len(buf)
        buf += b"\0\0\0\0"
        _pad(buf, _ALIGN[sig[1]])
        body = len(buf)
        for item in value:
            marshal(buf, sig[1:], item)
        struct.pack_into("<I", buf, start, len(buf) - body)
    elif c == "(":
        for t, v in zip(_types(sig[1:-1]), value, strict=True):
            marshal(buf, t, v)


def unmarshal(data: bytes, pos: int, sig: str) -> tuple[Any, int]:
    c = sig[0]
    pos += -pos % _ALIGN[c]
    if c == "y":
        return data[pos], pos + 1
    if c in "bu":
        return struct.unpack_from("<I", data, pos)[0], pos + 4
    if c == "i":
        return struct.unpack_from("<i", data, pos)[0], pos + 4
    if c == "t":
        return struct.unpack_from("<Q", data, pos)[0], pos + 8
    if c in "so":
        n = struct.unpack_from("<I", data, pos)[0]
        return data[pos + 4 : pos + 4 + n].decode(), pos + 5 + n
    if c == "g":
        n = data[pos]
        return data[pos + 1 : pos + 1 + n].decode(), pos + 2 + n
    if c == "v":
        inner, pos = unmarshal(data, pos, "g")
        return unmarshal(data, pos, inner)
    if c == "a":
        n = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        pos += -pos % _ALIGN[sig[1]]
        end, items = pos + n, []
        while pos < end:
            item, pos = unmarshal(data, pos, sig[1:])
            items.append(item)
        return items, pos
    if c == "(":
        items = []
        for t in _types(sig[1:-1]):
            item, pos = unmarshal(data, pos, t)
            items.append(item)
        return items, pos
    raise ValueError(sig)


def message(
    kind: int, serial: int, fields: list[tuple[int, tuple[str, Any]]], sig: str, body: list[Any]
) -> bytes:
    payload = bytearray()
    for t, v in zip(_types(sig), body, strict=True):
        marshal(payload, t, v)
    if sig:
        fields = [*fields, (8, ("g", sig))]
    head = bytearray(b"l" + bytes([kind, 0, 1]))
    head += struct.pack("<II", len(payload), serial)
    marshal(head, "a(yv)", fields)
    _pad(head, 8)
    return bytes(head + payload)


class Fake:
    def __init__(self, cgroup: str, unit_dir: str, units: list[str]) -> None:
        self.cgroup = cgroup
        self.unit_dir = unit_dir
        self.units = units
        self.serial = 0
        self.calls: list[str] = []

    def answer(self, member: str, body: list[Any]) -> tuple[str, list[Any]] | str:
        """(signature, values) of a reply, or the name of an error."""
        if member == "Get":
            prop = body[1]
            if prop == "ControlGroup":
                return "v", [("s", self.cgroup)]
            if prop == "UnitPath":
                return "v", [("as", [self.unit_dir])]
            return "org.freedesktop.DBus.Error.UnknownProperty"
        if member == "ListUnitsByNames":
            rows = [(n, "", "loaded", "active", "running", "", "/", 0, "", "/") for n in body[0]]
            return "a(ssssssouso)", [rows]
        if member in ("ListJobs", "ListUnits"):
            return ("a(usssoo)", [[]]) if member == "ListJobs" else ("a(ssssssouso)", [[]])
        return "org.freedesktop.systemd1.NoSuchUnit"

    def serve(self, conn: socket.socket) -> None:
        # Authentication: one reply per line, until BEGIN; then binary messages.
        data = b""
        while b"BEGIN\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return
            done = data.count(b"\r\n")
            data += chunk
            for line in data.lstrip(b"\0").split(b"\r\n")[done : data.count(b"\r\n")]:
                ok = b"OK " + os.urandom(16).hex().encode() + b"\r\n"
                if line.startswith(b"AUTH"):  # with an initial response: done; without: ask
                    conn.sendall(ok if len(line.split()) > 2 else b"DATA\r\n")
                elif line.startswith(b"DATA"):
                    conn.sendall(ok)
                elif line.startswith(b"NEGOTIATE_UNIX_FD"):
                    conn.sendall(b"AGREE_UNIX_FD\r\n")
        rest = data.split(b"BEGIN\r\n", 1)[1]
        while True:
            while len(rest) < 16:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                rest += chunk
            body_len, serial, fields_len = struct.unpack_from("<III", rest, 4)
            total = 16 + fields_len + (-(16 + fields_len) % 8) + body_len
            while len(rest) < total:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                rest += chunk
            msg, rest = rest[:total], rest[total:]
            fields, pos = unmarshal(msg, 12, "a(yv)")
            named = dict(fields)
            pos += -pos % 8
            body: list[Any] = []
            for t in _types(named.get(8, "")):
                item, pos = unmarshal(msg, pos, t)
                body.append(item)
            member = named.get(3, "")
            self.calls.append(member)
            print("call", member, body, flush=True)
            if msg[1] != 1:
                continue
            self.serial += 1
            reply = self.answer(member, body)
            if isinstance(reply, str):
                conn.sendall(
                    message(3, self.serial, [(4, ("s", reply)), (5, ("u", serial))], "s", ["no"])
                )
            else:
                sig, values = reply
                conn.sendall(message(2, self.serial, [(5, ("u", serial))], sig, values))


def serve_quietly(fake: Fake, conn: socket.socket) -> None:
    """A client that hangs up is no news."""
    try:
        fake.serve(conn)
    except OSError:
        pass
    finally:
        conn.close()


def main() -> None:
    path, cgroup, unit_dir, *units = sys.argv[1:]
    fake = Fake(cgroup, unit_dir, units)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen(16)
        print("listening", path, flush=True)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=serve_quietly, args=(fake, conn), daemon=True).start()


if __name__ == "__main__":
    main()
