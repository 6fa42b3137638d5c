"""The house's shape, checked: the limits of the developers' brief on src/ itself.

No module over 600 lines; no class over 20 methods or 400 lines, or setting more than 8
of its attributes after construction; no function over 60 lines; `core/` pure (it
imports nothing that does I/O: not system/, block/, sense/ or the daemon). What was over
a limit when these checks came in is a debt, listed with its size: a debt may only
shrink (the test fails when one grows, and asks for its entry to be lowered when it
shrank), and new code must be within the limits.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "spark_guard"
MODULE_LINES, CLASS_METHODS, CLASS_LINES, FUNCTION_LINES = 600, 20, 400, 60

# module -> lines
MODULE_DEBTS = {
    "core/argv/loadspec.py": 790,
    "core/argv/ollama.py": 741,
    "foresight/lmstudio.py": 673,
    "foresight/predict.py": 708,
    "foresight/safetensors.py": 735,
    "system/engine.py": 644,
    "system/managers.py": 567,
    "tools/doctor/judge.py": 618,
}
# module:class -> (methods, lines)
CLASS_DEBTS = {
    "daemon.py:Guard": (21, 483),
    "system/managers.py:Manager": (30, 341),
}
# module:function -> lines (the longest of that name in the module)
FUNCTION_DEBTS = {
    "block/blocker.py:block": 81,
    "block/blocker.py:_run": 70,
    "block/containers.py:block": 83,
    "block/release.py:release": 65,
    "core/argv/lmstudio.py:_load": 79,
    "core/classify.py:classify": 65,
    "core/config.py:parse": 72,
    "core/policy.py:decide": 153,
    "daemon.py:__init__": 63,
    "daemon.py:_pass": 64,
    "foresight/gguf.py:read_model": 64,
    "foresight/lmstudio.py:_match": 65,
    "foresight/lmstudio.py:predict": 67,
    "foresight/ollama.py:load_spec": 75,
    "foresight/predict.py:for_spec": 79,
    "metrics.py:registry": 135,
    "sense/sensor.py:snapshot": 85,
    "sense/units.py:seen": 80,
    "sense/foresee.py:_foresee_unit": 61,
    "statefile.py:build": 79,
    "system/cgroupfs.py:kill_uid": 73,
    "system/gpu.py:inspect": 63,
    "tools/audit.py:loader_findings": 113,
    "tools/audit_cli.py:_print": 72,
    "tools/doctor/judge.py:classify": 83,
    "tools/doctor/judge.py:nv_no_memory_findings": 79,
    "tools/doctor/judge.py:card_findings": 91,
    "tools/doctor/judge.py:application_findings": 116,
    "tools/release_cli.py:run": 73,
    "tools/rescue_cli.py:run": 77,
    "tools/rescue_cli.py:_report": 74,
}
# What core/ may not import: the parts that read or change the machine.
IMPURE = ("system", "block", "sense", "daemon", "tools", "foresight", "journal", "metrics")


def modules() -> dict[str, tuple[str, ast.Module]]:
    return {
        str(p.relative_to(SRC)): (text := p.read_text(), ast.parse(text))
        for p in sorted(SRC.rglob("*.py"))
    }


def measure() -> tuple[dict[str, int], dict[str, tuple[int, int]], dict[str, int]]:
    lines: dict[str, int] = {}
    classes: dict[str, tuple[int, int]] = {}
    functions: dict[str, int] = {}
    for name, (text, tree) in modules().items():
        lines[name] = text.count("\n")
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                methods = sum(
                    isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body
                )
                classes[f"{name}:{node.name}"] = (methods, size)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key = f"{name}:{node.name}"
                functions[key] = max(functions.get(key, 0), size)
    return lines, classes, functions


def over(measured: dict[str, int], limit: int, debts: dict[str, int]) -> list[str]:
    """What breaks the limit beyond its debt, and debts that shrank (to be lowered)."""
    out = []
    for key, size in sorted(measured.items()):
        allowed = debts.get(key, limit)
        if size > max(limit, allowed):
            out.append(f"{key}: {size} (allowed {max(limit, allowed)})")
        elif key in debts and size < debts[key]:
            out.append(f"{key}: {size}, below its debt {debts[key]}: lower the entry")
    out += [f"{key}: listed as a debt, but gone" for key in debts if key not in measured]
    return out


def test_no_module_grows_past_its_limit_or_its_debt():
    lines, _, _ = measure()
    assert over(lines, MODULE_LINES, MODULE_DEBTS) == []


def test_no_class_grows_past_its_limits_or_its_debt():
    _, classes, _ = measure()
    methods = {k: m for k, (m, _) in classes.items()}
    sizes = {k: n for k, (_, n) in classes.items()}
    assert over(methods, CLASS_METHODS, {k: m for k, (m, _) in CLASS_DEBTS.items()}) == []
    assert over(sizes, CLASS_LINES, {k: n for k, (_, n) in CLASS_DEBTS.items()}) == []


def test_no_function_grows_past_its_limit_or_its_debt():
    _, _, functions = measure()
    assert over(functions, FUNCTION_LINES, FUNCTION_DEBTS) == []


def test_core_decides_and_does_no_io():
    found = []
    for name, (_, tree) in modules().items():
        if not name.startswith("core/"):
            continue
        depth = name.count("/")  # core/x.py: 1; core/argv/x.py: 2
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                up = node.level - depth  # 1: it reaches spark_guard/ (0: core/ itself)
                target = (node.module or "").split(".")[0]
                if up >= 1 and target in IMPURE:
                    found.append(f"{name}: from {'.' * node.level}{node.module}")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                found += [
                    f"{name}: import {n}"
                    for n in names
                    if n.startswith("spark_guard.") and n.split(".")[1] in IMPURE
                ]
    assert found == []


def test_the_checks_catch_what_they_are_for():
    # A debt that grew, a new module over the limit, a debt paid off, a debt gone.
    assert over({"a.py": 611, "b.py": 601, "c.py": 700}, 600, {"a.py": 610, "c.py": 700}) == [
        "a.py: 611 (allowed 610)",
        "b.py: 601 (allowed 600)",
    ]
    assert over({"a.py": 11}, 600, {"a.py": 610, "d.py": 700}) == [
        "a.py: 11, below its debt 610: lower the entry",
        "d.py: listed as a debt, but gone",
    ]


def assigned(node: ast.AST) -> list[ast.expr]:
    """What a statement assigns to (none, for anything but an assignment)."""
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []


def pokes(tree: ast.Module) -> list[str]:
    """Assignments to another object's attribute: `self.x.y = ...` (or deeper)."""
    found: list[str] = []
    for node in ast.walk(tree):
        found += [
            f"line {t.lineno}: {ast.unparse(t)}"
            for t in assigned(node)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
        ]
    return found


