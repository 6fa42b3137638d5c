"""Foresight against models that hang, explode or probe: real files, a real unprivileged uid.

The guard reads a model named in a user's unit as root; these tests check
that the read runs with the owner's rights, off the caller's thread, within
a deadline, and that no answer differs between a path that is absent and one
the owner may not read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.accounts import User
from spark_guard.core.argv.loadspec import LoadSpec
from spark_guard.foresight.predict import (
    MAX_WAITING_PER_OWNER,
    PENDING,
    Prediction,
    Predictor,
    owner_of,
)
from tests import data

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"
MEM_TOTAL = 128 * 2**30


def spec(model: str | Path) -> LoadSpec:
    return LoadSpec(kind="llama.cpp", binary="llama-server", model=str(model))


def answer(predictor: Predictor, model: str | Path, owner: int | None, within: float) -> Prediction:
    """Ask without waiting until the answer is there; fail if it takes longer than `within`."""
    give_up = time.monotonic() + within
    while True:
        p = predictor.for_spec(spec(model), MEM_TOTAL, owner=owner, wait=False)
        if not p.pending:
            return p
        assert time.monotonic() < give_up, f"{model}: still pending after {within}s"
        time.sleep(0.02)


def test_owner_of_a_unit_is_its_managers_user():
    assert owner_of("user:1000") == 1000
    assert owner_of("system") == 0


@pytest.mark.root
def test_asking_never_waits_and_a_fifo_is_answered_at_once(mallory: User):
    models = mallory.home / "models"
    mallory.sh(f"mkdir -p {models}; mkfifo {models}/fifo.gguf")  # no writer, ever
    predictor = Predictor()
    t = time.monotonic()
    first = predictor.for_spec(spec(models / "fifo.gguf"), MEM_TOTAL, owner=mallory.uid, wait=False)
    assert time.monotonic() - t < 0.1
    assert first.bytes is None
    if first.pending:
        assert first.source == PENDING
    got = answer(predictor, models / "fifo.gguf", mallory.uid, within=2.0)
    assert got.source == f"{models}/fifo.gguf: not a regular file"
    # The commands wait, and get the same answer as fast.
    t = time.monotonic()
    waited = Predictor().for_spec(spec(models / "fifo.gguf"), MEM_TOTAL, owner=mallory.uid)
    assert waited.source == got.source and time.monotonic() - t < 2.0


@pytest.mark.root
def test_her_own_model_is_read_with_her_rights(mallory: User):
    mine = mallory.home / "models" / "mine.gguf"
    mallory.sh(f"mkdir -p {mine.parent}; cp {data.smollm2()} {mine}")
    got = answer(Predictor(), mine, mallory.uid, within=5.0)
    assert got.bytes is not None and got.source.startswith("mine.gguf, ctx 8192: ")


@pytest.mark.root
def test_whether_a_root_only_path_exists_is_not_told_to_her(mallory: User, public_dir: Path):
    # As /etc/shadow: a root-only file in a directory she may search; as /root/x: a file in
    # a directory she may not; an absent file; a path through a file.
    shadow = public_dir / "shadow.gguf"
    shadow.write_bytes(b"root:$y$j9T$secret:19000:0:99999:7:::\n")
    shadow.chmod(0o600)
    vault = public_dir / "vault"
    vault.mkdir(mode=0o700)
    hidden = vault / "model.gguf"
    hidden.write_bytes(data.smollm2().read_bytes()[: 2**21])
    os.truncate(hidden, data.smollm2().stat().st_size)  # the header, and room for its tensors
    paths = {
        "root-only file": shadow,
        "file in a root-only dir": hidden,
        "absent file": public_dir / "absent.gguf",
        "absent file in a root-only dir": vault / "absent.gguf",
        "path through a file": shadow / "x.gguf",
    }
    predictor = Predictor()
    said = {
        what: answer(predictor, path, mallory.uid, within=5.0).source.replace(str(path), "PATH")
        for what, path in paths.items()
    }
    expected = f"PATH: cannot open the model (missing, or unreadable to uid {mallory.uid})"
    assert said == dict.fromkeys(paths, expected)
    # Root itself would have told them apart: the test is not blind.
    assert "not a GGUF file" in answer(Predictor(), shadow, None, within=5.0).source
    assert answer(Predictor(), hidden, None, within=5.0).bytes is not None
    # And so did the state of the guard before: the open ran with root's rights.
    assert "No such file" not in said["absent file"]


def test_a_bad_model_is_not_read_again_every_pass(public_dir: Path):
    bad = public_dir / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 4096)
    predictor = Predictor()
    first = answer(predictor, bad, 0, within=5.0)
    assert "tensor count 18446744073709551615 cannot fit" in first.source
    # Fixed on disk at once: the answer kept by path stands until FAIL_RETRY.
    bad.write_bytes(data.smollm2().read_bytes()[: 2**21])
    os.truncate(bad, data.smollm2().stat().st_size)
    again = predictor.for_spec(spec(bad), MEM_TOTAL, owner=0, wait=False)
    assert again.source == first.source
    # A new predictor (a command) reads the file as it is now.
    assert answer(Predictor(), bad, 0, within=5.0).bytes is not None


# --- a filesystem that never answers ---------------------------------------------------

HUNG = """
import json, os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from hangfs import HangFS
from spark_guard.foresight.predict import Predictor
from spark_guard.core.argv.loadspec import LoadSpec

