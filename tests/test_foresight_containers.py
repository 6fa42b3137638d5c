"""Foresight for a loader container: its command read as a unit's, its model through its mounts.

Real files: sparse GGUFs written by lab/synth.py in a temp dir that a
`Container` value (as the engine's inspect answer is read into one) mounts at
/models. No engine is needed: the mounts are data. The figures are checked
against Predictor.predict on the same command line with the host's paths.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lab import synth
from spark_guard.foresight.containers import MountError, host_path, predict_container
from spark_guard.foresight.predict import PENDING, Prediction, Predictor
from spark_guard.system.engine import Container

MEM_TOTAL = 128 * 2**30
TINY = synth.Spec("Tiny", "llama", 2, 256, 4, 4, 64, 64, 2048, 1000, n_ff=512)
CID = "0123456789abcdef" * 4


def container(command: tuple[str, ...], *mounts: tuple[str | Path, str]) -> Container:
    return Container(
        id=CID,
        name="llm",
        image="ghcr.io/ggml-org/llama.cpp:server",
        command=command,
        restart="unless-stopped",
        running=True,
        mounts=tuple((str(s), d) for s, d in mounts),
    )


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """tmp/models/Tiny.gguf (one file) and tmp/models/sub/Tiny-0000N-of-00002.gguf (split)."""
    models = tmp_path / "models"
    models.mkdir()
    synth.write(TINY, models)
    (models / "sub").mkdir()
    synth.write(TINY, models / "sub", shards=2)
    return tmp_path


def llama(model: str, *more: str) -> tuple[str, ...]:
    return ("/app/llama-server", "-m", model, "-c", "1024", *more)


def predict(c: Container, *, wait: bool = True) -> Prediction | None:
    return predict_container(Predictor(), c, MEM_TOTAL, wait=wait)


# --- the same figure as a unit with the host's path -----------------------------------------


@pytest.mark.parametrize("name", ["Tiny.gguf", "sub/Tiny-00001-of-00002.gguf"])
def test_a_model_in_a_mount_gets_the_units_figure(host: Path, name: str):
    models = host / "models"
    got = predict(container(llama(f"/models/{name}"), (models, "/models")))
    unit = Predictor().predict([llama(str(models / name))], {}, MEM_TOTAL)
    assert unit is not None and unit.bytes is not None and unit.estimate is not None
    assert got is not None and got.estimate is not None
    assert got.bytes == unit.bytes
    assert got.estimate.terms == unit.estimate.terms
    assert got.spec is not None and got.spec.model == f"/models/{name}"  # the container's path
    assert got.source == f"{unit.source}; /models/{name} is the host's {models / name}"


def test_the_model_named_by_the_containers_environment_is_read(host: Path):
    """The llama.cpp server image takes its model from LLAMA_ARG_MODEL (`docker run -e
    LLAMA_ARG_MODEL=/models/Tiny.gguf ghcr.io/ggml-org/llama.cpp:server`): read from the
    engine's Config.Env, only the variables foresight reads and bounded as a unit's
    Environment= is, through the same mounts; the figure is the unit's with the same
    environment. A megabyte of other variables is dropped on reading."""
    models = host / "models"
    inspect = {
        "Id": CID,
        "Name": "/llm",
        "Path": "/app/llama-server",
        "Args": ["--port", "8080"],
        "Config": {
            "Image": "ghcr.io/ggml-org/llama.cpp:server",
            "Env": [
                "PATH=/usr/bin",
                "JUNK=" + "x" * (1 << 20),
                "LLAMA_ARG_MODEL=/models/Tiny.gguf",
                "LLAMA_ARG_CTX_SIZE=1024",
                7,
            ],
        },
        "State": {"Running": True},
        "Mounts": [{"Source": str(models), "Destination": "/models"}],
    }
    c = Container.from_inspect(inspect)
    assert c.environment == ("LLAMA_ARG_MODEL=/models/Tiny.gguf", "LLAMA_ARG_CTX_SIZE=1024")
    got = predict(c)
    env = {"LLAMA_ARG_MODEL": str(models / "Tiny.gguf"), "LLAMA_ARG_CTX_SIZE": "1024"}
    unit = Predictor().predict([("/app/llama-server", "--port", "8080")], env, MEM_TOTAL)
    assert unit is not None and unit.bytes is not None
    assert got is not None and got.bytes == unit.bytes, got
    assert f"/models/Tiny.gguf is the host's {models / 'Tiny.gguf'}" in got.source


def test_the_longest_mount_wins_and_a_mounted_file_is_read(host: Path):
    models = host / "models"
    # /models is something else entirely; /models/deep is the directory with the model.
    c = container(
        llama("/models/deep/Tiny.gguf"), (host / "nowhere", "/models"), (models, "/models/deep")
    )
    unit = Predictor().predict([llama(str(models / "Tiny.gguf"))], {}, MEM_TOTAL)
    got = predict(c)
    assert unit is not None and got is not None and got.bytes == unit.bytes
    # A single file mounted as itself (-v /srv/m.gguf:/m.gguf).
    got = predict(container(llama("/m.gguf"), (models / "Tiny.gguf", "/m.gguf")))
    assert got is not None and got.bytes == unit.bytes


def test_through_a_shell_and_a_wrapper(host: Path):
    models = host / "models"
    unit = Predictor().predict([llama(str(models / "Tiny.gguf"))], {}, MEM_TOTAL)
    script = "exec env LLAMA_CACHE=/tmp llama-server -m /models/Tiny.gguf -c 1024"
    got = predict(container(("/bin/sh", "-c", script), (models, "/models")))
    assert unit is not None and got is not None and got.bytes == unit.bytes


def test_asked_without_waiting_it_is_pending_then_the_same(host: Path):
    models = host / "models"
    c = container(llama("/models/Tiny.gguf"), (models, "/models"))
    predictor = Predictor()
    first = predict_container(predictor, c, MEM_TOTAL, wait=False)
    assert first is not None
    if first.pending:
        assert first.bytes is None and first.source == PENDING
    give_up = time.monotonic() + 5
    got = first
    while got.pending:
        assert time.monotonic() < give_up
        time.sleep(0.02)
        again = predict_container(predictor, c, MEM_TOTAL, wait=False)
        assert again is not None
        got = again
    unit = Predictor().predict([llama(str(models / "Tiny.gguf"))], {}, MEM_TOTAL)
    assert unit is not None and got.bytes == unit.bytes


# --- rules that need no file -----------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ("vllm", "serve", "/models/x", "--gpu-memory-utilization", "0.5"),
        (
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/models/x",
            "--gpu-memory-utilization=0.5",
        ),
    ],
)
def test_vllm_is_its_share_of_the_pool_as_for_a_unit(host: Path, command: tuple[str, ...]):
    got = predict(container(command, (host / "models", "/models")))
    unit = Predictor().predict([command], {}, MEM_TOTAL)
    assert got is not None and unit is not None
    assert got.bytes == unit.bytes == MEM_TOTAL // 2
    assert got.source == "vLLM --gpu-memory-utilization 0.5"
    # Its default, with no mount at all: the rule reads no file.
    got = predict(container(("vllm", "serve", "/opt/model")))
    assert got is not None and got.bytes == int(MEM_TOTAL * 0.9)


def test_tgi_keeps_its_share_and_says_the_weights_were_not_read(host: Path):
    command = (
        "text-generation-launcher",
        "--model-id",
        "/models/sub",
        "--cuda-memory-fraction",
        "0.5",
    )
    got = predict(container(command, (host / "models", "/models")))
    assert got is not None and got.bytes == int(MEM_TOTAL * 0.9 * 0.5)
    assert "weights not read: /models/sub: a model directory in a container is not read" in (
        got.source
    )


# --- refused: no file prediction ---------------------------------------------------------------


def test_a_path_in_no_mount_is_the_images_own_and_not_read(host: Path):
    models = host / "models"
    for path in ("/opt/Tiny.gguf", "/models2/Tiny.gguf", "/Tiny.gguf"):
        got = predict(container(llama(path), (models, "/models")))
        assert got is not None and got.bytes is None and not got.pending
        assert got.source == (
            f"{path}: in no mount of the container (the image's own files are not read)"
        )
    # Not even when the host happens to have a file at that very path.
    got = predict(container(llama(str(models / "Tiny.gguf")), (host / "other", "/elsewhere")))
    assert got is not None and got.bytes is None and "in no mount" in got.source


def test_dot_dot_and_relative_paths_are_refused_never_resolved(host: Path):
    models = host / "models"
    secret = host / "secret"
    secret.mkdir()
    synth.write(TINY, secret)  # where a textual join would land: readable, and not read
    for path in ("/models/../secret/Tiny.gguf", "/models/sub/../../secret/Tiny.gguf"):
        got = predict(container(llama(path), (models, "/models")))
        assert got is not None and got.bytes is None
        assert got.source == f"{path}: '..' is not followed in a container's path"
    # A '..' that would stay inside the mount is refused too: the text is not the truth there.
    got = predict(container(llama("/models/sub/../Tiny.gguf"), (models, "/models")))
    assert got is not None and got.bytes is None and "'..'" in got.source
    got = predict(container(llama("models/Tiny.gguf"), (host, "/")))
    assert got is not None and got.bytes is None
    assert got.source == "models/Tiny.gguf: relative model path"


def test_a_symlink_is_followed_only_while_it_stays_beneath_its_mount(host: Path):
    """A Hugging Face cache, as vLLM's and TGI's images mount it: a snapshot's files are
    relative symlinks into `../../blobs/`. They are followed, component by component,
    while they stay beneath the mount (RESOLVE_BENEATH's rule, without realpath); one
    that climbs out of it, or an absolute one (inside a container it names the
    container's root, not the host's), is refused, naming the link."""
    hub = host / "hub"
    repo = hub / "models--org--Tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    blob = repo / "blobs" / ("e3b0c442" * 8)
    (host / "models" / "Tiny.gguf").rename(blob)
    (repo / "snapshots" / "abc123" / "Tiny.gguf").symlink_to(f"../../blobs/{blob.name}")
    unit = Predictor().predict([llama(str(blob))], {}, MEM_TOTAL)
    assert unit is not None and unit.bytes is not None
    inside = "/root/.cache/huggingface/hub/models--org--Tiny-GGUF/snapshots/abc123/Tiny.gguf"
    mount = (hub, "/root/.cache/huggingface/hub")
    got = predict(container(llama(inside), mount))
    assert got is not None and got.bytes == unit.bytes, got
    # A split model: each shard by its own name, each a symlink to its own blob.
    sub = host / "models" / "sub"
    for n in (1, 2):
        shard = f"Tiny-0000{n}-of-00002.gguf"
        (sub / shard).rename(repo / "blobs" / f"shard{n}")
        (repo / "snapshots" / "abc123" / shard).symlink_to(f"../../blobs/shard{n}")
    split = inside.replace("Tiny.gguf", "Tiny-00001-of-00002.gguf")
    got = predict(container(llama(split), mount))
    assert got is not None and got.bytes is not None, got
    # Out of the mount, by '..' or by an absolute path: refused.
    secret = host / "secret.gguf"
    blob.rename(secret)
    (repo / "snapshots" / "abc123" / "out.gguf").symlink_to("../../../../secret.gguf")
    (repo / "snapshots" / "abc123" / "abs.gguf").symlink_to(str(secret))
    for name, why in (("out.gguf", "'..' above the mount"), ("abs.gguf", "absolute path")):
        got = predict(container(llama(inside.replace("Tiny.gguf", name)), mount))
        assert got is not None, name
        assert got.bytes is None and why in got.source, got.source
        assert "in a container's mount" in got.source


def test_a_symlinked_mount_source_or_directory_is_refused(host: Path):
    models = host / "models"
    (host / "linkdir").symlink_to(models)
    got = predict(container(llama("/models/Tiny.gguf"), (host / "linkdir", "/models")))
    assert got is not None and got.bytes is None
    assert got.source == (
        f"/models/Tiny.gguf: {host}/linkdir/Tiny.gguf: 'linkdir' is a symlink, "
        "not followed in a container's mount"
    )
    # A directory inside the mount that is an absolute symlink: the same.
    (models / "deeper").symlink_to(models / "sub")
    got = predict(container(llama("/models/deeper/Tiny-00001-of-00002.gguf"), (models, "/models")))
    assert got is not None and got.bytes is None
    assert "'deeper' is a symlink to an absolute path" in got.source, got.source


def test_a_fifo_or_a_missing_file_answers_at_once(host: Path):
    models = host / "models"
    os.mkfifo(models / "fifo.gguf")  # no writer, ever: an open without O_NONBLOCK would hang
    t = time.monotonic()
    got = predict(container(llama("/models/fifo.gguf"), (models, "/models")))
    assert time.monotonic() - t < 2
    assert got is not None and got.bytes is None
    assert got.source == f"/models/fifo.gguf: {models}/fifo.gguf: not a regular file"
    got = predict(container(llama("/models/none.gguf"), (models, "/models")))
    assert got is not None and got.bytes is None
    assert got.source == f"/models/none.gguf: {models}/none.gguf: No such file or directory"


def test_a_non_loader_is_none(host: Path):
    models = host / "models"
    assert predict(container(("nginx", "-g", "daemon off;"), (models, "/models"))) is None
    assert predict(container(("/bin/sh", "-c", "sleep infinity"), (models, "/models"))) is None
    assert predict(container(())) is None


# --- the mapping, pure --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inside", "mounts", "expected"),
    [
        ("/models/x.gguf", [("/srv/m", "/models")], "/srv/m/x.gguf"),
        ("/models/./a//x.gguf", [("/srv/m", "/models/")], "/srv/m/a/x.gguf"),
        ("/models/x.gguf", [("/srv/m", "/models"), ("/srv/x", "/models/x.gguf")], "/srv/x"),
        ("/models/a/x", [("/srv/a", "/models/a"), ("/srv/m", "/models")], "/srv/a/x"),
        ("/x.gguf", [("/srv/root", "/")], "/srv/root/x.gguf"),
    ],
)
def test_host_path(inside: str, mounts: list[tuple[str, str]], expected: str):
    assert host_path(mounts, inside) == expected


@pytest.mark.parametrize(
    ("inside", "mounts", "why"),
    [
        ("/models2/x", [("/srv/m", "/models")], "in no mount"),
        ("/mod/x", [("/srv/m", "/models")], "in no mount"),
        ("/models/x", [("/srv/m", "models")], "in no mount"),  # not a destination at all
        ("/models/x", [("/srv/m", "/a/../models")], "in no mount"),
        ("/models/x", [("", "/models")], "is not a path on the host"),  # a tmpfs
        ("/models/x", [("/srv/../etc", "/models")], "'..' is not followed"),
        ("/models/../etc/shadow", [("/srv/m", "/models")], "'..' is not followed"),
        ("x.gguf", [("/srv/m", "/")], "a relative path"),
    ],
)
def test_host_path_refuses(inside: str, mounts: list[tuple[str, str]], why: str):
    with pytest.raises(MountError, match=why):
        host_path(mounts, inside)


def test_a_symlink_into_a_deep_tree_is_refused_before_it_takes_every_fd(host: Path):
    """Each level below the mount holds an fd while it is walked: a symlink to a path
    2,000 levels deep took the daemon's every fd (EMFILE for the loop too). The walk
    stops at its depth and step caps, and says so."""
    models = host / "models"
    d = models
    for _ in range(200):
        d = d / "d"
    d.mkdir(parents=True)
    (models / "deep.gguf").symlink_to("/".join(["d"] * 200) + "/x.gguf")
    got = predict(container(llama("/models/deep.gguf"), (models, "/models")))
    assert got is not None and got.bytes is None
    assert "deeper than 64 levels" in got.source, got.source
