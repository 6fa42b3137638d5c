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
- fairly: one queue per owner, root's (PID 1's units, the commands') read
  first, the users' in turn, one read each, and at most
  MAX_WAITING_PER_OWNER waiting per user. A user whose reads each take
  their whole deadline delays her own, not root's or her neighbours';
- once per file and identity: headers (and the problems of bad files) are
  cached by path, device, inode, size and mtime; an answer is kept for a
  while by path (failures FAIL_RETRY, timeouts TIMEOUT_RETRY), so a unit
  that restarts in a loop does not have its model read every pass.

A missing or unreadable model is not an error of the guard: the prediction
says why there is none, the unit is "footprint unknown" and the trend
guards it instead.

Servers that fill a share of the memory (vLLM, SGLang, TGI) are predicted
by that share of MemTotal: on unified memory the GPU's memory is the whole
pool. TGI's model directory (safetensors headers and config.json, read the
same way as a GGUF: off the loop, with the owner's rights) gives the least
it needs, weights and the KV cache of its warmup batch; the larger figure
is the footprint. docs/estimator.md says which rule is used when.
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
from typing import Protocol

from ..core.argv.loadspec import TGI_PREFILL_DEFAULT, LoadSpec, SpecError, first_spec
from ..core.quantities import format_size
from ..core.snapshot import manager_uid
from ..system.safefs import as_user
from ..system.worker import spawn
from . import safetensors
from .estimate import (
    MARGIN_EXACT,
    MARGIN_MIN,
    MARGIN_SHARE,
    RUNTIME,
    Estimate,
    EstimateError,
    Term,
    estimate,
    projector_compute_bytes,
    with_draft_and_adapters,
)
from .gguf import READ_SECONDS, HeaderCache, Model, header_cache, read_model
from .modelfile import ModelFileError, ModelOpenError, ModelTimeout

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
# Reads queued or under way for one user: her flood of slow reads is hers to wait out.
MAX_WAITING_PER_OWNER = 8
HELD_COST = 16 << 20  # models kept as answers (Model.cost), on top of the header cache: a
# hostile header may cost ~8 MB in Python objects, a real one 0.1-0.5 MB

NOBODY_GID = 65534
GiB = 1 << 30
# SGLang without --mem-fraction-static derives one from the GPU's memory; its versions have
# kept 0.88 of it, or all but a reserve of at least 10 GiB on a GPU over 60 GiB (server_args,
# _handle_gpu_memory_settings). The larger of the two is the least any of them leaves.
SGLANG_FRACTION = 0.88
SGLANG_RESERVE_MIN = 10 * GiB
SGLANG_RESERVE_ABOVE = 60 * GiB
TGI_BLOCK = 16  # tokens a KV block holds (TGI's BLOCK_SIZE): its cache is whole blocks


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


class Held(Protocol):
    """What a read answers with: a model, or what a job given to Predictor.run returns."""

    @property
    def cost(self) -> int: ...  # rough bytes of memory it holds: answers kept are bounded by it


@dataclass(frozen=True)
class Prediction:
    bytes: int | None
    source: str  # how it was found, or why there is none
    spec: LoadSpec | None = None
    estimate: Estimate | None = None
    pending: bool = False  # the model is being read: ask again (the next pass)
    # A client's (clients.py): the uid it runs as, whose server its load lands in.
    runs_as: int | None = None
    # Bytes of model files the load reads through the page cache as it loads: on unified
    # memory that cache sits in MemFree's way beside the GPU copy, unless room is made.
    page_cache: int = 0