mnt, good = sys.argv[3], sys.argv[4]
fs = HangFS(mnt)
p = Predictor(budget=0.4)
out = {}

def ask(path, wait=False):
    spec = LoadSpec(kind="llama.cpp", binary="llama-server", model=path)
    t = time.monotonic()
    got = p.for_spec(spec, 2**37, owner=0, wait=wait)
    return got, time.monotonic() - t

def settle(path):
    t = time.monotonic()
    while True:
        got, took = ask(path)
        out.setdefault("longest_ask", 0.0)
        out["longest_ask"] = max(out["longest_ask"], took)
        if not got.pending:
            return got.source, time.monotonic() - t
        time.sleep(0.01)

first, _ = ask(mnt + "/a.gguf")
out["first"] = [first.pending, first.source]
out["hung"] = settle(mnt + "/a.gguf")
out["good"] = settle(good)
out["hung_again"] = settle(mnt + "/a.gguf")
out["reads_after_again"] = fs.reads_waiting
for name in "bcd":
    settle(mnt + f"/{name}.gguf")
out["abandoned"] = p.abandoned
out["over_cap"] = settle(mnt + "/e.gguf")
out["over_cap_good"] = settle(os.path.dirname(good) + "/./" + os.path.basename(good))
fs.close()
t = time.monotonic()
while p.abandoned and time.monotonic() - t < 5:
    time.sleep(0.05)
out["abandoned_after_close"] = p.abandoned
out["after_close"] = settle(os.path.dirname(good) + "/./" + os.path.basename(good))
print(json.dumps(out))
"""


@pytest.mark.root
def test_a_read_that_never_returns_is_abandoned_and_the_loop_never_waits(tmp_path: Path):
    mnt = tmp_path / "hung"
    mnt.mkdir()
    out = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            HUNG,
            str(TESTS),
            str(SRC),
            str(mnt),
            str(data.smollm2()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["first"] == [True, PENDING]
    assert r["longest_ask"] < 0.1  # no ask ever waited on the hung reads
    source, took = r["hung"]
    assert source.endswith("/a.gguf: model read timed out after 0.4s")
    assert 0.4 < took < 1.5  # abandoned at 1.25 x the budget + 0.25 s
    source, took = r["good"]
    assert source.startswith("SmolLM2-135M-Instruct.Q4_1.gguf, ctx 8192: ") and took < 1.0
    source, took = r["hung_again"]
    assert source.endswith("model read timed out after 0.4s") and took < 0.05  # not retried
    assert r["reads_after_again"] == 1
    assert r["abandoned"] == 4  # the cap: no more threads are left in a read
    assert "not read: 4 model reads are stuck" in r["over_cap"][0]
    assert "not read: 4 model reads are stuck" in r["over_cap_good"][0]
    assert r["abandoned_after_close"] == 0  # the stuck threads ended with their reads
    # What was refused for that is asked again at once, and read.
    assert r["after_close"][0].startswith("SmolLM2-135M-Instruct.Q4_1.gguf, ctx 8192: ")


class _Found:
    cost = 64  # what a kept answer holds, roughly


def test_reads_are_fair_root_first_then_each_user_in_turn(mallory: User):
    """Her four slow reads queued before anyone else's used to make root's wait for all
    of them (10.7 s against 0.001 s alone, seen). Now root's read goes next, and another
    user's goes before her second one; past MAX_WAITING_PER_OWNER hers are refused for
    now, not queued."""
    ran: list[str] = []

    def slow(name: str):
        def job(_deadline: float) -> _Found:
            ran.append(name)
            time.sleep(0.2)
            return _Found()

        return job

    predictor = Predictor(budget=5.0)
    asked: list[tuple[str, int | None]] = [(f"m{i}", mallory.uid) for i in range(1, 5)]
    asked += [("n1", 65534), ("root", None)]
    for name, owner in asked:
        assert predictor.run(name, owner, slow(name), wait=False) is None
        if name == "m1":
            time.sleep(0.05)  # a worker has taken her first read: the others queue behind it
    for name, owner in asked:
        assert isinstance(predictor.run(name, owner, slow(name), wait=True), _Found), name
    assert ran[0] == "m1" and ran[1] == "root", ran  # root's next, after the read under way
    assert ran.index("n1") < ran.index("m3"), ran  # each user in turn
    flood = [predictor.run(f"f{i}", mallory.uid, slow(f"f{i}"), wait=False) for i in range(12)]
    refused = [a for a in flood if isinstance(a, str)]
    assert refused and all("model reads of uid" in a for a in refused), flood
    assert len(refused) == 12 - MAX_WAITING_PER_OWNER, flood
