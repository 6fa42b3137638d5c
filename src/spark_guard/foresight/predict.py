"""A loader's footprint before it allocates: its command line, its model's header, the estimate.

A model file is named by whoever wrote the unit, often a local user, and the
guard runs as root: so a model is read

- with the unit owner's file rights (safefs.as_user in the reading thread):
  the user learns nothing they could not read themselves, and a path they
  cannot open gives one answer whether it exists or not;
- off the guard's loop, in a worker thread, with a deadline: a FIFO, a
  hung network mount or a hostile header costs the loop nothing. The
  sensor asks with `wait=False` and gets a pending Prediction ("reading
  the model header") until the answer is there; the commands wait for it,
  up to the deadline. A read that never returns (a syscall stuck in D
  state) is abandoned to its thread, and a new thread takes the next reads;
  at most MAX_ABANDONED threads are ever left like that (then reads are
  refused, "not read", until one of them comes back);
- once per file and identity: headers (and the problems of bad files) are
  cached by path, device, inode, size and mtime; an answer is kept for a
  while by path (failures FAIL_RETRY, timeouts TIMEOUT_RETRY), so a unit
  that restarts in a loop does not have its model read every pass.

A missing or unreadable model is not an error of the guard: the prediction
says why there is none, the unit is "footprint unknown" and the trend
guards it instead.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..quantities import format_size
from ..snapshot import manager_uid
from ..system.safefs import as_user
from .estimate import Estimate, EstimateError, estimate
from .gguf import (
    READ_SECONDS,
    GgufError,
    GgufOpenError,
    GgufTimeout,
    HeaderCache,
    Model,
    read_model,
)
from .loadspec import LoadSpec, SpecError, first_spec

PENDING = "reading the model header"
FRESH = 5.0  # seconds a model read stays the answer before the file is looked at again
FAIL_RETRY = 60.0  # seconds before a model that could not be read is tried again
TIMEOUT_RETRY = 300.0  # ... and one whose read ran past its deadline (a hung mount)
SLACK = 0.25  # a read is abandoned at 1.25 x its budget plus this: the parser checks its
# deadline as it goes (every key, tensor and MiB), so only a syscall that does not return
# (a hung network mount, a FUSE server that does not answer) gets that far
MAX_ABANDONED = 4  # threads left inside a read that never returned; past that, no new reads
IDLE_EXIT = 30.0  # a worker with nothing to do for this long ends (a new one starts on demand)
MAX_READS = 256  # answers kept by path; the oldest finished ones go first
MAX_WAITING = 64  # reads queued or under way; more are refused for now (asked again later)
HELD_COST = 16 << 20  # models kept as answers (Model.cost), on top of the header cache: a
# hostile header may cost ~8 MB in Python objects, a real one 0.1-0.5 MB

NOBODY_GID = 65534


def owner_of(manager: str) -> int:
    """The uid whose file rights a unit's model is read with, from its manager's key.

    `user:UID`: that user (with its primary group, looked up by the reading thread:
    a passwd lookup can wait on the network, the loop must not). The system manager:
    root, for now. A system unit's own User=/Group= would be the right owner; until
    the sensor reads them, the paths in a system unit are taken as the admin's.
    """
    return manager_uid(manager)


def _gid_of(uid: int) -> int:
    if uid == 0:
        return 0
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return NOBODY_GID  # no passwd entry: no group's rights either


@dataclass(frozen=True)
class Prediction:
    bytes: int | None
    source: str  # how it was found, or why there is none
    spec: LoadSpec | None = None
    estimate: Estimate | None = None
    pending: bool = False  # the model is being read: ask again (the next pass)


def parse_environment(assignments: Iterable[str]) -> dict[str, str]:
    """systemd's Environment= list ('K=V' strings) as a mapping."""
    env = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
    return env


# --- reads off the caller's thread ----------------------------------------------------------


@dataclass(eq=False)
class _Read:
    path: str
    owner: int | None  # the uid whose rights it is read with; None: the caller's own
    budget: float
    done: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # monotonic, when a worker took it
    finished: float = 0.0
    model: Model | None = None
    error: str = ""
    timed_out: bool = False
    stalled: bool = False  # not read at all: too many reads were stuck

    def reader(self) -> str:
        return f"uid {self.owner}"


@dataclass(eq=False)
class _Worker:
    thread: threading.Thread | None = None
    current: _Read | None = None
    abandoned: bool = False


