"""safefs, and the attacks it exists for, done by a real unprivileged account on real files.

The guard runs as root and writes into trees local users control. Each attack
below is what a user can type (lab/accounts.py runs it as their uid, no
capabilities): swap a directory on the guard's way for a symlink into root's
files, plant a symlink where a temporary file will be, put a FIFO where a
file is read. After each, a snapshot of the victim directory (contents,
owners, modes) must be what it was, and what the guard made must be the
user's.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab.accounts import User, unprivileged_user
from lab.harness import file_tree
from spark_guard.block import files
from spark_guard.block.records import LinkRecord, Record, RecordStore
from spark_guard.block.release import ReleaseError, release
from spark_guard.core.block import Step
from spark_guard.core.config import Config
from spark_guard.core.snapshot import UnitRef
from spark_guard.system.managers import Manager
from spark_guard.system.safefs import MAKEDIRS, Tree, UnsafePath, anchor_stat, read_regular
from spark_guard.system.unitfiles import (
    UnitFileError,
    lay_mask,
    mask_dir,
    owner,
    present,
    read_link,
)
from spark_guard.tools import harden_cli
from spark_guard.tools.harden import MARKER

NO_SOCKET = "/nonexistent/systemd/private"


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    with unprivileged_user() as u:
        yield u


@dataclass
class Layout:
    base: Path
    run_user: Path  # root's, 0755, as logind makes /run/user
    runtime: Path  # the user's, 0700
    victim: Path  # root's files the user must not reach through the guard
    state: Path
    user: User

    @property
    def manager(self) -> str:
        return f"user:{self.user.uid}"

    @property
    def unit_dir(self) -> Path:
        return self.user.home / ".config" / "systemd" / "user"

    @property
    def control(self) -> Path:
        return self.runtime / "systemd" / "user.control"

    def snapshot(self) -> dict[str, tuple[object, ...]]:
        return file_tree(self.victim)


@pytest.fixture
def lay(user: User) -> Iterator[Layout]:
    base = Path(tempfile.mkdtemp(prefix="sg-safefs."))
    base.chmod(0o755)
    run_user = base / "run-user"
    run_user.mkdir(mode=0o755)
    runtime = run_user / str(user.uid)
    runtime.mkdir(mode=0o700)
    os.chown(runtime, user.uid, user.gid)
    victim = base / "victim"
    (victim / "system.control").mkdir(parents=True)
    (victim / "system.control" / "cron.service").symlink_to("/dev/null")  # the admin's mask
    (victim / "etc-system").mkdir()
    (victim / "etc-system" / "cron.service").write_text("[Service]\nExecStart=/usr/sbin/cron\n")
    (victim / "secret").write_text("root's\n")
    (victim / "secret").chmod(0o600)
    state = base / "state"
    state.mkdir(mode=0o700)
    user.sh(f"mkdir -p {runtime}/systemd {user.home}/.config/systemd/user")
    try:
        yield Layout(base, run_user, runtime, victim, state, user)
    finally:
        shutil.rmtree(base)
        shutil.rmtree(user.home / ".config", ignore_errors=True)
        for p in user.home.iterdir():
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def owned_by(path: Path, user: User) -> bool:
    st = path.lstat()
    return (st.st_uid, st.st_gid) == (user.uid, user.gid)


# --- the primitive ----------------------------------------------------------------


@pytest.mark.root
def test_write_replaces_a_file_atomically_with_its_mode_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "a" / "b" / "note"
    Tree("/").write(str(path), b"one\n", mode=0o640, create=MAKEDIRS)
    Tree("/").write(str(path), b"two\n", mode=0o640)
    assert path.read_bytes() == b"two\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(path.parent) == ["note"]
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755
    with pytest.raises(UnsafePath, match=r"no such directory"):
        Tree("/").write(str(tmp_path / "c" / "d" / "note"), b"", create=1)


@pytest.mark.root
def test_a_file_made_in_a_users_tree_is_theirs_and_the_kernel_refuses_them_the_rest(lay):
    user = lay.user
    home = Tree(str(user.home), user.uid, user.gid)
    home.write(f"{user.home}/a/b/f", b"x", create=2)
    for p in (user.home / "a", user.home / "a" / "b", user.home / "a" / "b" / "f"):
        assert owned_by(p, user)
    # A root-owned directory in their home: passed through (root's), but not writable
    # with their rights, whatever the guard's own.
    (user.home / "rootdir").mkdir(mode=0o755)
    with pytest.raises(PermissionError):
        home.write(f"{user.home}/rootdir/f", b"x")
    assert list((user.home / "rootdir").iterdir()) == []


@pytest.mark.root
def test_a_symlink_planted_at_the_temporary_name_is_never_followed(lay, monkeypatch):
    user = lay.user
    before = lay.snapshot()
    monkeypatch.setattr(os, "urandom", lambda _n: bytes.fromhex("c0ffee"))  # the name is known
    user.sh(f"ln -s {lay.victim}/secret {user.home}/.note.c0ffee.tmp")
    with pytest.raises(FileExistsError):  # O_EXCL: no temporary file is shared
        Tree(str(user.home), user.uid, user.gid).write(f"{user.home}/note", b"pwned\n")
    assert lay.snapshot() == before
    assert os.readlink(user.home / ".note.c0ffee.tmp") == f"{lay.victim}/secret"  # theirs, kept
    assert not (user.home / "note").exists()


@pytest.mark.root
def test_a_symlink_at_the_final_name_is_replaced_not_written_through(lay):
    user = lay.user
    before = lay.snapshot()
    user.sh(f"ln -s {lay.victim}/secret {user.home}/note")
    Tree(str(user.home), user.uid, user.gid).write(f"{user.home}/note", b"mine\n", mode=0o600)
    assert lay.snapshot() == before
    note = user.home / "note"
    assert not note.is_symlink() and note.read_bytes() == b"mine\n" and owned_by(note, user)


@pytest.mark.root
def test_a_directory_swapped_for_a_symlink_is_refused_wherever_it_is(lay):
    user = lay.user
    before = lay.snapshot()
    user.sh(f"ln -s {lay.victim} {user.home}/d")
    home = Tree(str(user.home), user.uid, user.gid)
    for attempt in (
        lambda: home.write(f"{user.home}/d/secret", b"x"),
        lambda: home.symlink(f"{user.home}/d/x.service", "/dev/null"),
        lambda: home.unlink(f"{user.home}/d/secret"),
        lambda: home.read(f"{user.home}/d/secret", 100),
        lambda: Tree("/", user.uid, user.gid).lstat(f"{user.home}/d/secret"),
        lambda: Tree("/").write(f"{user.home}/d/secret", b"x"),  # root: their dir refused
    ):
        with pytest.raises(UnsafePath):
            attempt()
    assert lay.snapshot() == before


@pytest.mark.root
def test_roots_own_symlinks_are_followed_from_slash_and_dotdot_resolved(tmp_path):
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "alias").symlink_to("real")
    (tmp_path / "real" / "up").symlink_to("../real/sub")
    Tree("/").write(f"{tmp_path}/alias/up/f", b"x")
    assert (tmp_path / "real" / "sub" / "f").read_bytes() == b"x"
    # Below any other anchor, no symlink at all is followed.
    with pytest.raises(UnsafePath, match=r"'alias' is not a directory \(a symlink\?\)"):
        Tree(str(tmp_path)).write(f"{tmp_path}/alias/g", b"x")


@pytest.mark.root
def test_another_users_directory_is_refused_unless_any_owner_and_never_a_symlink(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 2000, 2000)
    with pytest.raises(UnsafePath, match=r"'other' belongs to uid 2000, not root or 0"):
        Tree("/").write(f"{other}/f.prom", b"x")
    Tree("/", any_owner=True).write(f"{other}/f.prom", b"x")
    assert (other / "f.prom").read_bytes() == b"x"
    (tmp_path / "link").symlink_to(other)
    os.lchown(tmp_path / "link", 2000, 2000)
    with pytest.raises(UnsafePath, match=r"'link' is not a directory"):
        Tree("/", any_owner=True).write(f"{tmp_path}/link/g.prom", b"x")


@pytest.mark.root
def test_a_fifo_a_device_or_a_symlink_is_refused_by_a_read_without_blocking(lay):
    user = lay.user
    user.sh(f"mkfifo {user.home}/fifo; ln -s /dev/zero {user.home}/zero")
    home = Tree(str(user.home), user.uid, user.gid)
    start = time.monotonic()
    with pytest.raises(UnsafePath, match=r"fifo: not a regular file"):
        home.read(f"{user.home}/fifo", 100)
    with pytest.raises(UnsafePath, match=r"zero: a symlink, not a regular file"):
        home.read(f"{user.home}/zero", 100)
    with pytest.raises(UnsafePath, match=r"/dev/zero: not a regular file"):
        read_regular("/dev/zero", 100)
    assert time.monotonic() - start < 5
    assert home.read(f"{user.home}/nothing", 100) is None


@pytest.mark.root
def test_an_anchor_says_its_group_and_must_be_reached_through_roots_directories(lay):
    user = lay.user
    st = anchor_stat(str(lay.runtime))
    assert (st.st_uid, st.st_gid) == (user.uid, user.gid)
    # Above an anchor every directory is root's: the user's own are not a way in.
    user.sh(f"mkdir {user.home}/sub; ln -s {lay.victim} {user.home}/alias")
    with pytest.raises(UnsafePath, match=rf"'{user.name}' is not owned by root"):
        Tree(f"{user.home}/sub", user.uid, user.gid).lstat(f"{user.home}/sub/x")
    with pytest.raises(UnsafePath, match=rf"'{user.name}' is not owned by root"):
        anchor_stat(f"{user.home}/alias/secret")


# --- 1: release and a symlinked *.wants ---------------------------------------------


def blocked_record(lay: Layout, unit: str, links: list[LinkRecord], mask_made: bool) -> Record:
    record = Record(
        unit=unit,
        manager=lay.manager,
        reason="footprint",
        detail="expects 115GiB",
        phase="strict",
        step=Step.BLOCKED,
        mask_path=f"{lay.control}/{unit}",
        mask_made=mask_made,
        links=links,
    )
    RecordStore(str(lay.state)).save(record)
    return record


@pytest.mark.root
def test_release_never_follows_a_users_symlinked_wants_dir_into_etc(lay):
    user = lay.user
    wants = lay.unit_dir / "default.target.wants"
    link = LinkRecord(
        f"{wants}/llama.service", f"{lay.unit_dir}/llama.service", user.uid, user.gid, True
    )
    record = blocked_record(lay, "llama.service", [link], mask_made=False)
    # After the block: the user swaps their *.wants dir for a symlink to /etc/systemd/system.
    user.sh(f"ln -s {lay.victim}/etc-system {wants}")
    before = lay.snapshot()
    store = RecordStore(str(lay.state))
    with pytest.raises(ReleaseError) as e:
        release(record, store, NO_SOCKET, str(lay.run_user))
    assert str(e.value) == (
        f"user:{user.uid}:llama.service: not released, {wants}: 'default.target.wants' "
        "is not a directory (a symlink?)"
    )
    assert lay.snapshot() == before
    assert not os.path.lexists(lay.victim / "etc-system" / "llama.service")
    assert store.load(record.ref) is not None  # still blocked: nothing was changed
    # The same link is not even read when the guard plans a block.
    with pytest.raises(UnitFileError, match=r"'default.target.wants' is not a directory"):
        read_link(link.path, owner(lay.manager, str(lay.run_user)))


@pytest.mark.root
def test_release_puts_back_links_and_wants_dirs_as_the_user_and_removes_the_mask(lay):
    user = lay.user
    wants = lay.unit_dir / "default.target.wants"
    link = LinkRecord(
        f"{wants}/llama.service", f"{lay.unit_dir}/llama.service", user.uid, user.gid, True
    )
    record = blocked_record(lay, "llama.service", [link], mask_made=True)
    assert lay_mask(record.mask_path, owner(lay.manager, str(lay.run_user))) is True
    before = lay.snapshot()
    done = release(record, RecordStore(str(lay.state)), NO_SOCKET, str(lay.run_user))
    assert done.mask_removed and done.restored == [link.path]
    assert os.readlink(link.path) == link.target
    assert owned_by(wants, user) and owned_by(Path(link.path), user)
    assert not os.path.lexists(record.mask_path)
    assert lay.snapshot() == before


# --- 2: harden's drop-in ------------------------------------------------------------


def user_manager(lay: Layout) -> Manager:
    """A Manager as the guard holds it after connecting: its reported UnitPath."""
    manager = Manager(lay.manager, NO_SOCKET)
    manager.unit_path_dirs = (str(lay.control), str(lay.unit_dir), str(lay.victim / "etc-system"))
    return manager


@pytest.mark.root
def test_harden_writes_the_drop_in_in_the_users_home_as_the_user(lay):
    user, ref = lay.user, UnitRef(lay.manager, "llama.service")
    config = Config(state=str(lay.state))
    path, tree = harden_cli._place(ref, user_manager(lay))
    assert path == f"{lay.unit_dir}/llama.service.d/50-spark-guard.conf"
    # The old writer's temporary name was predictable: a symlink planted there stays
    # a symlink to root's file, which nobody touches.
    user.sh(f"mkdir {lay.unit_dir}/llama.service.d")
    user.sh(f"ln -s {lay.victim}/secret {path}.{os.getpid()}.tmp")
    before = lay.snapshot()
    harden_cli._write(path, f"{MARKER}\n[Service]\n", tree, ref, config)
    assert lay.snapshot() == before
    assert owned_by(Path(path), user) and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert Path(path).read_text() == f"{MARKER}\n[Service]\n"
    hardened = lay.state / "hardened" / f"{ref}.json"
    assert hardened.stat().st_uid == 0


@pytest.mark.root
def test_harden_refuses_a_unit_d_symlinked_into_roots_unit_dir(lay):
    user, ref = lay.user, UnitRef(lay.manager, "cron.service")
    config = Config(state=str(lay.state))
    path, tree = harden_cli._place(ref, user_manager(lay))
    user.sh(f"ln -s {lay.victim}/etc-system {lay.unit_dir}/cron.service.d")
    before = lay.snapshot()
    with pytest.raises(UnsafePath, match=r"'cron.service.d' is not a directory"):
        harden_cli._write(path, f"{MARKER}\n", tree, ref, config)
    assert lay.snapshot() == before
    assert not (lay.state / "hardened").exists()


@pytest.mark.root
def test_harden_refuses_a_drop_in_that_is_a_symlink_or_a_fifo(lay):
    user, ref = lay.user, UnitRef(lay.manager, "llama.service")
    path, tree = harden_cli._place(ref, user_manager(lay))
    user.sh(f"mkdir {lay.unit_dir}/llama.service.d; ln -s {lay.victim}/secret {path}")
    with pytest.raises(UnsafePath, match=r"a symlink, not a regular file"):
        tree.read(path, harden_cli.READ_LIMIT)
    user.sh(f"rm {path}; mkfifo {path}")
    with pytest.raises(UnsafePath, match=r"not a regular file"):
        tree.read(path, harden_cli.READ_LIMIT)


@pytest.mark.root
def test_harden_undo_does_not_remove_through_a_swapped_unit_d(lay):
    user, ref = lay.user, UnitRef(lay.manager, "cron.service")
    manager = user_manager(lay)
    config = Config(state=str(lay.state))
    path, tree = harden_cli._place(ref, manager)
    harden_cli._write(path, f"{MARKER}\n", tree, ref, config)
    # Root's unit dir holds a file of that name, by chance or by the admin.
    (lay.victim / "etc-system" / "50-spark-guard.conf").write_text(f"{MARKER}\n")
    user.sh(
        f"rm -r {lay.unit_dir}/cron.service.d; ln -s {lay.victim}/etc-system "
        f"{lay.unit_dir}/cron.service.d"
    )
    before = lay.snapshot()
    with pytest.raises(UnsafePath, match=r"'cron.service.d' is not a directory"):
        harden_cli._undo(ref, manager, config)
    assert lay.snapshot() == before


@pytest.mark.root
def test_harden_writes_only_where_the_managers_unit_path_looks(lay):
    manager = user_manager(lay)
    manager.unit_path_dirs = (str(lay.control), str(lay.victim / "etc-system"))
    with pytest.raises(harden_cli.HardenError, match=r"is not in its UnitPath"):
        harden_cli._place(UnitRef(lay.manager, "x.service"), manager)


# --- 3: the mask, redirected --------------------------------------------------------


@pytest.mark.root
def test_a_user_control_dir_symlinked_to_pid1s_masks_nothing_there(lay):
    user = lay.user
    user.sh(f"ln -s {lay.victim}/system.control {lay.control}")
    before = lay.snapshot()
    who = owner(lay.manager, str(lay.run_user))
    mask = f"{mask_dir(lay.manager, str(lay.run_user))}/ssh.service"
    assert mask == f"{lay.control}/ssh.service"
    with pytest.raises(UnitFileError, match=r"'user.control' is not a directory"):
        lay_mask(mask, who)
    with pytest.raises(UnitFileError, match=r"'user.control' is not a directory"):
        present(mask, who)
    # The way in one level up: their systemd dir swapped for a symlink.
    user.sh(f"rm {lay.control}; mv {lay.runtime}/systemd {lay.runtime}/old")
    user.sh(f"ln -s {lay.victim} {lay.runtime}/systemd")
    with pytest.raises(UnitFileError, match=r"'systemd' is not a directory"):
        lay_mask(f"{lay.runtime}/systemd/system.control/ssh.service", who)
    assert lay.snapshot() == before


@pytest.mark.root
def test_release_of_a_redirected_mask_leaves_the_admins_mask(lay):
    user = lay.user
    record = blocked_record(lay, "cron.service", [], mask_made=True)
    user.sh(f"ln -s {lay.victim}/system.control {lay.control}")
    before = lay.snapshot()
    done = release(record, RecordStore(str(lay.state)), NO_SOCKET, str(lay.run_user))
    assert not done.mask_removed
    assert "mask left alone: " in done.record.history[-2][1]
    assert "'user.control' is not a directory" in done.record.history[-2][1]
    assert lay.snapshot() == before
    assert os.readlink(lay.victim / "system.control" / "cron.service") == "/dev/null"


@pytest.mark.root
def test_the_guard_masks_only_in_its_own_control_dir_whatever_the_unit_path_says(lay, tmp_path):
    config = Config(state=str(tmp_path / "state"), user_runtime=str(lay.run_user))
    record = Record(
        unit="cron.service", manager=lay.manager, reason="r", detail="d", phase="strict"
    )
    manager = Manager(lay.manager, NO_SOCKET)
    manager.unit_path_dirs = (str(lay.victim / "system.control"), str(lay.unit_dir))
    with pytest.raises(UnitFileError, match=rf"{lay.control} is not in its UnitPath"):
        files.plan(record, manager, config.user_runtime, lambda: None)
    # A record naming another mask path is not acted on either.
    record.mask_path = str(lay.victim / "system.control" / "cron.service")
    before = lay.snapshot()
    with pytest.raises(UnitFileError, match=r"not where a mask goes"):
        files.mask(record, config.user_runtime)
    record.mask_path = f"{lay.control}/cron.service"
    files.mask(record, config.user_runtime)
    assert os.readlink(record.mask_path) == "/dev/null"
    assert owned_by(Path(record.mask_path), lay.user) and owned_by(lay.control, lay.user)
    assert lay.snapshot() == before
