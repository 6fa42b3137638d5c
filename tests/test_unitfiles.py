"""The guard's own file changes, on a real filesystem: masks, link restore, and refusals.

Root's cases run in pytest's temporary directories (root's); a user's run with
a real unprivileged account (lab/accounts.py) in a runtime root and home
laid out as on a machine. The attacks on these functions: tests/test_safefs.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.accounts import User, unprivileged_user
from spark_guard.system.safefs import Tree
from spark_guard.system.unitfiles import (
    Link,
    Owner,
    UnitFileError,
    lay_mask,
    mask_dir,
    owner,
    present,
    read_link,
    remove_mask,
    restore_conflict,
    restore_link,
    shadowing_file,
)

ROOT = Owner(0, 0, Tree("/"), Tree("/"))


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    with unprivileged_user() as u:
        yield u


@pytest.fixture
def run_user(user: User) -> Iterator[Path]:
    """A runtime root as logind makes it: root's, with the user's own 0700 dir in it."""
    base = Path(tempfile.mkdtemp(prefix="sg-run-user."))
    base.chmod(0o755)
    runtime = base / str(user.uid)
    runtime.mkdir(mode=0o700)
    os.chown(runtime, user.uid, user.gid)
    user.sh(f"mkdir -p {runtime}/systemd")
    try:
        yield base
    finally:
        shutil.rmtree(base)


@pytest.mark.root
def test_a_mask_is_laid_once_and_removed_only_while_it_is_ours(tmp_path):
    mask = str(tmp_path / "system.control" / "llama.service")
    assert lay_mask(mask, ROOT) is True
    assert os.readlink(mask) == "/dev/null"
    assert oct((tmp_path / "system.control").stat().st_mode & 0o777) == "0o755"
    assert lay_mask(mask, ROOT) is False  # already there
    os.unlink(mask)
    os.symlink("/etc/elsewhere", mask)
    with pytest.raises(UnitFileError, match=r"llama.service: in the way of the mask"):
        lay_mask(mask, ROOT)
    assert remove_mask(mask, ROOT) is False  # not ours: left alone
    assert os.readlink(mask) == "/etc/elsewhere"
    os.unlink(mask)
    Path(mask).write_text("[Unit]\n")
    assert remove_mask(mask, ROOT) is False


def test_the_mask_goes_where_the_guard_says_not_where_a_manager_says():
    assert mask_dir("system", "/run/user") == "/run/systemd/system.control"
    assert mask_dir("user:1000", "/run/user/") == "/run/user/1000/systemd/user.control"


@pytest.mark.root
def test_a_user_mask_and_its_directory_belong_to_the_user(user, run_user):
    who = owner(f"user:{user.uid}", str(run_user))
    assert (who.uid, who.gid, who.runtime.anchor) == (user.uid, user.gid, f"{run_user}/{user.uid}")
    assert who.home is None  # the daemon never writes into a home
    mask = mask_dir(f"user:{user.uid}", str(run_user)) + "/x.service"
    assert not present(mask, who)
    assert lay_mask(mask, who) is True
    assert present(mask, who)
    for p in (Path(mask).parent, Path(mask)):
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (user.uid, user.gid)
    assert remove_mask(mask, who) is True and not os.path.lexists(mask)


@pytest.mark.root
def test_a_mask_outside_the_users_runtime_dir_is_refused(user, run_user, tmp_path):
    who = owner(f"user:{user.uid}", str(run_user))
    with pytest.raises(UnitFileError, match=rf"^{tmp_path}/x.service: outside {run_user}/"):
        lay_mask(str(tmp_path / "x.service"), who)
    assert not (tmp_path / "x.service").exists()


@pytest.mark.root
def test_a_path_through_someone_elses_directory_is_refused(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 2000, 2000)
    with pytest.raises(UnitFileError, match=r"'other' belongs to uid 2000, not root or 0"):
        lay_mask(str(other / "system.control" / "x.service"), ROOT)
    assert not (other / "system.control").exists()


@pytest.mark.root
def test_roots_own_symlinked_directory_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    assert lay_mask(str(tmp_path / "alias" / "x.service"), ROOT)
    assert (real / "x.service").is_symlink()


@pytest.mark.root
def test_a_link_is_restored_with_its_target_and_owner(user, run_user):
    unit_dir = user.home / ".config" / "systemd" / "user"
    user.sh(f"mkdir -p {unit_dir}/default.target.wants")
    path = unit_dir / "default.target.wants" / "llama.service"
    user.sh(f"ln -s {unit_dir}/llama.service {path}")
    who = owner(f"user:{user.uid}", str(run_user), home=True)
    before = read_link(str(path), who)
    assert before == Link(str(path), f"{unit_dir}/llama.service", user.uid, user.gid)
    path.unlink()
    assert restore_conflict(before, who) is None
    assert restore_link(before, who) is True
    assert read_link(str(path), who) == before
    assert restore_link(before, who) is False  # already back


@pytest.mark.root
def test_a_wants_directory_that_was_removed_is_made_again_by_its_owner(user, run_user):
    unit_dir = user.home / ".config" / "systemd" / "user"
    user.sh(f"mkdir -p {unit_dir}")
    who = owner(f"user:{user.uid}", str(run_user), home=True)
    link = Link(str(unit_dir / "default.target.wants" / "x.service"), "/srv/x.service", 0, 0)
    assert restore_conflict(link, who) is None
    assert restore_link(link, who) is True
    for p in (unit_dir / "default.target.wants", Path(link.path)):
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (user.uid, user.gid)
    assert oct((unit_dir / "default.target.wants").stat().st_mode & 0o777) == "0o755"
    # Nothing above the *.wants dir is made: that is not how a link went away.
    gone = Link(str(user.home / "nope" / "a.wants" / "x.service"), "/srv/x.service", 0, 0)
    assert restore_conflict(gone, who) == (
        f"{user.home}/nope: no such directory, so {gone.path} cannot be put back"
    )


@pytest.mark.root
def test_a_link_is_not_restored_over_something_else(tmp_path):
    link = Link(str(tmp_path / "x.service"), "/etc/systemd/system/x.service", 0, 0)
    (tmp_path / "x.service").symlink_to("/srv/other.service")
    assert restore_conflict(link, ROOT) == (
        f"{link.path} now points to /srv/other.service, not /etc/systemd/system/x.service"
    )
    with pytest.raises(UnitFileError, match=r"now points to /srv/other\.service"):
        restore_link(link, ROOT)


@pytest.mark.root
def test_a_link_outside_the_users_trees_is_refused_and_named(user, run_user, tmp_path):
    who = owner(f"user:{user.uid}", str(run_user), home=True)
    link = Link(str(tmp_path / "multi-user.target.wants" / "x.service"), "/etc/x", 0, 0)
    why = (
        f"{link.path}: outside {run_user}/{user.uid} or {user.home}: not changed for uid {user.uid}"
    )
    assert restore_conflict(link, who) == why
    with pytest.raises(UnitFileError, match="outside"):
        restore_link(link, who)
    assert not (tmp_path / "multi-user.target.wants").exists()


@pytest.mark.root
def test_a_wants_directory_of_root_that_was_removed_is_made_again(tmp_path):
    link = Link(str(tmp_path / "multi-user.target.wants" / "x.service"), "/etc/x.service", 0, 0)
    assert restore_link(link, ROOT) is True
    assert os.readlink(link.path) == "/etc/x.service"


@pytest.mark.root
def test_a_file_in_a_higher_directory_outranks_the_mask(tmp_path):
    dirs = tuple(str(tmp_path / d) for d in ("persistent.control", "runtime.control", "etc"))
    for d in dirs:
        os.mkdir(d)
    (tmp_path / "etc" / "x.service").write_text("[Service]\n")
    assert shadowing_file(dirs, dirs[1], "x.service", ROOT) is None
    (tmp_path / "persistent.control" / "x.service").write_text("[Service]\n")
    assert shadowing_file(dirs, dirs[1], "x.service", ROOT) == f"{dirs[0]}/x.service"


@pytest.mark.root
def test_a_user_without_a_runtime_dir_has_no_trees_for_the_daemon(user, run_user):
    shutil.rmtree(run_user / str(user.uid))  # logged out
    with pytest.raises(UnitFileError, match=rf"^{run_user}/{user.uid}: .*'s runtime dir\)$"):
        owner(f"user:{user.uid}", str(run_user))
    # release (home=True) goes on: their masks went with the runtime dir.
    who = owner(f"user:{user.uid}", str(run_user), home=True)
    assert who.home is not None and who.home.anchor == str(user.home)
    mask = mask_dir(f"user:{user.uid}", str(run_user)) + "/x.service"
    assert remove_mask(mask, who) is False
