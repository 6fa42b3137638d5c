"""F12: her FUSE mount over her runtime dir, whose daemon never answers.

With `user_allow_other` in /etc/fuse.conf she can mount FUSE (fusermount is setuid)
over her own /run/user/UID or its systemd/ directory, where root may enter; every
lookup, stat or open there is then a request to her daemon, which need not answer,
and the caller waits in the kernel for good. Before, the guard's discovery of
managers, the connection to hers and its mask checks all walked in: the loop hung
until the watchdog, and again at every start.

Here the mount is real (/dev/fuse, mounted by root on her behalf, her uid its owner,
as fusermount would): its daemon answers INIT and nothing after. Each call of the
guard's runs in a thread, so a hang fails the test instead of holding it; the
connection is aborted at the end, which lets any hung call go.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lab.accounts import unprivileged_user
from spark_guard.core.snapshot import user_manager
from spark_guard.system.engine import Engine, EngineError
from spark_guard.system.managers import Manager, ManagerUntrusted, discover
from spark_guard.system.unitfiles import UnitFileError, mask_dir, owner, present

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="mounts FUSE: root, /dev/fuse"
)

FUSE_INIT = 26
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


@contextmanager
def hung_fuse(target: Path, uid: int) -> Iterator[None]:
    """A FUSE mount at `target` (a directory, or a file), owned by `uid`, that answers INIT
    and then nothing."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    root = "40000" if target.is_dir() else "100000"
    opts = f"fd={fd},rootmode={root},user_id={uid},group_id={uid},allow_other".encode()
    flags = MS_NOSUID | MS_NODEV
    if libc.mount(b"sg-hang", str(target).encode(), b"fuse.sg-hang", flags, opts) != 0:
        os.close(fd)
        pytest.fail(f"mount fuse at {target}: {os.strerror(ctypes.get_errno())}")
    try:
        request = os.read(fd, 1 << 17)
        _, opcode, unique = struct.unpack("<IIQ", request[:16])
        assert opcode == FUSE_INIT
        init = struct.pack("<IIIIHHIIHHI", 7, 31, 1 << 17, 0, 16, 12, 1 << 17, 1, 32, 0, 0)
        init += b"\0" * 28
        os.write(fd, struct.pack("<IiQ", 16 + len(init), 0, unique) + init)
        yield
    finally:
        os.close(fd)  # aborts the connection: whatever waits on it gets ENOTCONN
        libc.umount2(str(target).encode(), MNT_DETACH)


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """call()'s result or exception, in a thread; the test fails if it has not returned."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} still waits on her FUSE daemon after {seconds}s"
    return out[0]


@pytest.mark.parametrize("over", ["systemd", "runtime", "private", "mask"])
def test_her_fuse_mount_over_her_runtime_dir_holds_nothing_of_the_guard(over):
    base = Path(tempfile.mkdtemp(prefix="sg-fuse."))  # (walked with her rights: 0755)
    base.chmod(0o755)
    runtime = base / "run-user"  # root's, as /run/user
    runtime.mkdir(mode=0o755)
    with unprivileged_user() as mallory, contextlib.ExitStack() as done:
        done.callback(shutil.rmtree, base, ignore_errors=True)
        uid = mallory.uid
        mine = runtime / str(uid)
        (mine / "systemd").mkdir(parents=True)
        for d in (mine, mine / "systemd"):
            os.chown(d, uid, uid)
        mine.chmod(0o700)
        key = user_manager(uid)
        socket = mine / "systemd" / "private"
        socket.write_bytes(b"")  # (her manager's socket is where her file mount goes)
        os.chown(socket, uid, uid)
        # "mask": her blocked loader's mask, replaced by a file of hers with a mount over it.
        mask = Path(mask_dir(key, str(runtime))) / "llama.service"
        mask.parent.mkdir()
        mask.write_bytes(b"")
        for f in (mask.parent, mask):
            os.chown(f, uid, uid)
        targets = {"systemd": mine / "systemd", "runtime": mine, "private": socket, "mask": mask}
        target = targets[over]
        with hung_fuse(target, uid):
            # Discovery of managers: her socket is not found (her units are judged by
            # what the kernel shows, as for any manager out of view).
            found = within(5, lambda: discover("/nonexistent", str(runtime)))
            assert found == ({key: str(socket)} if over == "mask" else {})
            # A connection to her manager: refused, said as not believed, with the reason
            # (here her "socket" is a file: "mask" shows that refusal).
            refused = within(5, lambda: Manager(key, str(socket)).connect())
            assert isinstance(refused, ManagerUntrusted), refused
            why = "not a socket of hers" if over == "mask" else "Invalid cross-device link"
            assert why in str(refused) or "FUSE" in str(refused), refused
            # A mask of hers looked for or laid: one clear error, at once.
            who = within(5, lambda: owner(key, str(runtime)))
            if over == "runtime":
                assert isinstance(who, UnitFileError), who  # her runtime dir itself
                return
            seen = within(5, lambda: present(str(mask), who))
            if over == "private":
                assert seen is True  # her mask there is no mount: it is looked at
                return
            assert isinstance(seen, UnitFileError), seen


def test_her_fuse_mount_on_her_engines_socket_is_no_engine_of_hers():
    """Her rootless engine's socket, mounted over by FUSE (a file mount): not entered."""
    base = Path(tempfile.mkdtemp(prefix="sg-fuse."))
    base.chmod(0o755)
    runtime = base / "run-user"
    runtime.mkdir(mode=0o755)
    with unprivileged_user() as mallory, contextlib.ExitStack() as done:
        done.callback(shutil.rmtree, base, ignore_errors=True)
        uid = mallory.uid
        podman = runtime / str(uid) / "podman"
        podman.mkdir(parents=True)
        for d in (podman.parent, podman):
            os.chown(d, uid, uid)
        sock = podman / "podman.sock"
        sock.write_bytes(b"")
        os.chown(sock, uid, uid)
        with hung_fuse(sock, uid):
            engine = Engine(str(sock), user_runtime=str(runtime))
            assert engine.owner == uid
            answer = within(5, lambda: engine.inspect("x"))
            assert isinstance(answer, EngineError), answer
            assert f"not a socket of uid {uid}" in str(answer)
