"""A filesystem that hangs: a FUSE server, speaking the kernel's protocol on /dev/fuse,
whose files open and stat like any file but whose reads are never answered.

It is what a hung NFS or sshfs mount does to a reader: pread() waits in the
kernel and no timeout or signal in the reading thread gets it out. `close()`
aborts the connection, and every waiting read then fails (ECONNABORTED).
Mount it in a private mount namespace (`unshare -m`): root only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR = 1, 2, 3
FUSE_OPEN, FUSE_READ, FUSE_RELEASE = 14, 15, 18
FUSE_FLUSH, FUSE_INIT, FUSE_INTERRUPT, FUSE_DESTROY = 25, 26, 36, 38
FUSE_BATCH_FORGET = 42
NO_REPLY = (FUSE_FORGET, FUSE_INTERRUPT, FUSE_BATCH_FORGET)

IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ROOT = 1
SIZE = 1 << 30  # each file claims 1 GiB


def _attr(ino: int) -> bytes:
    mode = (stat.S_IFDIR | 0o755) if ino == ROOT else (stat.S_IFREG | 0o644)
    # ino size blocks atime mtime ctime (ns x3) mode nlink uid gid rdev blksize flags
    return struct.pack(
        "<QQQQQQIIIIIIIIII",
        ino,
        0 if ino == ROOT else SIZE,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        mode,
        1,
        0,
        0,
        0,
        4096,
        0,
    )


class HangFS:
    """Mounted at `mountpoint`: any name in its root is a file whose reads never return."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        self.names: dict[str, int] = {}
        self.reads_waiting = 0
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if libc.mount(b"hangfs", mountpoint.encode(), b"fuse.hangfs", 0, opts) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"mount hangfs on {mountpoint}: {os.strerror(err)}")
        self.thread = threading.Thread(target=self._serve, name="hangfs", daemon=True)
        self.thread.start()

    def _reply(self, unique: int, body: bytes = b"", error: int = 0) -> None:
        os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)

    def _serve(self) -> None:
        while True:
            try:
                msg = os.read(self.fd, 1 << 20)
            except OSError:
                return  # unmounted or aborted
            _, opcode, unique, node, *_ = IN_HEADER.unpack_from(msg)
            arg = msg[IN_HEADER.size :]
            try:
                self._answer(opcode, unique, node, arg)
            except OSError:
                return

    def _answer(self, opcode: int, unique: int, node: int, arg: bytes) -> None:
        if opcode in NO_REPLY:
            return
        if opcode == FUSE_INIT:
            _major, minor, readahead, _flags = struct.unpack_from("<IIII", arg)
            # major minor max_readahead flags max_background congestion max_write time_gran
            # max_pages map_alignment flags2 unused[7]
            body = struct.pack(
                "<IIIIHHIIHHI7I",
                7,
                min(minor, 31),
                readahead,
                0,
                16,
                12,
                1 << 17,
                1,
                32,
                0,
                0,
                *([0] * 7),
            )
            self._reply(unique, body)
        elif opcode == FUSE_LOOKUP:
            name = arg.split(b"\0", 1)[0].decode()
            ino = self.names.setdefault(name, len(self.names) + 2)
            # nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec
            self._reply(unique, struct.pack("<QQQQII", ino, 0, 60, 60, 0, 0) + _attr(ino))
        elif opcode == FUSE_GETATTR:
            self._reply(unique, struct.pack("<QII", 60, 0, 0) + _attr(node))
        elif opcode == FUSE_OPEN:
            self._reply(unique, struct.pack("<QII", 0, 0, 0))
        elif opcode == FUSE_READ:
            self.reads_waiting += 1  # never answered: the reader waits until close()
        elif opcode in (FUSE_FLUSH, FUSE_RELEASE, FUSE_DESTROY):
            self._reply(unique)
        else:
            self._reply(unique, error=errno.ENOSYS)

    def close(self) -> None:
        """Abort the connection (a forced unmount does, for FUSE): the waiting reads fail."""
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.umount2(self.mountpoint.encode(), 1)  # MNT_FORCE: aborts the connection
        libc.umount2(self.mountpoint.encode(), 2)  # MNT_DETACH, if still there
        self.thread.join(5)
        os.close(self.fd)
