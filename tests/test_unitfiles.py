"""The guard's own file changes, on a real filesystem: masks, link restore, and refusals."""

from __future__ import annotations

import os

import pytest

from spark_guard.unitfiles import (
    Link,
    UnitFileError,
    lay_mask,
    read_link,
    remove_mask,
    restore_conflict,
    restore_link,
    shadowing_file,
)


def test_a_mask_is_laid_once_and_removed_only_while_it_is_ours(tmp_path):
    control = tmp_path / "user.control"
    assert lay_mask(str(control), "llama.service", 0, 0) is True
    assert os.readlink(control / "llama.service") == "/dev/null"
    assert oct(control.stat().st_mode & 0o777) == "0o755"
    assert lay_mask(str(control), "llama.service", 0, 0) is False  # already there
    (control / "llama.service").unlink()
    (control / "llama.service").symlink_to("/etc/elsewhere")
    with pytest.raises(UnitFileError, match=r"llama.service: in the way of the mask"):
        lay_mask(str(control), "llama.service", 0, 0)
    assert remove_mask(str(control / "llama.service"), 0) is False  # not ours: left alone
    assert os.readlink(control / "llama.service") == "/etc/elsewhere"


def test_a_user_mask_and_its_directory_belong_to_the_user(tmp_path):
    runtime = tmp_path / "run-user-1000" / "systemd"
    runtime.mkdir(parents=True)
    os.chown(runtime, 1000, 1000)
    assert lay_mask(str(runtime / "user.control"), "x.service", 1000, 1000)
    for p in (runtime / "user.control", runtime / "user.control" / "x.service"):
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (1000, 1000)


def test_a_path_through_someone_elses_directory_is_refused(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, 2000, 2000)
    with pytest.raises(UnitFileError, match=r"belongs to uid 2000, not root or 1000: refusing"):
        lay_mask(str(other / "user.control"), "x.service", 1000, 1000)
    assert not (other / "user.control").exists()


def test_a_symlinked_directory_is_followed_only_where_it_resolves_safely(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    assert lay_mask(str(tmp_path / "alias"), "x.service", 0, 0)
    assert (real / "x.service").is_symlink()


def test_a_link_is_restored_with_its_target_and_owner(tmp_path):
    wants = tmp_path / "default.target.wants"
    wants.mkdir()
    os.chown(wants, 1000, 1000)
    path = wants / "llama.service"
    path.symlink_to("/home/a/.config/systemd/user/llama.service")
    os.lchown(path, 1000, 1000)
    before = read_link(str(path), 1000)
    assert before == Link(str(path), "/home/a/.config/systemd/user/llama.service", 1000, 1000)
    path.unlink()
    assert restore_conflict(before, 1000) is None
    assert restore_link(before, 1000) is True
    assert read_link(str(path), 1000) == before
    assert restore_link(before, 1000) is False  # already back


def test_a_link_is_not_restored_over_something_else(tmp_path):
    link = Link(str(tmp_path / "x.service"), "/etc/systemd/system/x.service", 0, 0)
    (tmp_path / "x.service").symlink_to("/srv/other.service")
    assert restore_conflict(link, 0) == (
        f"{link.path} now points to /srv/other.service, not /etc/systemd/system/x.service"
    )
    with pytest.raises(UnitFileError, match=r"now points to /srv/other\.service"):
        restore_link(link, 0)


def test_a_wants_directory_that_was_removed_is_made_again(tmp_path):
    link = Link(str(tmp_path / "multi-user.target.wants" / "x.service"), "/etc/x.service", 0, 0)
    assert restore_link(link, 0) is True
    assert os.readlink(link.path) == "/etc/x.service"


def test_a_file_in_a_higher_directory_outranks_the_mask(tmp_path):
    dirs = tuple(str(tmp_path / d) for d in ("persistent.control", "runtime.control", "etc"))
    for d in dirs:
        os.mkdir(d)
    (tmp_path / "etc" / "x.service").write_text("[Service]\n")
    assert shadowing_file(dirs, dirs[1], "x.service") is None
    (tmp_path / "persistent.control" / "x.service").write_text("[Service]\n")
    assert shadowing_file(dirs, dirs[1], "x.service") == f"{dirs[0]}/x.service"