class _Pool:
    """One worker thread at a time takes reads in order; a stuck one is replaced."""

    def __init__(self, headers: HeaderCache, on_done: Callable[[], None]) -> None:
        self.headers = headers
        self.on_done = on_done
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Read] = deque()
        self._worker: _Worker | None = None
        self.abandoned = 0  # threads still inside a read that timed out

    def submit(self, r: _Read) -> None:
        with self._lock:
            self._queue.append(r)
            self._ensure_worker()
            self._wake.notify()

    def check(self, now: float) -> None:
        """Abandon a worker whose read is past its deadline; its read answers 'timed out'."""
        with self._lock:
            w = self._worker
            r = w.current if w is not None else None
            if w is not None and r is not None and now > _abandon_at(r):
                self._abandon(w, r, now)

    def expire(self, r: _Read, now: float) -> None:
        """A caller gives up on `r`: answered 'timed out', its worker (if any) abandoned."""
        with self._lock:
            if r.done.is_set():
                return
            w = self._worker
            if w is not None and w.current is r:
                self._abandon(w, r, now)
                return
            if r in self._queue:
                self._queue.remove(r)
            _timed_out(r, now)

    def _abandon(self, w: _Worker, r: _Read, now: float) -> None:
        """With the lock held: leave `w` to its read, answer it, and go on with a new worker."""
        w.abandoned = True
        self._worker = None
        self.abandoned += 1
        _timed_out(r, now)
        if self._queue:
            self._ensure_worker()

    def _ensure_worker(self) -> None:
        """With the lock held: a worker for the queue, or, with too many stuck, fail it."""
        if self._worker is not None:
            return
        if self.abandoned >= MAX_ABANDONED:
            now = time.monotonic()
            while self._queue:
                r = self._queue.popleft()
                r.error = (
                    f"{r.path}: not read: {self.abandoned} model reads are stuck past their "
                    "deadline (a hung filesystem?)"
                )
                r.stalled = True
                r.finished = now
                r.done.set()
            return
        w = self._worker = _Worker()
        w.thread = threading.Thread(
            target=self._run, args=(w,), name="spark-guard model reader", daemon=True
        )
        w.thread.start()

    def _run(self, w: _Worker) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    if not self._wake.wait(IDLE_EXIT) and not self._queue:
                        if self._worker is w:
                            self._worker = None
                        return
                r = self._queue.popleft()
                r.started = time.monotonic()
                w.current = r
            model, error, timed_out = _read(r, self.headers)
            with self._lock:
                w.current = None
                if w.abandoned:
                    # Its read was answered as timed out long ago; this thread is done.
                    self.abandoned -= 1
                    return
                r.model, r.error, r.timed_out = model, error, timed_out
                r.finished = time.monotonic()
                r.done.set()
            with contextlib.suppress(Exception):  # waking the loop is a courtesy
                self.on_done()


def _abandon_at(r: _Read) -> float:
    assert r.started is not None
    return r.started + 1.25 * r.budget + SLACK


def _timed_out(r: _Read, now: float) -> None:
    r.error = f"{r.path}: model read timed out after {r.budget:g}s"
    r.timed_out = True
    r.finished = now
    r.done.set()


def _read(r: _Read, headers: HeaderCache) -> tuple[Model | None, str, bool]:
    """(model, problem, timed out): never raises, so a worker outlives any file."""
    assert r.started is not None
    try:
        if r.owner is None:
            return read_model(r.path, deadline=r.started + r.budget, cache=headers), "", False
        with as_user(r.owner, _gid_of(r.owner)):
            return read_model(r.path, deadline=r.started + r.budget, cache=headers), "", False
    except GgufOpenError as e:
        if r.owner is None:  # the caller's own rights: it may know what it could find out
            return None, f"{e.path}: {os.strerror(e.errno or 0)}", False
        # Read for someone else: one answer for every reason the open failed (ENOENT,
        # EACCES, ENOTDIR, ELOOP...), so they learn nothing of paths they cannot look at.
        return (
            None,
            f"{e.path}: cannot open the model (missing, or unreadable to {r.reader()})",
            False,
        )
    except GgufTimeout:
        return None, f"{r.path}: model read timed out after {r.budget:g}s", True
    except GgufError as e:
        return None, str(e), False
    except Exception as e:  # a worker must never die of a file
        return None, f"{r.path}: cannot read the model: {e}", False


