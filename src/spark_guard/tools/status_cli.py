"""`spark-guard status`: what the running guard sees and has done, as it published it.

Reads <runtime>/state.json; never senses or decides itself. Exit 3 when no
guard is publishing (no state, or state older than STALE seconds), as systemctl's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import config as config_mod
from ..core.quantities import format_size
from ..core.text import printable as p
from ..exits import CANNOT_SAY, NOT_RUNNING
from ..jsonout import emit
from ..statefile import PublishedState, read

STALE = 180.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON document (--json=short: on one line; schemas in docs/json.md)",
    )


def run(args: argparse.Namespace) -> int:
    config = config_mod.load_for_command(args.config)
    if config is None:
        return 2
    path = os.path.join(config.runtime, "state.json")
    try:
        state = read(config.runtime)
    except FileNotFoundError:
        print(f"spark-guard: not running: {path} does not exist", file=sys.stderr)
        return NOT_RUNNING
    except PermissionError:
        print(
            f"spark-guard: {path} is readable by root and group adm only (it names what "
            "every user loads): run status as root, or as a member of adm",
            file=sys.stderr,
        )
        return CANNOT_SAY
    except (OSError, ValueError) as e:
        print(f"spark-guard: {path}: cannot read: {e}", file=sys.stderr)
        return CANNOT_SAY
    try:
        age = _age(state)
        alive = age < STALE and _alive(int(state.get("pid", 0)))
        if args.json:
            emit({**state, "age": round(age, 1), "alive": alive}, args.json)
        else:
            _print(state, age, alive)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # A state.json of another shape than this version writes: one line, no traceback.
        print(f"spark-guard: {path}: not as this spark-guard writes it: {p(e)}", file=sys.stderr)
        return CANNOT_SAY
    return 0 if alive else NOT_RUNNING


def _age(state: PublishedState) -> float:
    """Seconds since the state was written, on the boot clock: a step of the wall clock
    (NTP at boot) neither kills a live guard nor revives a dead one. state.json is in
    /run, so it is of this boot; one written before the boot stamp existed: the wall."""
    boot = state.get("written_boot")
    if isinstance(boot, int | float) and not isinstance(boot, bool):
        return time.clock_gettime(time.CLOCK_BOOTTIME) - float(boot)
    return time.time() - float(state.get("written_at", 0))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _print_unified(s: PublishedState) -> None:
    """Unified memory: what a GPU allocation can get, beside MemAvailable. A state written
    by a guard older than the unified-memory figures has none of these keys: nothing is shown."""
    free = s.get("mem_free")
    if not s.get("unified") or free is None:
        return
    huge = s.get("huge_free")
    print(
        f"unified memory: MemFree {format_size(free)} (device floor "
        f"{format_size(s.get('floor', 0))}), clean page cache "
        f"{format_size(s.get('file_clean', 0))}, free in 2 MiB blocks "
        + (format_size(huge) if huge is not None else "unknown")
        + f"; device headroom {format_size(s.get('headroom', 0))}"
    )
    if s.get("pinned"):
        print(f"  pinned long-term: {format_size(s['pinned'] or 0)}")
    room = dict(s.get("room_made") or {})
    freed = room.pop("freed_bytes", 0)
    made = ", ".join(f"{p(how)} {n}" for how, n in sorted(room.items())) or "none"
    print(f"  room made since start: {made}; MemFree gained {format_size(freed)}")


def _counts(s: PublishedState, key: str) -> dict[str, int]:
    """left_out[key] of state.json, where it is one (not in a file from before it)."""
    left_out: object = s.get("left_out")
    got = left_out.get(key) if isinstance(left_out, dict) else None
    return {str(m): n for m, n in got.items() if type(n) is int} if isinstance(got, dict) else {}


def _more(left_out: dict[str, int], where: str) -> None:
    """The rows state.json leaves out past its PER_MANAGER of each manager, counted."""
    for manager, n in sorted(left_out.items()):
        print(f"  ... and {n} more of {p(manager)} ({where})")


def _print(s: PublishedState, age: float, alive: bool) -> None:
    # Units, reasons, details, predictions and problems can hold a user's text: each is
    # printed through p() so no escape sequence or line break of theirs reaches the terminal.
    head = f"running (pid {s['pid']})" if alive else f"NOT RUNNING (last state from pid {s['pid']})"
    print(
        f"spark-guard: {head}, state {age:.0f}s old; phase {p(s['phase'])}"
        + (" (dry run)" if s.get("dry_run") else "")
    )
    if s.get("config_error"):
        print(f"CONFIG ERROR, built-in defaults in use: {p(s['config_error'])}")
    if s.get("managers") == []:  # (a state.json from before the field: not said)
        print(
            "NO SYSTEMD MANAGER REACHED: the guard watches memory but sees no unit and "
            "can stop none (systemd not PID 1, or no right to its private socket)"
        )
    print(
        f"MemAvailable {format_size(s['mem_available'])} of {format_size(s['mem_total'])}, "
        f"reserve {format_size(s['reserve'])}, trend {format_size(s['slope'])}/s, "
        f"GPU accounting {'on' if s.get('gpu_accounting') else 'off'}"
        + (" (stale: NVML does not answer)" if s.get("gpu_stale") else "")
    )
    _print_unified(s)
    loaders = s.get("loaders", [])
    left_out = {key: _counts(s, key) for key in ("loaders", "blocked")}
    print(f"\nloaders ({len(loaders) + sum(left_out['loaders'].values())}):")
    for ld in loaders:
        size = ld.get("expected")
        expected = (
            f"{format_size(size)} ({p(ld['expected_from'])})"
            if size is not None
            else f"unknown ({p(ld.get('prediction') or 'no size')})"
        )
        state = "starting" if ld.get("starting") else p(ld["active_state"])
        box = f"; image {p(ld['image'])}, restart {p(ld['restart'])}" if ld.get("restart") else ""
        # Without NVML a GPU figure of 0 is no figure: said so, not shown as 0B.
        gpu = f"{format_size(ld['gpu'])} GPU" if s.get("gpu_accounting") else "GPU not counted"
        print(
            f"  {p(ld['unit'])}: {state}; expected {expected}; holds "
            f"{format_size(ld['rss'])} RSS + {gpu}{box}"
        )
    _more(left_out["loaders"], "the biggest of each manager are listed")
    blocked = s.get("blocked", [])
    print(f"\nblocked ({len(blocked) + sum(left_out['blocked'].values())}):")
    for b in blocked:
        print(
            f"  {p(b['unit'])}: {p(b['step'])} since {p(b['at'])}: "
            f"{p(b['reason'])}: {p(b['detail'])}"
        )
        if b.get("restart_was"):
            print(f"    restart policy no (was {p(b['restart_was'])})")
        if b.get("problem"):
            print(f"    problem: {p(b['problem'])}")
    _more(left_out["blocked"], "spark-guard release --all --dry-run lists every one")
    if blocked:
        print("  undo: spark-guard release UNIT (or --all)")
    print(f"\nlast action: {p(s.get('last_action', 'none'))}")
