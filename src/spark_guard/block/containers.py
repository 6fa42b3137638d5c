"""The block of a loader container, so that it holds, and its exact undo.

A container comes back through its engine's restart policy, not through
systemd: killing its scope makes `always`, `unless-stopped` and `on-failure`
start it again, and a mask has nothing to hold. So the block goes through the
engine:

1. stop it there (a stop through the engine is a manual stop: no policy
   restarts it while the engine runs);
2. set its restart policy to `no` (so that neither an engine restart nor a
   reboot starts it: `always` would);
3. its old policy and whether it ran are kept in its Record (records.ContainerState),
   saved before anything is changed;

each step verified by inspecting it again. `release()` puts back the exact
policy (MaximumRetryCount too) and starts it if it was running.

The engine's stop waits for the container to go (SIGTERM, SIGKILL after the
stop timeout), so the Blocker runs block() in a thread of its own (Pending):
the loop goes on sensing, and kills the container's cgroup itself if memory
runs short meanwhile. A stop through the engine marks the container stopped by
hand, so its policy does not restart it when that kill lands.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

from ..core.text import printable
from ..system.engine import Container, EngineError
from ..system.worker import spawn
from .ports import EnginePort
from .records import ContainerState, Record

KIND = "container"
# A block whose thread could not start (a pids limit): the container is killed from the
# kernel's side meanwhile, as when its engine does not answer.
NO_THREAD = "cannot start a thread for it (a pids limit?)"
STOP_TIMEOUT = 10  # seconds between the engine's SIGTERM and SIGKILL (docker stop's default)
BLOCKED_POLICY = "no"
# Podman's API has had no call to change a restart policy before Podman 5.1 (Debian 12 has
# 4.3, Ubuntu 24.04 4.9: both answer 404). Its `always` containers come back at boot
# through podman-restart.service.
NO_UPDATE = (
    "cannot change a restart policy (Podman before 5.1): it may start again at the next "
    "boot; recreate it without --restart, or run it as a Quadlet unit"
)


class ContainerBlockError(RuntimeError):
    """A block or a release that did not hold; str() names the container and the reason."""


def _fail(ref: str, what: str) -> ContainerBlockError:
    """`ref`: how the admin names it (container:NAME, or user:UID:container:NAME)."""
    return ContainerBlockError(f"{printable(ref, 160)}: {what}")


def block(
    engine: EnginePort,
    record: Record,
    stop_timeout: int = STOP_TIMEOUT,
    remember: Callable[[Record], bool] | None = None,
    answered: Callable[[], None] | None = None,
    seen_running: bool = False,
    hold: Callable[[Record], AbstractContextManager[str]] | None = None,
) -> Container | None:
    """Stop `record`'s container through `engine` and set its restart policy to `no`; the
    container as it then is (None: it no longer exists, nor one of its name). Its policy
    before, and whether it ran, go into `record.container` and are handed to `remember`
    (which saves the record, False if it cannot) before anything changes; a record that
    has them already (blocked before, running again) keeps them: they are what release()
    puts back. The stop changes nothing that lasts and goes out either way; the policy is
    changed only once the record of the old one is on disk. A `--rm` container has no
    policy to set: its block is done once it is stopped (and removed). A container whose
    recorded id is gone is followed by its name. ContainerBlockError if a step fails or
    does not hold when inspected again (the container is left as far as it got).

    `hold` (the guard's store lock, and the record still its own) is held around the
    policy's change: a release that took the record while the stop went out stands, and
    what the stop undid of it is put back (fault F6)."""
    shown = str(record.ref)
    try:
        now = _current(engine, record)  # its policy as it is now, not as it was seen
        if answered is not None:
            answered()  # the engine answers: the stop is its to do
        if now is None:
            # Removed (`--rm`), and none of its name made since: nothing runs, nothing
            # can start it; what re-creates it is judged when it runs.
            record.note("removed by its engine: nothing of it left to stop")
            return None
        if record.container is not None and now.id != record.container.id:
            # Its id is gone and a container of its name runs: re-created (`docker run
            # --rm --name X` again, by a unit's Restart=). The same loader: the block
            # follows it, and what release puts back is the new one's.
            record.note(
                f"container {record.container.id[:12]} is gone; {now.id[:12]} of the same "
                "name is blocked in its place"
            )
            record.container = None
        if record.container is None:
            record.container = ContainerState(
                id=now.id,
                image=now.image,
                engine=engine.path,
                restart=now.restart,
                max_retries=now.max_retries,
                # Ran when the guard decided (`seen_running`), though its engine may say
                # otherwise by now: the guard killed it while the engine was silent.
                was_running=now.running or seen_running,
            )
            record.note(f"container {now.id[:12]}: restart policy {now.policy}")
            if remember is not None:
                remember(record)  # now, in case the guard dies during the stop
        if engine.stop(now.id, stop_timeout):
            record.note(f"stopped through {engine.path}")
        try:
            after = engine.inspect(now.id)
        except EngineError as e:
            if e.status != 404:
                raise
            # `--rm`: its engine removed it on the stop. No policy to set; nothing of it
            # can start again, and a re-creation of its name is blocked as it comes.
            record.note("removed on its stop (--rm): no restart policy to set")
            return replace(now, running=False)
        if now.auto_remove and not after.running:
            record.note("stopped; it is removed on its stop (--rm): no restart policy to set")
            return after
        if after.running:
            raise _fail(shown, f"still running after the stop ({after.status})")
        with hold(record) if hold is not None else contextlib.nullcontext("") as taken:
            _set_policy(engine, record, now.id, taken, remember)
        after = engine.inspect(now.id)
        if after.restart != BLOCKED_POLICY or after.max_retries:
            raise _fail(shown, f"restart policy is {after.policy} after setting it to no")
        if after.running:
            raise _fail(shown, f"running again ({after.status}) after its policy was set to no")
        record.note("restart policy set to no")
    except EngineError as e:
        raise _fail(shown, str(e)) from None
    return after


def _set_policy(
    engine: EnginePort,
    record: Record,
    cid: str,
    taken: str,
    remember: Callable[[Record], bool] | None,
) -> None:
    """Its policy set to `no`, once its record says what it was; not where a release
    took the record meanwhile (`taken` says how): that stands, and the container the stop
    stopped is started again if it ran."""
    shown = str(record.ref)
    if taken:
        again = record.container is not None and record.container.was_running
        again = again and engine.start(cid)
        raise _fail(shown, f"{taken}: its release stands" + (", started" if again else ""))
    if remember is not None and not remember(record):
        raise _fail(
            shown,
            "stopped, but its record cannot be written: its restart policy is left as it "
            "was until the record of it can be",
        )
    try:
        engine.update_restart(cid, BLOCKED_POLICY)
    except EngineError as e:
        if e.status in (404, 405, 501):  # the container is there: the call is not
            raise _fail(shown, f"stopped, but {engine.path} {NO_UPDATE}") from None
        raise


def _current(engine: EnginePort, record: Record) -> Container | None:
    """The container the record is of: its recorded id, or once that is gone a container
    of its name (a re-created one); None when neither exists."""
    for ref in ([record.container.id] if record.container else []) + [record.ref.container]:
        try:
            return engine.inspect(ref)
        except EngineError as e:
            if e.status != 404:
                raise
    return None


def holds(engine: EnginePort, record: Record) -> str:
    """ "" if the block still holds (policy `no`, not running); else what changed."""
    assert record.container is not None
    try:
        now = engine.inspect(record.container.id)
    except EngineError as e:
        if e.status == 404:
            return ""  # removed: nothing can start it
        raise _fail(str(record.ref), str(e)) from None
    if now.running:
        return f"running again ({now.status})"
    if (now.restart or BLOCKED_POLICY) != BLOCKED_POLICY:
        return f"restart policy is {now.policy} again"
    return ""


def release(engine: EnginePort, record: Record, *, start: bool = True) -> Container | None:
    """Put back the exact restart policy of `record`'s container and start it if it was
    running before the block (and `start`); the container as it then is, None when it no
    longer exists (removed: nothing of the block is left to undo).
    ContainerBlockError if it is gone (a container of the same name made since is not
    the one blocked) or the policy does not hold."""
    state = record.container
    if state is None:
        raise _fail(str(record.ref), "the record has no account of its policy: nothing to put back")
    try:
        try:
            now = engine.inspect(state.id)
        except EngineError as e:
            if e.status != 404:
                raise
            # Removed since (`--rm`, or by hand): nothing of the block is left on it.
            record.note(f"container {state.id[:12]} no longer exists: nothing to put back")
            return None
        if now.name != record.ref.container:
            raise _fail(str(record.ref), f"its id now has the name {now.name}: not released")
        if (now.restart or "no", now.max_retries) != (state.restart or "no", state.max_retries):
            # (Unchanged where the block could not set it: Podman before 5.1.)
            engine.update_restart(state.id, state.restart or BLOCKED_POLICY, state.max_retries)
            now = engine.inspect(state.id)
        if (now.restart or "no") != (state.restart or "no") or (
            now.max_retries != state.max_retries
        ):
            raise _fail(str(record.ref), f"restart policy is {now.policy}, not {state.policy}")
        record.note(f"restart policy {state.policy} put back")
        if start and state.was_running and not now.running:
            engine.start(state.id)
            now = engine.inspect(state.id)
            if not now.running:
                raise _fail(str(record.ref), f"did not stay running after the start ({now.status})")
            record.note("started")
    except EngineError as e:
        raise _fail(str(record.ref), str(e)) from None
    return now


class Pending:
    """Container blocks in flight, each in a thread of its own (the engine's stop waits
    for the container to go). The loop asks done() each pass; the record is the
    thread's until then."""

    def __init__(self) -> None:
        self._running: dict[str, threading.Thread | None] = {}  # None: it could not start
        self._errors: dict[str, str] = {}
        self._answered: set[str] = set()

    def mark_answered(self, key: str) -> None:
        self._answered.add(key)

    def answered(self, key: str) -> bool:
        """Whether the engine has answered the block of `key` under way."""
        return key in self._answered

    def __contains__(self, key: str) -> bool:
        return key in self._running

    def start(self, key: str, work: Callable[[], object]) -> None:
        def run() -> None:
            try:
                work()
            except ContainerBlockError as e:
                self._errors[key] = str(e)
            except Exception as e:  # said as the block's problem, not lost
                self._errors[key] = f"{type(e).__name__}: {e}"

        self._errors.pop(key, None)
        self._answered.discard(key)
        thread = spawn(run, f"block {key}")
        if thread is None:  # done() says why; the block is asked again as after a failure
            self._errors[key] = NO_THREAD
        self._running[key] = thread

    def join(self, timeout: float) -> bool:
        """Wait until every block in flight has ended, or `timeout` seconds; whether they
        all did. Their results stay for done()."""
        deadline = time.monotonic() + timeout
        for thread in list(self._running.values()):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t is not None and t.is_alive() for t in self._running.values())

    def done(self, key: str, wait: float = 0.0) -> tuple[bool, str]:
        """(finished, its error or ""): a finished block is forgotten here."""
        thread = self._running.get(key)
        if thread is None:
            self._running.pop(key, None)
            return True, self._errors.pop(key, "")
        thread.join(wait)
        if thread.is_alive():
            return False, ""
        del self._running[key]
        return True, self._errors.pop(key, "")
