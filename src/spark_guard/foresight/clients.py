"""A client unit's load, predicted where it lands: in its server, with the server's files.

`lms load KEY` is answered by the LM Studio of the user it runs as: the key is
looked up in that user's models folder, with that user's rights. `ollama run
MODEL` (or a curl preload) is answered by an Ollama server unit: its
OLLAMA_MODELS, context and KV settings, read with the server's owner's rights.
Who a unit runs as (a system unit's User=, a home directory) is a passwd
lookup, which may wait on the network (NSS): it is done off the loop, on the
Predictor's worker thread, like every read here. Until every answer is in, the
prediction is pending and the trend guards the unit.

Which server unit a client's load is charged to, and so which unit is refused,
is policy.charge_clients' judgement; this module only says how big the load is
and as whom the client runs (Prediction.runs_as).
"""

from __future__ import annotations

import pwd
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..core.argv import lmstudio as lms_argv
from ..core.argv import ollama as ollama_argv
from ..core.argv.loadspec import SpecError
from ..core.snapshot import SYSTEM, manager_uid, server_managers
from . import lmstudio, ollama
from .modelfile import ModelOpenError
from .predict import PENDING, Prediction, Predictor


@dataclass(frozen=True)
class Identity:
    """Who a unit's processes run as."""

    uid: int
    home: str
    cost: int = 256  # what an answer kept by the Predictor holds, roughly


@dataclass(frozen=True)
class ServerUnit:
    """An Ollama server unit the sensor has seen: where a client's model is looked for."""

    manager: str
    exec_start: tuple[tuple[str, ...], ...]
    environment: Mapping[str, str]
    user: str  # User= ("" for the manager's own user)


def identity(predictor: Predictor, manager: str, user: str, *, wait: bool) -> Identity | str | None:
    """The uid and home a unit of `manager` with User=`user` runs as; why not; or None
    while the lookup is pending. A user manager's units run as its user, whatever
    User= says; a system unit without User= runs as root."""
    if manager != SYSTEM:
        key: str | int = manager_uid(manager)
    elif not user:
        key = 0
    else:
        key = int(user) if user.isdigit() else user

    def job(_deadline: float) -> Identity:
        try:
            entry = pwd.getpwuid(key) if isinstance(key, int) else pwd.getpwnam(key)
        except KeyError:
            raise ModelOpenError(f"user {key}", OSError(2, "no such user")) from None
        return Identity(entry.pw_uid, entry.pw_dir)

    got = predictor.run(f"passwd entry of {key}", None, job, wait=wait)
    if got is None or isinstance(got, str):
        return got
    assert isinstance(got, Identity)
    return got


def predict_client(
    predictor: Predictor,
    exec_start: Sequence[Sequence[str]],
    env: Mapping[str, str],
    mem_total: int,
    *,
    manager: str,
    user: str,
    servers: Sequence[ServerUnit] = (),
    wait: bool,
) -> Prediction | None:
    """The prediction of the load a client unit asks for, with `runs_as` set; None for a
    unit that asks no server to load anything (Predictor.predict reads those)."""
    try:
        lms = lms_argv.first_client_load(exec_start, env)
    except SpecError as e:
        return Prediction(None, f"lms load: {e}")
    try:
        asked = None if lms is not None else ollama_argv.first_client(exec_start, env)
    except SpecError as e:
        return Prediction(None, f"ollama: {e}")
    if lms is None and asked is None:
        return None
    me = identity(predictor, manager, user, wait=wait)
    if me is None:
        return Prediction(None, PENDING, pending=True)
    if isinstance(me, str):
        return Prediction(None, f"who it runs as is not known: {me}")
    if lms is not None:
        got = lmstudio.predict(
            predictor, lms, mem_total, owner=me.uid, home=me.home, env=env, wait=wait
        )
        return replace(got, runs_as=me.uid)
    assert asked is not None
    # The Ollama server it asks: one in its own manager, else, for a system client, one
    # in the manager of the user it runs as; the answer comes from that server's files.
    found = [s for m in server_managers(manager, me.uid) for s in servers if s.manager == m][:1]
    if not found:
        return Prediction(None, "ollama: no Ollama server unit seen to answer it", runs_as=me.uid)
    server_unit = found[0]
    them = identity(predictor, server_unit.manager, server_unit.user, wait=wait)
    if them is None:
        return Prediction(None, PENDING, pending=True)
    if isinstance(them, str):
        return Prediction(None, f"ollama server: who it runs as is not known: {them}")
    try:
        settings = ollama_argv.first_server(
            server_unit.exec_start, server_unit.environment, home=them.home
        )
    except SpecError as e:
        return Prediction(None, f"ollama server: {e}", runs_as=me.uid)
    if settings is None:
        return Prediction(None, "ollama: its server unit runs no `ollama serve`")
    got = ollama.predict(predictor, settings, asked, mem_total, owner=them.uid, wait=wait)
    return replace(got, runs_as=me.uid)
