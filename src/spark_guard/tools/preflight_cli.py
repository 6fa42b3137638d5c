"""`spark-guard preflight UNIT | MODEL.gguf`: the estimate, the room, the verdict.

For a unit, its ExecStart= and Environment= come from its manager (PID 1, or
`user:UID:` units' own manager; run as a user, the user's own manager), and
[loaders.footprint] wins over the estimate as in the guard. A client unit (`lms
load`, `ollama run`, a curl preload) is predicted where its load lands, and the
server unit it is charged to (policy.charge_clients) is named. The rule each
figure comes from (Prediction.source, the spec's rule and notes) is shown. For a model file,
llama-server's defaults apply unless flags say otherwise. Exit status: 0 it
fits, 1 it does not, 2 it cannot be told (the message says why).

`--make-room` (unified memory, root only): first drop clean page cache and compact,
enough for the load and the device floor, then judge. As a loader's
`ExecStartPre=-+/usr/bin/spark-guard preflight --make-room UNIT` (`harden` writes it)
it replaces the field's `echo 1 > /proc/sys/vm/drop_caches`. Run by a user it makes
no room (never on behalf of an unprivileged request) and says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import config as config_mod
from .. import log as log_mod
from ..core.argv.loadspec import LoadSpec, Settings, SpecError, first_spec
from ..core.argv.servers import OLLAMA
from ..core.classify import classify, command_line, expected_footprint
from ..core.config import Config
from ..core.policy import charge_clients
from ..core.quantities import format_size
from ..core.room import RECLAIM_MIN, RoomPlan, fragmented
from ..core.snapshot import (
    SYSTEM,
    USER_PREFIX,
    Decision,
    SeenUnit,
    Snapshot,
    UnitRef,
    droppable,
    manager_uid,
    parse_ref,
)
from ..core.text import printable as p
from ..exits import CANNOT_SAY
from ..foresight.clients import ServerUnit, predict_client
from ..foresight.estimate import Estimate
from ..foresight.predict import Prediction, Predictor, parse_environment
from ..jsonout import emit
from ..system.cgroupfs import v2_root
from ..system.managers import ManagerError, command_manager, connect_to
from ..system.procfs import ProcFS
from ..system.reclaim import RoomMade, RoomMaker
from .preflight import Verdict, verdict


class PreflightError(RuntimeError):
    pass


def _settings(args: argparse.Namespace, base: Settings) -> Settings:
    s = base
    if args.ctx is not None:
        s = replace(s, n_ctx=args.ctx)
    if args.parallel is not None:
        s = replace(s, n_parallel=max(1, args.parallel), kv_unified=False)
    if args.cache_type_k:
        s = replace(s, cache_type_k=args.cache_type_k.lower())
    if args.cache_type_v:
        s = replace(s, cache_type_v=args.cache_type_v.lower())
    if args.flash_attn:
        s = replace(s, flash_attn=args.flash_attn)
    if args.ubatch is not None:
        s = replace(s, n_ubatch=max(1, args.ubatch))
    if args.swa_full:
        s = replace(s, swa_full=True)
    return s


def _bad_target(target: str) -> str:
    """What is wrong with a unit name before anything is asked: a manager that is none
    (user:abc) is a usage error, not "that manager is not running here"."""
    if target.endswith(".gguf") or os.path.exists(target) or not target.startswith(USER_PREFIX):
        return ""
    try:
        manager_uid(parse_ref(target, SYSTEM).manager)
    except ValueError as e:
        return f"{target}: {e}"
    return ""


def _unit_ref(target: str, own_unit: UnitRef | None) -> UnitRef:
    # Run by a user, a bare name is one of the user's own units.
    ref = parse_ref(target, command_manager())
    if own_unit is not None and own_unit.name == ref.name and not target.startswith(USER_PREFIX):
        return own_unit  # ExecStartPre= of that very unit: whichever manager runs it
    return ref


def _unit_spec(ref: UnitRef, config: Config) -> tuple[list[tuple[str, ...]], dict[str, str], str]:
    """Its ExecStart= command lines, its Environment= and its User=."""
    try:
        manager = connect_to(ref.manager, config.system_manager, config.user_runtime)
    except ManagerError as e:
        raise PreflightError(f"{ref}: {e}") from None
    try:
        state = manager.unit_states([ref.name]).get(ref.name)
        if state is None or state.load_state == "not-found":
            raise PreflightError(f"{ref}: no such unit")
        details = manager.unit_details(ref.name)
    except ManagerError as e:
        raise PreflightError(str(e)) from None
    finally:
        manager.close()
    return (
        [tuple(a) for a in details.exec_start],
        parse_environment(details.environment),
        details.user,
    )


def _ollama_servers(decision: Decision, config: Config) -> list[ServerUnit]:
    """The Ollama server units running now (decide()'s loaders), with their settings: where
    an `ollama run` client's model is looked up. One that cannot be read is left out."""
    out = []
    for loader in decision.loaders:
        if loader.serves != OLLAMA:
            continue
        try:
            exec_start, env, user = _unit_spec(loader.ref, config)
        except PreflightError:
            continue
        out.append(ServerUnit(loader.ref.manager, tuple(exec_start), env, user))
    return out


@dataclass(frozen=True)
class Charge:
    """A client unit's load, charged to the server unit it lands in (or to itself)."""

    asks: str  # the kind of server it asks ("lmstudio", "ollama")
    server: UnitRef | None  # None: no server it could be charged to is running


def _charge(
    ref: UnitRef,
    command_lines: Sequence[Sequence[str]],
    p: Prediction,
    decision: Decision,
    config: Config,
) -> Charge | None:
    """policy.charge_clients' answer for this client against the servers running now."""
    seen = SeenUnit(
        ref,
        "inactive",
        exec_start=tuple(tuple(c) for c in command_lines),
        predicted=p.bytes,
        runs_as=p.runs_as,
    )
    client = classify(seen, config)
    if client is None or not client.asks or client.serves:
        return None
    servers = tuple(ld for ld in decision.loaders if ld.serves and ld.ref != ref)
    charged = next(ld for ld in charge_clients((*servers, client)) if ld.ref == ref)
    return Charge(client.asks, charged.charged_to)


def _predict(
    args: argparse.Namespace,
    config: Config,
    mem_total: int,
    own_unit: UnitRef | None,
    decision: Decision | None = None,
) -> tuple[str, Prediction, UnitRef | None, Charge | None]:
    predictor = Predictor()
    target = args.target
    if os.path.isdir(target):
        raise PreflightError(f"{target}: a directory, not a model file or a unit")
    if target.endswith(".gguf") or os.path.isfile(target):
        path = os.path.abspath(target)
        spec = LoadSpec(
            kind="llama.cpp",
            binary="llama-server",
            model=path,
            mmproj=os.path.abspath(args.mmproj) if args.mmproj else None,
            settings=_settings(args, Settings(n_parallel=4, kv_unified=True)),
        )
        return path, predictor.for_spec(spec, mem_total), None, None
    ref = _unit_ref(target, own_unit)
    fixed = expected_footprint(ref, config)
    if fixed is not None:
        return str(ref), Prediction(fixed, "[loaders.footprint] in the config"), ref, None
    if ref.is_container:
        raise PreflightError(
            f"{ref}: no size in [loaders.footprint]; for a container, give its model file"
        )
    command_lines, env, user = _unit_spec(ref, config)
    found = first_spec(command_lines, env)
    asks = any(command_line(c).asks for c in command_lines)
    if found is None and asks:
        servers = _ollama_servers(decision, config) if decision is not None else []
        got = predict_client(
            predictor,
            command_lines,
            env,
            mem_total,
            manager=ref.manager,
            user=user,
            servers=servers,
            wait=True,
        )
        if got is not None:
            charge = _charge(ref, command_lines, got, decision, config) if decision else None
            return str(ref), got, ref, charge
    if found is None:
        raise PreflightError(
            f"{ref}: footprint unknown: not a loader command this reads "
            f"({' '.join(command_lines[0]) if command_lines else 'no ExecStart'}); "
            f"give it a size in [loaders.footprint]"
        )
    spec = replace(
        found,
        settings=_settings(args, found.settings),
        mmproj=os.path.abspath(args.mmproj) if args.mmproj else found.mmproj,
    )
    return str(ref), predictor.for_spec(spec, mem_total), ref, None


def count(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], or argparse's usage error naming
    the range (a -c of -1 was taken as 0 and said "fits")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value}: must be from {low} to {high}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        metavar="UNIT|MODEL.gguf",
        help="a unit (judged by its ExecStart=) or a model file, with the options below",
    )
    parser.add_argument(
        "-c", "--ctx", type=count(0, 1 << 24), help="context size (0: the trained one)"
    )
    parser.add_argument("-np", "--parallel", type=count(1, 4096), help="slots (1 or more)")
    parser.add_argument("-ctk", "--cache-type-k", help="K cache type: f16, q8_0, q4_0, ...")
    parser.add_argument("-ctv", "--cache-type-v", help="V cache type: f16, q8_0, q4_0, ...")
    parser.add_argument(
        "-fa", "--flash-attn", choices=("on", "off", "auto"), help="as llama-server's (auto)"
    )
    parser.add_argument(
        "-ub", "--ubatch", type=count(1, 1 << 16), help="physical batch (1 or more)"
    )
    parser.add_argument(
        "--swa-full",
        action="store_true",
        default=None,
        help="a full-size KV cache for sliding-window layers, as llama-server's",
    )
    parser.add_argument("--mmproj", help="the multimodal projector file loaded with the model")
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON document (--json=short: on one line; schemas in docs/json.md)",
    )
    parser.add_argument(
        "--make-room",
        action="store_true",
        help="unified memory, as root: drop clean page cache and compact first, then judge",
    )


