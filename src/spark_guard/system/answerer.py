"""Who answers on a connected unix socket: the process that holds its other end.

SO_PEERCRED names the process that called listen(), which for a socket unit of
a user's is her manager itself: a `ListenStream=` of hers beside (or, since
systemd unlinks what is in its way, at) her manager's private socket passes
every check of the listener (issue 40, H4). What tells them apart is who holds
the end that accepted the connection: for her manager's own bus, her manager
and no one else; for a socket unit's, her service (Accept=no), or the instance
her manager spawned for it (Accept=yes).

The kernel says which socket is our connection's other end (sock_diag,
UNIX_DIAG_PEER: what `ss -x` shows), and /proc/PID/fd says who holds it.
Nothing here asks the peer anything.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
UDIAG_SHOW_PEER = 0x4
UNIX_DIAG_PEER = 2
NO_COOKIE = 0xFFFFFFFF
# Descriptors of her processes looked at, at most, to find who else holds the other end:
# past it, no answer (she chose to have that many; she is then not believed).
FDS_MAX = 1 << 16


class Unknown(OSError):
    """Who answers could not be told (no sock_diag, or too much to look at)."""


def other_end(sock: socket.socket) -> int:
    """The inode of the socket at the other end of connected unix socket `sock`."""
    ino = os.fstat(sock.fileno()).st_ino
    req = struct.pack(
        "=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, ino, UDIAG_SHOW_PEER, NO_COOKIE, NO_COOKIE
    )
    head = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.sendto(head + req, (0, 0))
            data = nl.recv(8192)
    except OSError as e:
        raise Unknown(e.errno or errno.EIO, f"sock_diag: {e.strerror or e}") from None
    if len(data) < 16:
        raise Unknown(errno.EIO, "sock_diag: a short answer")
    length, kind = struct.unpack_from("=IH", data)
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, 16)[0] if len(data) >= 20 else errno.EIO
        raise Unknown(code, f"sock_diag: {os.strerror(code)}")
    at, end = 16 + 16, min(length, len(data))  # nlmsghdr, unix_diag_msg, then attributes
    while at + 4 <= end:
        size, attr = struct.unpack_from("=HH", data, at)
        if size < 4:
            break
        if attr == UNIX_DIAG_PEER and size >= 8:
            return int(struct.unpack_from("=I", data, at + 4)[0])
        at += (size + 3) & ~3
    raise Unknown(errno.ENOTCONN, "sock_diag: the socket has no other end")


def _hers(entry: os.DirEntry[str], uid: int, tree: str) -> bool:
    """A process of uid `uid`, or one in her cgroup `tree` (her rootless container's, of a
    subuid of hers, to which she can hand a descriptor as to anything of hers)."""
    if entry.stat(follow_symlinks=False).st_uid == uid:
        return True
    if tree in ("", "/"):
        return False
    with open(f"{entry.path}/cgroup", "rb") as f:
        line = f.read(4096).decode(errors="replace").partition("0::")[2].partition("\n")[0]
    return line == tree or line.startswith(tree + "/")


def holders(proc_root: str, inode: int, uid: int, tree: str = "") -> set[int]:
    """The processes of `uid` (or in cgroup `tree`) that hold socket `inode` (Unknown past
    FDS_MAX descriptors). What it cannot see: a thread's own descriptor table
    (unshare(CLONE_FILES)), a descriptor in flight in a unix socket's queue, io_uring's
    fixed files: a scan for who else holds it is a check, not a proof."""
    target = f"socket:[{inode}]"
    found: set[int] = set()
    seen = 0
    try:
        entries = os.scandir(proc_root)
    except OSError as e:
        raise Unknown(e.errno or errno.EIO, f"{proc_root}: {e.strerror}") from None
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                if not _hers(entry, uid, tree):
                    continue
                fds = os.listdir(f"{entry.path}/fd")
            except OSError:
                continue  # exited meanwhile
            seen += len(fds)
            if seen > FDS_MAX:
                raise Unknown(errno.E2BIG, f"over {FDS_MAX} descriptors of uid {uid} to look at")
            for fd in fds:
                try:
                    if os.readlink(f"{entry.path}/fd/{fd}") == target:
                        found.add(int(entry.name))
                        break
                except OSError:
                    continue
    return found