# How for_spec gets a model a command line names: (the path as named, "gguf" or
# "safetensors", wait) -> the model, or why there is none, or None while it is read. By
# default the path is read as it is, with `owner`'s rights (Predictor._model); a caller
# whose paths mean something else (a container's, behind its mounts: containers.py) gives
# its own, which reads through Predictor.run so the read stays off the loop and bounded.
ModelRead = Callable[[str, str, bool], Model | safetensors.Model | Held | str | None]


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
    kind: str = "gguf"  # or "safetensors": a model directory, its index, or one file
    done: threading.Event = field(default_factory=threading.Event)
    started: float | None = None  # monotonic, when a worker took it
    finished: float = 0.0
    model: Model | safetensors.Model | Held | None = None
    job: Callable[[float], Held] | None = None  # Predictor.run's read, given its deadline
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


class _Queues:
    """Reads waiting, one queue per owner: root's (and the caller's own, None) first, then
    the users' in turn, one read each."""

    def __init__(self) -> None:
        self._by_owner: dict[int | None, deque[_Read]] = {}
        self._turn: deque[int | None] = deque()  # users with reads waiting, next first

    def __bool__(self) -> bool:
        return bool(self._by_owner)

    def __contains__(self, r: _Read) -> bool:
        return r in self._by_owner.get(r.owner, ())

    def waiting(self, owner: int | None) -> int:
        return len(self._by_owner.get(owner, ()))

    def append(self, r: _Read) -> None:
        if r.owner not in self._by_owner:
            self._by_owner[r.owner] = deque()
            if not _is_root(r.owner):
                self._turn.append(r.owner)
        self._by_owner[r.owner].append(r)

    def remove(self, r: _Read) -> None:
        queue = self._by_owner[r.owner]
        queue.remove(r)
        if not queue:
            self._forget(r.owner)

    def popleft(self) -> _Read:
        for owner in (None, 0):
            if owner in self._by_owner:
                return self._take(owner)
        owner = self._turn.popleft()
        r = self._take(owner)
        if owner in self._by_owner:
            self._turn.append(owner)  # her next read waits for everyone else's turn
        return r

    def _take(self, owner: int | None) -> _Read:
        queue = self._by_owner[owner]
        r = queue.popleft()
        if not queue:
            self._forget(owner)
        return r

    def _forget(self, owner: int | None) -> None:
        del self._by_owner[owner]
        if owner in self._turn:
            self._turn.remove(owner)


def _is_root(owner: int | None) -> bool:
    return owner is None or owner == 0


class _Pool:
    """One worker thread at a time takes reads, fairly (_Queues); a stuck one is replaced."""

    def __init__(
        self,
        headers: HeaderCache,
        on_done: Callable[[], None],
        shards: safetensors.ShardCache | None = None,
    ) -> None:
        self.headers = headers
        self.shards = shards
        self.on_done = on_done
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue = _Queues()
        self._worker: _Worker | None = None
        self.abandoned = 0  # threads still inside a read that timed out

    def waiting(self, owner: int | None) -> int:
        """Reads of `owner` queued or under way."""
        with self._lock:
            w = self._worker
            busy = w is not None and w.current is not None and w.current.owner == owner
            return self._queue.waiting(owner) + busy

    def submit(self, r: _Read) -> None:
        with self._lock:
            self._queue.append(r)
            self._ensure_worker()
            self._wake.notify()

    def check(self, now: float) -> None:
        """Abandon a worker whose read is past its deadline; its read answers 'timed out'.
        A queue left with no worker (none could start) gets one now if one can."""
        with self._lock:
            if self._queue and self._worker is None:
                self._ensure_worker()
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
                stuck = f"{self.abandoned} model reads are stuck past their deadline"
                r.error = f"{r.path}: not read: {stuck} (a hung filesystem?)"
                r.stalled, r.finished = True, now
                r.done.set()
            return
        w = _Worker()
        w.thread = spawn(self._run, "spark-guard model reader", w)
        if w.thread is not None:  # else the queue waits for the next request's try
            self._worker = w

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
            model, error, timed_out = _read(r, self.headers, self.shards)
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