def run(args: argparse.Namespace) -> int:
    from ..core.policy import decide
    from ..sense import sense_once
    from ..system.procfs import ProcError

    config = config_mod.load_for_command(args.config)
    if config is None:
        return 2
    bad = _bad_target(args.target)
    if bad:
        print(f"spark-guard preflight: {p(bad)}", file=sys.stderr)
        return 2
    log_mod.configure("console", level="error")
    try:
        snapshot, own_unit, managers = sense_once(config, log_mod.get_logger())
        decision = decide(snapshot, config)
        what, prediction, itself, charge = _predict(
            args, config, snapshot.memory.total, own_unit, decision
        )
    except (ProcError, PreflightError, SpecError) as e:
        # The message can quote the unit's command line: a user's text, shown inert.
        print(f"spark-guard: {p(e)}", file=sys.stderr)
        return CANNOT_SAY  # not argparse's 2: an ExecStartPre= tells it from a typo
    if prediction.bytes is None:
        if args.make_room:
            # No footprint to make room for: the device floor still is (an ExecStartPre=).
            room = make_room(config, snapshot, 0)
            if room is not None:
                print(_room_line(room))
        print(f"spark-guard: {p(what)}: footprint unknown: {p(prediction.source)}", file=sys.stderr)
        if charge is not None:
            print(f"spark-guard: {p(what)}: {_charged(charge)}", file=sys.stderr)
        return CANNOT_SAY
    model_bytes = prediction.page_cache  # read through the page cache as it loads
    room = None
    if args.make_room:
        room = make_room(config, snapshot, prediction.bytes + model_bytes)
        if room is not None and room.after is not None:
            snapshot = replace(snapshot, memory=room.after)
            decision = decide(snapshot, config)
    result = verdict(prediction.bytes, snapshot, decision, itself, model_bytes=model_bytes)
    if not managers:
        # The memory is read all the same; the loaders it would wait for are not seen.
        print(
            "spark-guard: no systemd manager reached: other loaders still loading were not "
            "counted (run it as root where systemd is PID 1)",
            file=sys.stderr,
        )
    if args.json:
        out = _as_json(what, prediction, result, charge)
        out["room_made"] = _room_json(room)
        out["managers"] = list(managers)
        if not managers:
            out["pending"] = None  # not counted: no manager said which loaders load
        emit(out, args.json)
    else:
        if room is not None:
            print(_room_line(room))
        _print(what, prediction, result, charge, counted=bool(managers))
    return 0 if result.fits else 1


