"""The block of a loader container, so that it holds, and its exact undo (issue 19).

A container comes back through its engine's restart policy, not through
systemd: killing its scope makes `always`, `unless-stopped` and `on-failure`
start it again, and a mask has nothing to hold. So the block goes through the
engine:

1. stop it there (a stop through the engine is a manual stop: no policy
   restarts it while the engine runs);
2. set its restart policy to `no` (so that neither an engine restart nor a
   reboot starts it: `always` would);
3. keep its old policy and whether it ran in a ContainerRecord;

each step verified by inspecting it again. `release()` puts back the exact
policy (MaximumRetryCount too) and starts it if it was running.

First slice: the daemon's Blocker does not call this yet, and the record is not
stored yet; it is plain JSON, as block.records.Record is, for
`<state>/blocked/container:NAME.json` beside the units' records.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..system.engine import Container, Engine, EngineError, valid_id, valid_name
from ..text import printable
from .records import utc_now

FORMAT = 1
KIND = "container"
STOP_TIMEOUT = 10  # seconds between the engine's SIGTERM and SIGKILL (docker stop's default)
BLOCKED_POLICY = "no"


class ContainerBlockError(RuntimeError):
    """A block or a release that did not hold; str() names the container and the reason."""


@dataclass
class ContainerRecord:
    """What was changed on one container, to undo it exactly."""

    id: str
    name: str
    image: str
    engine: str  # the engine's socket
    restart: str  # the policy before the block, as the engine said it ("" is "no")
    max_retries: int
    was_running: bool
    at: str = ""  # UTC time of the block
    reason: str = ""
    # (UTC time, what happened), in order, as a unit's Record keeps it.
    history: list[tuple[str, str]] = field(default_factory=list)

    @property
    def key(self) -> str:
        """Its name among the records: `container:NAME`."""
        return f"container:{self.name}"

    @property
    def policy(self) -> str:
        name = self.restart or "no"
        return f"{name}:{self.max_retries}" if self.max_retries else name

    def note(self, what: str) -> None:
        self.history.append((utc_now(), what))

    def to_json(self) -> str:
        data = asdict(self)
        data["format"] = FORMAT
        data["kind"] = KIND
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> ContainerRecord:
        try:
            data: dict[str, Any] = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            if data.pop("format", None) != FORMAT or data.pop("kind", None) != KIND:
                raise ValueError(f"not a format {FORMAT} container record")
            data["history"] = [tuple(h) for h in data.get("history", [])]
            record = cls(**data)
        except (ValueError, TypeError) as e:
            raise ContainerBlockError(f"{where}: unreadable record: {e}") from None
        if not valid_id(record.id) or not valid_name(record.name):
            raise ContainerBlockError(f"{where}: unreadable record: bad id or name")
        if not isinstance(record.max_retries, int) or not isinstance(record.restart, str):
            raise ContainerBlockError(f"{where}: unreadable record: bad restart policy")
        return record


def _fail(container: Container | ContainerRecord, what: str) -> ContainerBlockError:
    return ContainerBlockError(f"container:{printable(container.name, 128)}: {what}")


def block(
    engine: Engine, container: Container, reason: str = "", stop_timeout: int = STOP_TIMEOUT
) -> ContainerRecord:
    """Stop `container` through `engine` and set its restart policy to `no`; the record of
    what it was. ContainerBlockError if a step fails or does not hold when inspected
    again (the container is then left as far as the block got)."""
    try:
        now = engine.inspect(container.id)  # its policy as it is now, not as it was seen
        record = ContainerRecord(
            id=now.id,
            name=now.name,
            image=now.image,
            engine=engine.path,
            restart=now.restart,
            max_retries=now.max_retries,
            was_running=now.running,
            at=utc_now(),
            reason=printable(reason, 512),
        )
        if engine.stop(now.id, stop_timeout):
            record.note(f"stopped (was {record.policy})")
        after = engine.inspect(now.id)
        if after.running:
            raise _fail(now, f"still running after the stop ({after.status})")
        engine.update_restart(now.id, BLOCKED_POLICY)
        after = engine.inspect(now.id)
        if after.restart != BLOCKED_POLICY or after.max_retries:
            raise _fail(now, f"restart policy is {after.policy} after setting it to no")
        if after.running:
            raise _fail(now, f"running again ({after.status}) after its policy was set to no")
        record.note("restart policy set to no")
    except EngineError as e:
        raise _fail(container, str(e)) from None
    return record


def release(engine: Engine, record: ContainerRecord) -> Container:
    """Put back the exact restart policy of `record`'s container and start it if it was
    running before the block; the container as it then is. ContainerBlockError if it is
    gone (a container of the same name made since is not the one blocked) or the policy
    does not hold."""
    try:
        now = engine.inspect(record.id)
        if now.name != record.name:
            raise _fail(record, f"its id now has the name {now.name}: not released")
        engine.update_restart(record.id, record.restart or BLOCKED_POLICY, record.max_retries)
        now = engine.inspect(record.id)
        if (now.restart or "no") != (record.restart or "no") or (
            now.max_retries != record.max_retries
        ):
            raise _fail(record, f"restart policy is {now.policy}, not {record.policy}")
        record.note(f"restart policy {record.policy} put back")
        if record.was_running and not now.running:
            engine.start(record.id)
            now = engine.inspect(record.id)
            if not now.running:
                raise _fail(record, f"did not stay running after the start ({now.status})")
            record.note("started")
    except EngineError as e:
        raise _fail(record, str(e)) from None
    return now