def _load(
    r: _Read, headers: HeaderCache, shards: safetensors.ShardCache | None
) -> Model | safetensors.Model | Held:
    assert r.started is not None
    deadline = r.started + r.budget
    if r.job is not None:
        return r.job(deadline)
    if r.kind == "safetensors":
        return safetensors.read_model(r.path, deadline=deadline, cache=shards)
    return read_model(r.path, deadline=deadline, cache=headers)


def _read(
    r: _Read, headers: HeaderCache, shards: safetensors.ShardCache | None = None
) -> tuple[Model | safetensors.Model | Held | None, str, bool]:
    """(model, problem, timed out): never raises, so a worker outlives any file."""
    try:
        if r.owner is None:
            return _load(r, headers, shards), "", False
        with as_user(r.owner, _gid_of(r.owner)):
            return _load(r, headers, shards), "", False
    except ModelOpenError as e:
        if r.owner is None:  # the caller's own rights: it may know what it could find out
            return None, f"{e.path}: {os.strerror(e.errno or 0)}", False
        # Read for someone else: one answer for every reason the open failed (ENOENT,
        # EACCES, ENOTDIR, ELOOP...), so they learn nothing of paths they cannot look at.
        return (
            None,
            f"{e.path}: cannot open the model (missing, or unreadable to {r.reader()})",
            False,
        )
    except ModelTimeout:
        return None, f"{r.path}: model read timed out after {r.budget:g}s", True
    except ModelFileError as e:
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
        self.headers = header_cache(8 << 20)  # ~25 DeepSeek-V3 headers
        self.shards = safetensors.shard_cache()  # a few hundred bytes each
        self._reads: dict[tuple[str, str, int | None], _Read] = {}
        self._pool = _Pool(self.headers, self._ready, self.shards)

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

    def run(
        self, name: str, owner: int | None, job: Callable[[float], Held], *, wait: bool = True
    ) -> Held | str | None:
        """Any other read of a user's files (an LM Studio model key's folders, ...), done
        the way a model header is read: `job(deadline)` runs on the worker thread with
        `owner`'s file rights and returns what it found (with a `cost`), or raises a
        ModelFileError (ModelOpenError: one answer whatever the reason, as for a model; ModelTimeout
        past the deadline). Answers are kept by `name` and owner, as model reads are by path.
        The answer, or why there is none, or None while it is pending (`wait=False`)."""
        return self._model(name, owner, wait, kind="job", job=job)

    def _model(
        self,
        path: str,
        owner: int | None,
        wait: bool,
        kind: str = "gguf",
        job: Callable[[float], Held] | None = None,
    ) -> Model | safetensors.Model | Held | str | None:
        """The model, or why there is none, or None while it is being read."""
        key = (kind, path, owner)
        now = time.monotonic()
        self._pool.check(now)
        self._prune(now)
        r = self._reads.get(key)
        if r is None:
            r = self._reads[key] = _Read(path, owner, self.budget, kind, job=job)
            if sum(not x.done.is_set() for x in self._reads.values()) > MAX_WAITING:
                r.error = f"{path}: not read yet: {MAX_WAITING} model reads are waiting"
                r.stalled = True
                r.finished = now
                r.done.set()
            elif not _is_root(owner) and self._pool.waiting(owner) >= MAX_WAITING_PER_OWNER:
                r.error = (
                    f"{path}: not read yet: {MAX_WAITING_PER_OWNER} model reads of uid "
                    f"{owner} are waiting"
                )
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
        read: ModelRead | None = None,
    ) -> Prediction | None:
        """None when no command line is a loader this knows (the config must say).

        `owner`: the uid whose file rights the model is read with (owner_of(the unit's
        manager)), and then a model it cannot open gets one answer whatever the reason;
        None: the caller's own rights, and the reason. `wait=False`: never block; a
        pending Prediction while the model is read (ask again later). Waiting lasts at
        most about the read's budget (READ_SECONDS). `read`: how a named model is read
        instead (ModelRead; `owner` is then not used)."""
        try:
            spec = first_spec(command_lines, environment)
        except SpecError as e:
            return Prediction(None, f"command line: {e}")
        if spec is None:
            return None
        return self.for_spec(spec, mem_total, owner=owner, wait=wait, read=read)

    def for_spec(
        self,
        spec: LoadSpec,
        mem_total: int,
        *,
        owner: int | None = None,
        wait: bool = True,
        read: ModelRead | None = None,
    ) -> Prediction:
        if read is None:
            read = self._reader(owner)
        if spec.kind == "vllm" and spec.gpu_fraction is not None:
            # Its share of the whole pool, which it fills with KV cache. Its safetensors pass
            # the page cache as it loads too; not read for that (the share needs no files and
            # is known at once): make-room drops that cache (docs/unified-memory.md).
            need = int(mem_total * spec.gpu_fraction)
            return Prediction(need, f"vLLM --gpu-memory-utilization {spec.gpu_fraction:g}", spec)
        if spec.kind == "sglang":
            return sglang_prediction(spec, mem_total)
        if spec.kind == "tgi":
            return self._tgi(spec, mem_total, read, wait)
        if not spec.model:
            return Prediction(None, f"{spec.binary}: no -m/--model given", spec)
        for path in (spec.model, spec.mmproj, spec.draft, *spec.loras):
            if path is not None and not os.path.isabs(path):
                return Prediction(None, f"{path}: relative model path", spec)
        model = read(spec.model, "gguf", wait)
        projector = read(spec.mmproj, "gguf", wait) if spec.mmproj else None
        draft = read(spec.draft, "gguf", wait) if spec.draft else None
        loras = [read(path, "gguf", wait) for path in spec.loras]
        for got in (model, projector, draft, *loras):
            if isinstance(got, str):
                return Prediction(None, got, spec)
        if (
            model is None
            or (spec.mmproj and projector is None)
            or (spec.draft and draft is None)
            or any(a is None for a in loras)
        ):
            return Prediction(None, PENDING, spec, pending=True)
        assert isinstance(model, Model)
        settings = spec.settings
        if isinstance(projector, Model):
            settings = replace(
                settings,
                mmproj_bytes=projector.tensor_bytes,
                mmproj_compute=projector_compute_bytes(projector, settings.flash_attn)[0],
            )
        try:
            est = estimate(model, settings)
            extra = ""
            if isinstance(draft, Model) or loras:
                assert spec.draft_settings is not None or draft is None
                draft_est = (
                    estimate(draft, spec.draft_settings)
                    if isinstance(draft, Model) and spec.draft_settings
                    else None
                )
                adapters = [
                    (os.path.basename(path), a.tensor_bytes)
                    for path, a in zip(spec.loras, loras, strict=True)
                    if isinstance(a, Model)
                ]
                name = os.path.basename(spec.draft or "")
                est = with_draft_and_adapters(est, draft_est, name, adapters)
                if draft_est is not None:
                    extra += f" (with draft {name}, ctx {draft_est.n_ctx})"
                if adapters:
                    extra += f" (with {len(adapters)} LoRA adapter(s))"
        except EstimateError as e:
            return Prediction(None, str(e), spec)
        source = f"{os.path.basename(spec.model)}, ctx {est.n_ctx}{extra}: {format_size(est.total)}"
        if spec.rule:  # koboldcpp's and llama-box's: their defaults, said
            source = f"{spec.binary} {source} ({spec.rule})"
        # llama.cpp maps the files (or reads them, --no-mmap): their tensors pass the page cache.
        cache = model.tensor_bytes + sum(
            m.tensor_bytes for m in (draft, *loras) if isinstance(m, Model)
        )
        return Prediction(est.total, source, spec, est, page_cache=cache)

    def _reader(self, owner: int | None) -> ModelRead:
        """The paths as they are, read with `owner`'s rights (the default ModelRead)."""

        def read(path: str, kind: str, wait: bool) -> Model | safetensors.Model | Held | str | None:
            return self._model(path, owner, wait, kind=kind)

        return read

    def _tgi(self, spec: LoadSpec, mem_total: int, read: ModelRead, wait: bool) -> Prediction:
        """The larger of TGI's share of MemTotal and the least its model needs."""
        fraction = spec.gpu_fraction if spec.gpu_fraction is not None else 1.0
        share = int(mem_total * fraction)
        said = f"tgi {spec.rule} of MemTotal = {format_size(share)}"
        if not spec.model:
            return Prediction(share, f"{said}; weights not read: no --model-id", spec)
        if not os.path.isabs(spec.model):
            why = f"{spec.model}: not an absolute path (a Hub id?)"
            return Prediction(share, f"{said}; weights not read: {why}", spec)
        got = read(spec.model, "safetensors", wait)
        if got is None:
            return Prediction(None, PENDING, spec, pending=True)
        if isinstance(got, str):
            return Prediction(share, f"{said}; weights not read: {got}", spec)
        assert isinstance(got, safetensors.Model) and got.config is not None
        least = tgi_least(got, spec)
        weights, kv = least.terms[0].bytes, least.terms[1].bytes
        needs = (
            f"safetensors weights {format_size(weights)} + KV {format_size(kv)} "
            f"({least.n_ctx} tokens)"
        )
        if least.total > share:
            source = f"tgi: {needs} = {format_size(least.total)}, above its {spec.rule} share"
            return Prediction(least.total, source, spec, least, page_cache=weights)
        return Prediction(
            share,
            f"{said} (it fills it with KV cache); {needs} fit in it",
            spec,
            page_cache=weights,
        )