def make_room(config: Config, snapshot: Snapshot, need: int) -> RoomMade | None:
    """Drop clean page cache and compact, for a load of `need` bytes on unified memory:
    MemFree to the load plus the device floor. None (and why, on stderr) where no room is
    made: not unified memory, or not root."""
    rule, memory = snapshot.rule, snapshot.memory
    if not rule.unified or memory.free is None:
        why = (
            '[memory] unified = "no"'
            if config.unified == "no"
            else 'NVML did not say so; [memory] unified = "yes" says it for a GB10 without '
            "a driver yet"
        )
        print(
            f"spark-guard: --make-room: not unified memory here ({why}): no room made",
            file=sys.stderr,
        )
        return None
    if not config.make_room:
        print(
            "spark-guard: --make-room: [memory] make_room = false: no room made",
            file=sys.stderr,
        )
        return None
    if os.geteuid() != 0:
        print(
            "spark-guard: --make-room: only root makes room (it drops the whole machine's "
            "page cache); judged without it",
            file=sys.stderr,
        )
        return None
    floor = config.floor_for(memory.total)
    short = max(need + floor - memory.free, 0)
    cache = droppable(memory, rule)
    want = min(cache, short)
    want = want if want >= RECLAIM_MIN else 0
    # Compact after a reclaim (the dropped pages are scattered) or where MemFree is
    # fragmented; else it only moves pages (room.fragmented).
    compact = want > 0 or fragmented(memory, floor)
    if not want and not compact:
        why = (
            f"MemFree {format_size(memory.free)} covers the load and the device floor "
            f"{format_size(floor)}, and is not fragmented"
            if not short
            else f"MemFree is {format_size(short)} short of the load and the device floor, "
            f"but only {format_size(cache)} of clean page cache can be dropped"
        )
        print(f"spark-guard: --make-room: nothing to do: {why}", file=sys.stderr)
        return None
    plan = RoomPlan(want, compact, f"preflight for {need} bytes")
    maker = RoomMaker(
        ProcFS(config.proc), v2_root(config.cgroup), os.path.join(config.proc, "sys", "vm")
    )
    return maker.carry_out(plan, memory)


