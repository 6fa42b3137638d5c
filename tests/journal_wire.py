"""journald's native protocol read back, as journald parses a datagram: for tests."""

from __future__ import annotations

import struct


def decode(datagram: bytes) -> dict[str, str]:
    """The fields of one native-protocol entry: `KEY=value\\n`, or `KEY\\n`, a 64-bit
    little-endian length, the value and `\\n`."""
    fields: dict[str, str] = {}
    at = 0
    while at < len(datagram):
        end = datagram.index(b"\n", at)
        line = datagram[at:end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            at = end + 1
        else:
            key = line
            (size,) = struct.unpack_from("<Q", datagram, end + 1)
            value = datagram[end + 9 : end + 9 + size]
            assert datagram[end + 9 + size : end + 10 + size] == b"\n"
            at = end + 10 + size
        fields[key.decode()] = value.decode()
    return fields
