"""Manager keys and unit references: plain text in, plain data out."""

from __future__ import annotations

import pytest

from spark_guard.core.snapshot import SYSTEM, UnitRef, manager_uid, parse_ref


def test_a_manager_key_names_its_uid():
    assert manager_uid(SYSTEM) == 0
    assert manager_uid("user:0") == 0
    assert manager_uid("user:1000") == 1000


@pytest.mark.parametrize(
    "key", ["", "System", "user", "user:", "user:-1", "user:+1", "user: 1", "user:1:x", "root:0"]
)
def test_anything_else_is_not_a_manager_key(key: str):
    with pytest.raises(ValueError, match="not a manager key"):
        manager_uid(key)


def test_parse_ref_takes_the_manager_from_the_text_or_the_default():
    assert parse_ref("llama", SYSTEM) == UnitRef(SYSTEM, "llama.service")
    assert parse_ref("user:1000:x.socket", SYSTEM) == UnitRef("user:1000", "x.socket")
    assert parse_ref("x.service", "user:1000") == UnitRef("user:1000", "x.service")
    # Taken as written: whether that manager exists is for connecting to say.
    assert parse_ref("user:abc:x", SYSTEM) == UnitRef("user:abc", "x.service")
    # A group of a user's processes is named by its cgroup, whose name is hers (':' in it
    # too): no unit type is added.
    hideout = "/user.slice/user-1000.slice/user@1000.service/hide:out"
    assert parse_ref(f"user:1000:{hideout}", SYSTEM) == UnitRef("user:1000", hideout)