def _room_line(made: RoomMade) -> str:
    before, after = made.before, made.after
    line = f"make-room: {made.done or 'nothing could be done'}"
    if after is not None and after.free is not None and before.free is not None:
        line += f"; MemFree {format_size(before.free)} -> {format_size(after.free)}"
    if not made.done:  # a way refused where another worked is no news here
        for error in dict.fromkeys(made.errors):
            line += f"; {p(error)}"
    return line


def _room_json(made: RoomMade | None) -> dict[str, Any] | None:
    if made is None:
        return None
    after = made.after
    return {
        "method": made.method or None,
        "compacted": made.compacted,
        "asked": made.plan.reclaim,
        "seconds": round(made.seconds, 3),
        "mem_free_before": made.before.free,
        "mem_free_after": after.free if after else None,
        "file_clean_before": made.before.file_clean,
        "file_clean_after": after.file_clean if after else None,
        "errors": list(made.errors),
    }


def _charged(c: Charge) -> str:
    if c.server is not None:
        return (
            f"a client of {c.asks}: its load lands in {c.server}'s process and is charged "
            "to that unit (the one the guard refuses or blocks)"
        )
    return (
        f"a client of {c.asks}: no {c.asks} server unit runs where it could be charged "
        "(its own manager, or, for a system unit, that of the user it runs as), so the "
        "guard charges it to this unit"
    )