def sglang_prediction(spec: LoadSpec, mem_total: int) -> Prediction:
    """SGLang's static pool (weights and KV cache): --mem-fraction-static of the memory."""
    if spec.gpu_fraction is not None:
        need = int(mem_total * spec.gpu_fraction)
        return Prediction(need, f"sglang {spec.rule} of MemTotal", spec)
    need = int(mem_total * SGLANG_FRACTION)
    if mem_total > SGLANG_RESERVE_ABOVE:
        need = max(need, mem_total - SGLANG_RESERVE_MIN)
    fraction = need / mem_total if mem_total else 0.0
    source = f"sglang --mem-fraction-static (its default here, at most {fraction:.3f}) of MemTotal"
    return Prediction(need, source, spec)


def tgi_least(model: safetensors.Model, spec: LoadSpec) -> Estimate:
    """What TGI holds at least: the weights as stored, the KV cache of its warmup batch
    (--max-batch-prefill-tokens, by default 4096 capped at the model's context) or of one
    request of --max-total-tokens, whichever is more, in whole blocks, and the CUDA context."""
    config = model.config
    assert config is not None
    prefill = spec.prefill_tokens
    if prefill is None:
        prefill = min(TGI_PREFILL_DEFAULT, config.max_position_embeddings or TGI_PREFILL_DEFAULT)
    tokens = max(prefill, spec.max_total_tokens or 0)
    cells = -(-tokens // TGI_BLOCK) * TGI_BLOCK
    per_token = config.kv_bytes_per_token(spec.kv_bytes)
    notes = "; ".join(config.notes)
    terms = (
        Term(
            "weights",
            model.tensor_bytes,
            True,
            f"{model.tensors} tensors in {len(model.files)} safetensors file(s)",
        ),
        Term(
            "kv",
            cells * per_token,
            True,
            f"{cells} tokens x {per_token} bytes"
            f" ({config.layers} layers x {config.kv_heads} KV heads x {config.head_dim} x 2 x"
            f" {spec.kv_bytes})" + (f"; {notes}" if notes else ""),
        ),
        Term("host", RUNTIME, False, "CUDA context and runtime"),
    )
    exact = model.tensor_bytes + cells * per_token
    margin = max(int(MARGIN_EXACT * exact + MARGIN_SHARE * RUNTIME), MARGIN_MIN)
    return Estimate(terms, margin, cells)
