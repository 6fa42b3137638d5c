"""Whose a process is (core/attribution.py), as plain data: a cgroup path, the managers'
roots, a uid. No /proc, no manager: what the sensor reads is handed in."""

from __future__ import annotations

from spark_guard.core import attribution
from spark_guard.core.snapshot import UnitRef

ROOTS = {"system": "/", "user:1000": "/user.slice/user-1000.slice/user@1000.service"}
HERS = ROOTS["user:1000"]


def owner(cgroup: str, uid: int | None, guard: UnitRef | None = None) -> tuple[str, str, str]:
    found = attribution.owner(cgroup, ROOTS, lambda: uid, guard)
    assert found is not None
    return str(found.ref), found.cgroup, found.group


def test_the_deepest_managers_root_wins():
    assert attribution.attribute(f"{HERS}/app.slice/llama.service/x", ROOTS) == (
        "user:1000",
        "llama.service",
    )
    assert attribution.attribute("/system.slice/ollama.service", ROOTS) == (
        "system",
        "ollama.service",
    )
    assert attribution.attribute("/system.slice", ROOTS) is None  # a slice is no unit


def test_a_service_is_its_own_whoever_runs_it():
    assert owner("/system.slice/llama.service/payload", 1000) == (
        "llama.service",
        "/system.slice/llama.service",
        "",
    )


def test_a_users_processes_in_a_scope_of_roots_are_a_group_of_hers():
    scope = "/user.slice/user-1000.slice/session-3.scope"
    assert owner(scope, 1000) == (
        f"user:1000:{scope}",
        scope,
        "uid 1000's processes in " + scope.split("/")[-1],
    )
    # Root's own, or a system user's (DynamicUser=, 61200), stay the scope's.
    assert owner(scope, 0)[0] == "session-3.scope"
    assert owner(scope, 61200)[0] == "session-3.scope"


def test_her_scope_in_her_manager_is_hers_and_her_unit_is_a_unit():
    scope = f"{HERS}/app.slice/run-r1.scope"
    assert owner(scope, 1000) == ("user:1000:run-r1.scope", scope, "her run-r1.scope")
    assert owner(f"{HERS}/app.slice/llama.service", 1000)[0] == "user:1000:llama.service"


def test_with_her_manager_out_of_view_her_tree_is_still_hers():
    roots = {"system": "/"}  # her manager not connected: PID 1 sees user@1000.service
    unit = f"{HERS}/app.slice/llama.service"
    found = attribution.owner(f"{unit}/x", roots, lambda: 1000)
    assert found is not None and (str(found.ref), found.cgroup) == ("user:1000:llama.service", unit)
    # Root's setuid helper in her tree is left to PID 1's unit; her uid is read only there.
    found = attribution.owner(unit, roots, lambda: 0)
    assert found is not None and str(found.ref) == "user@1000.service"
    asked: list[int] = []

    def uid() -> int:
        asked.append(1)
        return 0

    attribution.owner("/system.slice/llama.service", roots, uid)
    assert asked == []  # a service is its own: no uid read


def test_a_process_in_user_at_uid_service_itself_is_hers_never_pid1s():
    """H3 (issue 40): her delegation lets her put a process in user@UID.service itself, not
    below it (her subtree_control cleared on pure v2). It counted for PID 1's protected
    unit, and below the reserve another user's loader was stopped in its place. Hers,
    whichever manager answers, but root's own (a setuid helper), left to PID 1's unit."""
    for roots in ({"system": "/"}, {"system": "/", "user:1000": HERS}, {}):
        found = attribution.owner(HERS, roots, lambda: 1000)
        assert found is not None, roots
        assert (str(found.ref), found.cgroup, found.group) == (
            f"user:1000:{HERS}",
            HERS,
            "processes in user@1000.service itself",
        ), roots
    found = attribution.owner(HERS, {"system": "/"}, lambda: 0)
    assert found is not None and str(found.ref) == "user@1000.service"


def test_the_guards_own_unit_is_never_split():
    guard = UnitRef("system", "spark-guard.service")
    groups: dict[UnitRef, list[attribution.Proc]] = {guard: [(1, 10, None), (2, 10, None)]}
    split, _, what, _ = attribution.split_jobs(groups, {}, lambda p, _: {1: 0, 2: 1000}[p], guard)
    assert split == groups and what == {}
