"""A pass's questions to the managers: root's first, on the loop; the users' in parallel,
off it, each in its turn.

Each manager is asked what it is starting (ListJobs), the states of its units the
kernel shows and of those start jobs (ListUnitsByNames), and the details of its units
not read yet, the biggest first. PID 1 and root's own user manager are asked first, on
the loop, and whole. Then each user's manager is asked by a worker of its own, within
her budgets: at most DETAILS_PER_PASS units' details, within DETAILS_OWNER_BUDGET bytes
held, and no call started past USER_TURN. The loop waits USER_TURN for all of them together, however
many there are: one slow or hostile manager costs a pass USER_TURN, never a turn per
user, and never PID 1's answer. A manager not back by then is left pending: its units are
judged by what the kernel shows (as when it is out of view), its answer is not used, and
it is not asked again until its worker is done; a failure that worker meets still drops
it, at the next pass (a timeout makes it silent for SILENT_FOR).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from ..system.managers import (
    Manager,
    ManagerError,
    ManagerSilent,
    UnitDetails,
    UnitState,
)

# How long the loop waits for the users' managers in one pass, all of them together; a
# worker starts no call past it (each call has its own deadline: DETAILS_TIMEOUT).
USER_TURN = 1.0
# A user's new units whose details are asked in one pass (issue 40, H6): her 3,000 start
# jobs queued behind a unit that never finishes were 3,000 calls, a pass of 35.7 s. The
# rest are asked in the next passes, in turn: a unit already read is not asked again.
DETAILS_PER_PASS = 32
# A user's unit details held (ExecStart= within 64 KiB and 16 KiB of Environment= each):
# a real loader's are a few kB; 40 units of hers at the per-unit caps, 3 MiB.
DETAILS_OWNER_BUDGET = 1 << 20
# Workers at once (threads are made as they are needed): more managers than this wait
# for a free one within the same turn, those that answered in the last pass first.
WORKERS = 64


class Later(ManagerError):
    """Not asked in this pass: its manager's turn was over (asked in a later one)."""


def details_size(d: UnitDetails) -> int:
    """What a unit's details hold of its writer's text."""
    rows = sum(len(a) + 1 for row in d.exec_start for a in row)
    return rows + sum(len(e) for e in d.environment)


def ghost(state: UnitState) -> bool:
    """A unit her manager does not run: processes in its cgroup make it a group of hers."""
    return state.load_state == "not-found" or state.active_state in ("inactive", "failed")


@dataclass(frozen=True)
class Question:
    """What a pass asks one manager: the units the kernel shows of its, biggest first
    (`names`); whether a unit's details are wanted (not read yet, or due again); the
    bytes of details its units already hold; whether the budgets apply (`limited`:
    every manager but PID 1's); and whether a unit it does not run, though processes
    sit in its cgroup, is a group of its user's (`hers`: every manager but root's)."""

    names: tuple[str, ...]
    wanted: Callable[[str], bool]
    held: int = 0
    limited: bool = True
    hers: bool = True


@dataclass
class Answer:
    """What one manager answered in a pass; `error`: the call that failed, and the rest
    not asked (its details so far still hold)."""

    jobs: tuple[str, ...] = ()
    states: Mapping[str, UnitState] = field(default_factory=dict)
    details: dict[str, UnitDetails | ManagerError] = field(default_factory=dict)
    error: ManagerError | None = None

    def details_of(self, name: str) -> UnitDetails:
        """Its details as answered; the error that kept them; or Later."""
        got = self.details.get(name)
        if got is None:
            raise Later(f"{name}: its manager's turn in this pass is over: asked in a later one")
        if isinstance(got, ManagerError):
            raise got
        return got


def ask(m: Manager, q: Question, clock: Callable[[], float] = time.monotonic) -> Answer:
    """One manager's turn: its start jobs, the states, then the details wanted."""
    began = clock()
    answer = Answer()
    try:
        answer.jobs = tuple(n for n in m.start_jobs() if n.endswith(".service"))
        answer.states = m.unit_states([*q.names, *answer.jobs])
        _details(m, q, answer, began, clock)
    except ManagerError as e:
        answer.error = e
    except Exception as e:  # (a worker's fault is said as its manager's, never lost)
        answer.error = ManagerError(f"{m.key}: {type(e).__name__}: {e}")
    return answer


def _details(
    m: Manager, q: Question, answer: Answer, began: float, clock: Callable[[], float]
) -> None:
    """The details wanted of the units answered, biggest first, within the budgets."""
    running = set(q.names)
    held = q.held
    for name in dict.fromkeys([*q.names, *answer.jobs]):
        if q.limited and (
            len(answer.details) >= DETAILS_PER_PASS
            or held >= DETAILS_OWNER_BUDGET
            or clock() - began >= USER_TURN
        ):
            break
        state = answer.states.get(name)
        if not name.endswith(".service") or state is None or not q.wanted(name):
            continue
        if q.hers and name in running and ghost(state):
            continue
        try:
            d = m.unit_details(name)
        except ManagerSilent as e:
            answer.details[name] = e
            break  # (it would say the same of the rest until SILENT_FOR is over)
        except ManagerError as e:
            answer.details[name] = e
            continue
        answer.details[name] = d
        held += details_size(d)


class Turns:
    """The workers, and the managers whose worker is still out from an earlier pass."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._out: dict[str, tuple[Manager, Future[Answer]]] = {}
        self._answered: set[str] = set()  # in time in the last pass: asked first

    def ask_all(
        self, asks: Mapping[str, tuple[Manager, Question]], turn: float = USER_TURN
    ) -> tuple[dict[str, Answer], dict[str, ManagerError], set[str]]:
        """Ask each manager in parallel; wait `turn` for all. Returns the answers in time,
        the failures (in time, or of a worker still out from an earlier pass, when it
        was this same manager's), and the managers left pending (not back in time, or
        still out)."""
        failed: dict[str, ManagerError] = {}
        pending: set[str] = set()
        for key, (was, f) in list(self._out.items()):
            if not f.done():
                pending.add(key)
                continue
            del self._out[key]
            error = f.result().error
            if error is not None and asks.get(key, (None,))[0] is was:
                failed[key] = error  # (not of another connection since made for her)
        # Those that answered last pass first: a worker is free for them.
        now = [k for k in sorted(asks, key=lambda k: k not in self._answered)]
        now = [k for k in now if k not in pending and k not in failed]
        if now and self._pool is None:
            self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="user-manager")
        pool = self._pool
        mine = {k: (asks[k][0], pool.submit(ask, *asks[k])) for k in now if pool is not None}
        if mine:
            wait([f for _, f in mine.values()], timeout=turn)
        answers: dict[str, Answer] = {}
        for key, (m, f) in mine.items():
            if not f.done() and not f.cancel():
                self._out[key] = (m, f)  # its failure, if any, is taken at a later pass
                pending.add(key)
            elif f.cancelled():
                pending.add(key)  # (no worker was free in its turn)
            elif (a := f.result()).error is not None:
                failed[key] = a.error
            else:
                answers[key] = a
        self._answered = set(answers)
        return answers, failed, pending

    def close(self, *, wait: bool = False) -> None:
        """No more passes; `wait`: until the workers still out are done."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None