def _terms(est: Estimate | None) -> list[dict[str, Any]]:
    if est is None:
        return []
    return [
        {"name": t.name, "bytes": t.bytes, "exact": t.exact, "detail": t.detail} for t in est.terms
    ] + [{"name": "margin", "bytes": est.margin, "exact": False, "detail": ""}]


def _as_json(what: str, pred: Prediction, v: Verdict, charge: Charge | None) -> dict[str, Any]:
    spec = pred.spec
    return {
        "target": what,
        "source": pred.source,
        # The rule behind `source`: the loader it was read as, the defaults it took, notes;
        # for a client, the server unit its load is charged to (null: not charged to one).
        "rule": {
            "kind": spec.kind if spec else ("config" if pred.estimate is None else ""),
            "binary": spec.binary if spec else "",
            "defaults": spec.rule if spec else "",
            "notes": list(spec.notes) if spec else [],
        },
        "client_of": charge.asks if charge else None,
        "charged_to": str(charge.server) if charge and charge.server else None,
        "terms": _terms(pred.estimate),
        "total": pred.bytes,
        "n_ctx": pred.estimate.n_ctx if pred.estimate else None,
        "mem_available": v.mem_available or v.available,
        "unified": v.unified,
        "mem_free": v.mem_free,
        "file_clean": v.file_clean,
        "headroom": v.available,
        "page_cache": v.page_cache,
        "reserve": v.reserve,
        "pending": v.pending,
        "room": v.room,
        "fits": v.fits,
        "gpu_holders": [{"unit": u, "bytes": b} for u, b in v.gpu_holders],
    }


def _print(
    what: str,
    pred: Prediction,
    v: Verdict,
    charge: Charge | None = None,
    *,
    counted: bool = True,
) -> None:
    # The target, the source and the terms' details name model paths and units: shown inert.
    print(f"{p(what)}: {p(pred.source)}")
    if pred.spec is not None and pred.spec.rule and pred.spec.rule not in pred.source:
        print(f"  rule: {p(pred.spec.rule)}")
    for note in pred.spec.notes if pred.spec is not None else ():
        print(f"  note: {p(note)}")
    if charge is not None:
        print(f"  {p(_charged(charge))}")
    for t in _terms(pred.estimate):
        kind = "" if t["name"] == "margin" else ("exact" if t["exact"] else "approx")
        print(f"  {t['name']:<8} {format_size(t['bytes']):>9}  {kind:<6} {p(t['detail'])}")
    print(f"  {'total':<8} {format_size(pred.bytes or 0):>9}")
    if v.unified and v.mem_free is not None:
        print(
            f"unified memory: a GPU allocation gets MemFree {format_size(v.mem_free)}, "
            f"clean page cache {format_size(v.file_clean)}, "
            f"MemAvailable {format_size(v.mem_available)}"
        )
    figure = "device headroom" if v.unified else "MemAvailable"
    print(
        f"{figure} {format_size(v.available)} - reserve {format_size(v.reserve)}"
        + (
            f" - other loaders still loading {format_size(v.pending)}"
            if counted
            else " - other loaders still loading (not counted: no manager reached)"
        )
        + f" = room {format_size(v.room)}"
    )
    if v.page_cache:
        print(
            f"  the model file's page cache counts too ({format_size(v.page_cache)}): no room "
            "is made for it ([memory] make_room = false)"
        )
    if v.gpu_holders:
        held = ", ".join(f"{p(u)} {format_size(b)}" for u, b in v.gpu_holders)
        print(f"GPU memory held by: {held}")
    if v.fits:
        print(f"verdict: fits ({format_size(v.room - v.need)} to spare)")
    else:
        print(f"verdict: does NOT fit (short by {format_size(v.need - v.room)})")