def test_the_daemon_sets_no_attribute_of_another_component():
    # It hands them what they need (a snapshot's memory, the room's worth, a new config)
    # through their methods; a poke would be state no test of theirs sees change.
    _, tree = modules()["daemon.py"]
    assert pokes(tree) == []
    assert pokes(ast.parse("self.sensor.room_possible = False\nself.x = 1")) == [
        "line 1: self.sensor.room_possible"
    ]


# A class whose state changes in many places is a machine no one can follow: no more than
# this many of its attributes are set after its construction. class -> such attributes
# (a debt: it may only shrink).
CHANGED_ATTRIBUTES = 8
CHANGED_DEBTS = {"daemon.py:Guard": 17}


def changed_after_construction(cls: ast.ClassDef) -> set[str]:
    """The attributes of `self` a method other than __init__/__post_init__ assigns."""
    names: set[str] = set()
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name in ("__init__", "__post_init__"):
            continue
        for node in ast.walk(fn):
            for t in assigned(node):
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and ast.unparse(e.value) == "self":
                        names.add(e.attr)
    return names


def test_no_class_changes_more_than_eight_of_its_attributes_after_construction():
    counts = {
        f"{name}:{node.name}": len(changed_after_construction(node))
        for name, (_, tree) in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    assert over(counts, CHANGED_ATTRIBUTES, CHANGED_DEBTS) == []
    sample = ast.parse(
        "class A:\n def __init__(self): self.a = 1\n def f(self): self.b, self.c = 1, 2"
    )
    assert changed_after_construction(sample.body[0]) == {"b", "c"}  # type: ignore[arg-type]


# The executors of the stop machine (core/stops.py): they read, carry out and keep, and
# what follows a stop or is said of it is the machine's. (block/blocker.py, boxes.py and
# files.py still name a block's steps themselves: the next to move into the machine.)
EXECUTORS = ("block/loose.py", "block/kernel.py", "block/settle.py", "block/pauses.py")


def test_the_stop_executors_name_no_step_and_build_no_event():
    found = []
    for name in EXECUTORS:
        _, tree = modules()[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("Step", "Event"):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "Event":
                found.append(f"{name}:{node.lineno}: Event(...)")
    assert found == []


def test_every_step_change_a_block_makes_is_chosen_in_core():
    # The executors carry out a step change core/block.py chose (forward, running_again,
    # mask_gone, verified); none names the step it moves a record to.
    found = []
    for name, (_, tree) in modules().items():
        if not name.startswith("block/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".move"):
                named = [a for a in node.args if ast.unparse(a).startswith("Step.")]
                found += [f"{name}:{node.lineno}: {ast.unparse(node)}" for _ in named]
    assert found == []


# The components whose private methods no test may call: a test checks what a user would,
# through what they offer. test file -> such calls (a debt: it may only shrink).
COMPONENTS = (
    "blocker",
    "sensor",
    "units",
    "watch",
    "brake",
    "brakes",
    "loose",
    "kernel",
    "ledger",
    "settler",
    "boxes",
    "pauses",
)
PRIVATE_CALL_DEBTS: dict[str, int] = {}


def private_calls(tree: ast.Module) -> int:
    return sum(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("_")
        and not node.func.attr.startswith("__")
        and ast.unparse(node.func.value).split(".")[-1] in COMPONENTS
        for node in ast.walk(tree)
    )


def test_no_test_calls_a_private_method_of_the_sensor_the_executors_or_the_brake():
    tests = Path(__file__).resolve().parent
    counts = {
        p.name: n
        for p in sorted(tests.glob("test_*.py"))
        if (n := private_calls(ast.parse(p.read_text())))
    }
    assert over(counts, 0, PRIVATE_CALL_DEBTS) == []
    assert private_calls(ast.parse("guard.blocker._run([])\nblocker.run()\nx._y()")) == 1
