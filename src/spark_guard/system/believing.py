"""Whether what answers on a manager's socket is that manager: reached, heard, believed.

A user owns /run/user/UID/systemd and everything in it. Her socket is reached
without following her links or entering her FUSE mounts, the peer must answer
the D-Bus handshake in time, SO_PEERCRED and /proc must name her manager in
`user@UID.service/init.scope` (PID 1 vouching where it answers), and the first
call goes out only on a connection whose other end her manager alone holds
(answerer.py: a socket unit of hers is her manager's listener too). Nothing
here asks the peer anything but the handshake.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from collections.abc import Callable, Iterator

from ..core.snapshot import SYSTEM
from . import answerer, mounts
from .manager_errors import ManagerError, ManagerSilent, ManagerUntrusted
from .procfs import ProcFS
from .safefs import Tree, UnsafePath, anchor_stat

# A manager must answer the D-Bus handshake within this before pystemd is let near it.
# pystemd keeps the GIL while sd-bus waits: a call to a silent peer would stop every
# thread of the guard, the loop included, for the whole bus timeout. Python's own
# socket waits let go of it. A live manager answers in microseconds to milliseconds.
HANDSHAKE_TIMEOUT = 1.0

Identity = tuple[int, int]  # a socket file's (st_dev, st_ino): one listener for its life


@contextlib.contextmanager
def socket_address(
    key: str, path: str, uid: int, pinned: Identity | None
) -> Iterator[tuple[str, Identity | None]]:
    """The socket's address to connect to, and the socket file's identity. She owns
    /run/user/UID/systemd: it is walked from the root-owned runtime root with O_NOFOLLOW,
    never into FUSE (mounts.py), and the socket pinned, checked, and connected to through
    /proc/self/fd: a symlink, a mount over it, or another file than `pinned` is refused."""
    if not uid:
        yield path, None
        return
    directory, name = os.path.split(path)
    # <user_runtime>/UID/systemd/private: the anchor is the root-owned runtime root.
    runtime = os.path.dirname(directory)
    try:
        tree = Tree(os.path.dirname(runtime), uid, anchor_stat(runtime).st_gid, True)
        with tree.directory(directory) as fd, mounts.pinned(name, fd) as sock:
            st = os.fstat(sock)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
                raise UnsafePath(errno.EPERM, f"{path}: not a socket of hers")
            if pinned is not None and pinned != (st.st_dev, st.st_ino):
                raise UnsafePath(errno.EPERM, f"{path}: not the socket that was believed")
            yield f"/proc/self/fd/{sock}", (st.st_dev, st.st_ino)
    except UnsafePath as e:
        raise ManagerUntrusted(f"{key}: {e}") from None
    except OSError as e:  # gone meanwhile (a logout), or her FUSE mount on it (EXDEV)
        why = f"{key}: {path}: {e.strerror}"
        raise (ManagerUntrusted if e.errno == errno.EXDEV else ManagerError)(why) from None


def handshake(key: str, path: str, address: str) -> tuple[int, int, int]:
    """The manager answers SASL's AUTH EXTERNAL within HANDSHAKE_TIMEOUT (ManagerSilent if
    not); who listens there (SO_PEERCRED: pid, uid, gid).

    A frozen manager, or PID 1 deep in a daemon-reload, answers nothing: that is found
    here, where waiting costs no one else anything."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        sock.connect(address)
        sock.sendall(b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode() + b"\r\n")
        reply = sock.recv(256)
        peer = peer_credentials(sock.fileno())
    except TimeoutError:
        raise ManagerSilent(
            f"{key}: no answer to the D-Bus handshake within {HANDSHAKE_TIMEOUT:g}s"
        ) from None
    except OSError as e:
        raise ManagerError(f"{key}: cannot connect to {path}: {e.strerror or e}") from None
    finally:
        sock.close()
    if not reply.startswith(b"OK "):
        raise ManagerError(f"{key}: {path} refused the D-Bus handshake")
    return peer


def believed(
    key: str,
    path: str,
    uid: int,
    peer: tuple[int, int, int],
    proc_root: str,
    vouch: Callable[[str], tuple[int, str]] | None,
) -> tuple[int, str]:
    """The peer's pid and root cgroup ("" for PID 1's: it says its own), if it is uid UID
    running as the manager of user@UID.service; ManagerUntrusted if not.

    SO_PEERCRED names the process that listens; /proc/PID/cgroup (the kernel's word, not
    the manager's) must be <...>/user@UID.service/init.scope, where systemd --user puts
    itself; where PID 1 answers (`vouch`: a unit's MainPID and ControlGroup, of PID 1),
    it must also name that process as user@UID.service's main process. The root cgroup
    is taken from there, so whatever it reports, it can claim only its own units."""
    pid, peer_uid, _gid = peer
    if peer_uid != uid:
        raise ManagerUntrusted(f"{key}: the process on {path} is uid {peer_uid}, not {uid}")
    if key == SYSTEM:
        return pid, ""
    own = ProcFS(proc_root).cgroup(pid) or ""
    root, _, leaf = own.rpartition("/")
    expected = f"user@{uid}.service"
    if leaf != "init.scope" or (uid and os.path.basename(root) != expected):
        raise ManagerUntrusted(
            f"{key}: pid {pid} on {path} runs in {own or '?'}, "
            f"not {expected}/init.scope: not this user's systemd"
        )
    if vouch is None or not uid:
        return pid, root or "/"
    try:
        main, cgroup = vouch(expected)
    except ManagerSilent:
        raise  # PID 1 busy is no verdict on this manager: asked again next time
    except ManagerError as e:
        raise ManagerUntrusted(f"{key}: PID 1 cannot vouch for it: {e}") from None
    if main != pid or cgroup.rstrip("/") != root:
        raise ManagerUntrusted(
            f"{key}: pid {pid} in {root} is not {expected} "
            f"(PID 1 says main pid {main}, cgroup {cgroup or '-'})"
        )
    return pid, root or "/"


def sole_answerer(
    key: str, path: str, uid: int, pid: int, proc_root: str, tree: str = ""
) -> Callable[..., None]:
    """A check of a connection (dbuswire.call's `vouch`): its other end is held by her
    manager `pid` and no other process of hers (issue 40, H4).

    Her manager also listens for her socket units, so SO_PEERCRED names it there too; but
    what a socket unit's listener accepts is held by her service (Accept=no) or by the
    instance spawned for it (Accept=yes, the manager keeping a copy). The kernel says
    which socket is the other end, /proc who holds it (answerer.py): her processes, and
    those in `tree`, her user slice (a subuid's in her rootless container)."""

    def check(sock: socket.socket) -> None:
        if not uid:
            return
        try:
            who = answerer.holders(proc_root, answerer.other_end(sock), uid, tree)
        except answerer.Unknown as e:
            raise ManagerUntrusted(f"{key}: cannot tell who answers: {e.strerror}") from None
        if who != {pid}:
            others = ", ".join(str(p) for p in sorted(who - {pid})[:4]) or "none"
            raise ManagerUntrusted(
                f"{key}: {path} is answered by pid {others}, not by the manager "
                f"(pid {pid}) alone: a socket unit's, not the manager's own"
            )

    return check


def peer_credentials(fd: int) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a connected unix socket."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    finally:
        sock.close()
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
