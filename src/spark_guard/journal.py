"""journald's native protocol on a socket that never blocks.

systemd.journal.send() writes with a blocking sendmsg() and the GIL held: once
journald stops reading (stopped, or stalled under the very memory pressure the
guard is there for) its datagram queue fills and every thread of the guard stops
with it, the watchdog's too. Here each entry is one sendto() on a non-blocking
AF_UNIX datagram socket: an entry journald cannot take now is dropped and
counted, never waited for, and the count is said once the journal reads again.

The native protocol (systemd's sd_journal_sendv): one datagram per entry, each
field `KEY=value\\n`, or, for a value with a newline in it, `KEY\\n`, its length
as 64-bit little-endian, the value and `\\n`.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Mapping

SOCKET = "/run/systemd/journal/socket"


def encode(fields: Mapping[str, object]) -> bytes:
    """One journal entry in the native protocol; None values are left out."""
    out = bytearray()
    for key, value in fields.items():
        if value is None:
            continue
        data = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        name = _name(key)
        if b"\n" in data:
            out += name + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name + b"=" + data + b"\n"
    return bytes(out)


def _name(key: str) -> bytes:
    """A field name as journald takes it: A-Z, 0-9 and _, not starting with a digit or _;
    anything else becomes _ (a name is never a user's text, but never framing either)."""
    name = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in key.upper())
    if not name or not name[0].isalpha():
        name = "X" + name
    return name[:64].encode("ascii")


class JournalSocket:
    """Sends entries to journald without ever waiting; counts what it had to drop."""

    def __init__(self, path: str = SOCKET) -> None:
        self.path = path
        self.dropped = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)

    def send(self, fields: Mapping[str, object]) -> bool:
        """Hand one entry to journald now; False (and counted) if it cannot take it now:
        its queue full, journald gone, or an entry too big for one datagram."""
        try:
            self._sock.sendto(encode(fields), self.path)
        except OSError:
            # Queue full, journald gone, an entry too big, or anything else: the guard's
            # log never raises into the loop; what was lost is counted.
            self.dropped += 1
            return False
        return True

    def take_dropped(self) -> int:
        """How many entries were dropped since the last call; the count starts again."""
        n, self.dropped = self.dropped, 0
        return n

    def close(self) -> None:
        self._sock.close()

    def fileno(self) -> int:
        return self._sock.fileno()


def available(path: str = SOCKET) -> bool:
    """Whether a journald socket is there to send to."""
    return os.path.exists(path)