class Predictor:
    def __init__(
        self,
        *,
        budget: float = READ_SECONDS,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """`budget`: seconds one model read may take. `on_ready`: called from the worker
        thread when a read is answered (the daemon wakes its loop with it)."""
        self.budget = budget
        self.on_ready = on_ready
        self._ready_lock = threading.Lock()
        self.headers = HeaderCache(8 << 20)  # ~25 DeepSeek-V3 headers
        self._reads: dict[tuple[str, int | None], _Read] = {}
        self._pool = _Pool(self.headers, self._ready)

    def _ready(self) -> None:
        with self._ready_lock:
            if self.on_ready is not None:
                self.on_ready()

    def close(self) -> None:
        """No `on_ready` call runs or will run once this returns (what it wakes may go)."""
        with self._ready_lock:
            self.on_ready = None

    @property
    def abandoned(self) -> int:
        """Worker threads left inside a read that never returned."""
        return self._pool.abandoned

    def _model(self, path: str, owner: int | None, wait: bool) -> Model | str | None:
        """The model, or why there is none, or None while it is being read."""
        key = (path, owner)
        now = time.monotonic()
        self._pool.check(now)
        self._prune(now)
        r = self._reads.get(key)
        if r is None:
            r = self._reads[key] = _Read(path, owner, self.budget)
            if sum(not x.done.is_set() for x in self._reads.values()) > MAX_WAITING:
                r.error = f"{path}: not read yet: {MAX_WAITING} model reads are waiting"
                r.stalled = True
                r.finished = now
                r.done.set()
            else:
                self._pool.submit(r)
        if wait:
            self._wait(r)
        if not r.done.is_set():
            return None
        return r.model if r.model is not None else r.error

    def _expired(self, r: _Read, now: float) -> bool:
        if not r.done.is_set():
            return False
        keep = FAIL_RETRY if r.model is None else FRESH
        if r.timed_out:
            keep = TIMEOUT_RETRY
        if r.stalled:  # asked again as soon as a stuck read has come back
            keep = 0.0 if self._pool.abandoned < MAX_ABANDONED else TIMEOUT_RETRY
        return now - r.finished >= keep

    def _prune(self, now: float) -> None:
        """Forget answers past their time; keep the models held, and the answers, bounded."""
        reads = self._reads
        for key in [k for k, r in reads.items() if self._expired(r, now)]:
            del reads[key]
        finished = sorted(
            ((r.finished, k) for k, r in reads.items() if r.done.is_set()), key=lambda x: x[0]
        )
        held = sum(r.model.cost for r in reads.values() if r.model is not None)
        for _, key in finished:
            if held <= HELD_COST and len(reads) <= MAX_READS:
                break
            model = reads.pop(key).model
            if model is not None:
                held -= model.cost

    def _wait(self, r: _Read) -> None:
        # Each turn may abandon a stuck worker; a read queued behind one then starts.
        give_up = time.monotonic() + 2 * (1.25 * r.budget + SLACK)
        while not r.done.wait(0.1):
            now = time.monotonic()
            self._pool.check(now)
            if now > give_up:
                self._pool.expire(r, now)

    def predict(
        self,
        command_lines: Sequence[Sequence[str]],
        environment: Mapping[str, str],
        mem_total: int,
        *,
        owner: int | None = None,
        wait: bool = True,
    ) -> Prediction | None:
        """None when no command line is a loader this knows (the config must say).

        `owner`: the uid whose file rights the model is read with (owner_of(the unit's
        manager)), and then a model it cannot open gets one answer whatever the reason;
        None: the caller's own rights, and the reason. `wait=False`: never block; a
        pending Prediction while the model is read (ask again later). Waiting lasts at
        most about the read's budget (READ_SECONDS)."""
        try:
            spec = first_spec(command_lines, environment)
        except SpecError as e:
            return Prediction(None, f"command line: {e}")
        if spec is None:
            return None
        return self.for_spec(spec, mem_total, owner=owner, wait=wait)

    def for_spec(
        self, spec: LoadSpec, mem_total: int, *, owner: int | None = None, wait: bool = True
    ) -> Prediction:
        if spec.kind == "vllm" and spec.gpu_fraction is not None:
            need = int(mem_total * spec.gpu_fraction)
            return Prediction(need, f"vLLM --gpu-memory-utilization {spec.gpu_fraction:g}", spec)
        if not spec.model:
            return Prediction(None, f"{spec.binary}: no -m/--model given", spec)
        for path in (spec.model, spec.mmproj):
            if path is not None and not os.path.isabs(path):
                return Prediction(None, f"{path}: relative model path", spec)
        model = self._model(spec.model, owner, wait)
        projector = self._model(spec.mmproj, owner, wait) if spec.mmproj else None
        for got in (model, projector):
            if isinstance(got, str):
                return Prediction(None, got, spec)
        if model is None or (spec.mmproj and projector is None):
            return Prediction(None, PENDING, spec, pending=True)
        assert isinstance(model, Model)
        settings = spec.settings
        if isinstance(projector, Model):
            settings = replace(settings, mmproj_bytes=projector.tensor_bytes)
        try:
            est = estimate(model, settings)
        except EstimateError as e:
            return Prediction(None, str(e), spec)
        source = f"{os.path.basename(spec.model)}, ctx {est.n_ctx}: {format_size(est.total)}"
        return Prediction(est.total, source, spec, est)
