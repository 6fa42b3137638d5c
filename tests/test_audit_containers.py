"""`spark-guard audit` on loader containers, against a real private dockerd (issue 19).

One dockerd for the module (lab/engine.py), its containers made once: a loader by its
image under `unless-stopped`, one by its command under `on-failure:3`, one under `no`,
a non-loader (`nginx:test` running sleep) under `unless-stopped`, and a protected loader
under `always`. Audit runs as an admin runs it (`python -m spark_guard audit --config`),
its [containers] engines naming the private socket; no systemd manager is reachable
(as in test_audit_cli), so it exits 2 whatever the containers say.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lab.engine import DOCKER, DockerD

SLEEP = ("sleep", "infinity")
# A loader by its command only (the word llama-server), as in test_engine.
BY_COMMAND = ("python3", "-c", "import time; time.sleep(3600)", "llama-server")
ON_BOOT = (
    "its engine starts it at every boot, before anyone can log in; spark-guard blocks it at "
    'boot only if its footprint is known ([loaders.footprint] "container:{name}" = "SIZE") '
    "or foreseeable"
)


@pytest.fixture(scope="module")
def dockerd(dockerd: DockerD) -> DockerD:
    """conftest's private dockerd, with this module's containers."""
    d = dockerd
    made = [
        ("llm", d.tag("vllm/vllm-openai:test"), "unless-stopped", SLEEP, True),
        ("srv", d.tag("sg-plain:test"), "on-failure:3", BY_COMMAND, True),
        ("quiet", d.tag("lmsysorg/sglang:test"), "no", SLEEP, False),
        ("web", d.tag("nginx:test"), "unless-stopped", SLEEP, True),
        ("kept", "vllm/vllm-openai:test", "always", SLEEP, True),
    ]
    for name, image, restart, command, run in made:
        d.docker(
            "run" if run else "create",
            *(["-d"] if run else []),
            "--name",
            name,
            "--network",
            "none",
            "--restart",
            restart,
            image,
            *command,
        )
    return d


def audit(tmp_path: Path, engines: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nsystem_manager = "{tmp_path}/no-pid1/private"\n'
        f'user_runtime = "{tmp_path}/run-user"\nlinger = "{tmp_path}/linger"\n'
        "[gpu]\nenabled = false\n"
        '[protected]\nextra = ["container:kep*"]\n'
        f"[containers]\nengines = {json.dumps(engines)}\n"
    )
    (tmp_path / "run-user").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "spark_guard", "audit", *args, "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _rows(text: str, header: str) -> dict[str, list[str]]:
    """The table under `header`: each row's cells, by its first."""
    lines = text.split(header + "\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["CONTAINER", "IMAGE", "RESTART", "STATE", "EVIDENCE"]
    cells = [re.split(r"\s{2,}", line) for line in lines[1:]]
    return {c[0]: c[1:] for c in cells}


def _findings(text: str) -> dict[str, tuple[str, str, str, str]]:
    """Each finding's (severity, code, message, fix), by the unit it names."""
    lines = text.split("\nfindings (", 1)[1].splitlines()[1:]
    out = {}
    for head, fix in zip(lines[::2], lines[1::2], strict=True):
        m = re.fullmatch(r"  (\S+)\s+(\S+)\s+(\S+): (.*)", head)
        assert m, head
        assert fix.strip().startswith("fix: "), fix
        out[m.group(3)] = (m.group(1), m.group(2), m.group(4), fix.strip().removeprefix("fix: "))
    return out


@pytest.mark.engine
@pytest.mark.root
def test_audit_lists_loader_containers_and_flags_those_their_engine_restarts(
    dockerd: DockerD, tmp_path: Path
) -> None:
    sock = dockerd.socket
    out = audit(tmp_path, [sock])
    assert out.returncode == 4, out  # nothing-audited: no manager here, as test_audit_cli
    text = out.stdout
    docker = f"docker -H unix://{sock}"

    # The loader containers, with their exact policies; the non-loader is not listed.
    rows = _rows(text, f"loader containers (docker at {sock}):")
    assert rows == {
        "container:kept (protected)": [
            "vllm/vllm-openai:test",
            "always",
            "running",
            "image:vllm/vllm-openai",
        ],
        "container:llm": [
            "vllm/vllm-openai:test",
            "unless-stopped",
            "running",
            "image:vllm/vllm-openai",
        ],
        "container:quiet": ["lmsysorg/sglang:test", "no", "created", "image:lmsysorg/sglang"],
        "container:srv": ["sg-plain:test", "on-failure:3", "running", "exec:llama-server"],
    }, text
    assert "container:web" not in text and "nginx" not in text

    findings = _findings(text)
    assert findings["container:llm"] == (
        "WARNING",
        "container-at-boot",
        "restart policy unless-stopped: " + ON_BOOT.format(name="llm"),
        f"{docker} update --restart=no llm",
    )
    assert findings["container:srv"] == (
        "INFO",
        "container-restart",
        "restart policy on-failure:3: its engine starts it again after it fails, an OOM "
        "kill among them (up to 3 times), and at boot if shutdown killed it",
        f"{docker} update --restart=no srv",
    )
    # `no`, the non-loader and the protected one (`always`) are not flagged.
    flagged = {u for u in findings if u.startswith("container:")}
    assert flagged == {"container:llm", "container:srv"}, text
    assert "CRITICAL nothing-audited" in text  # the rest of the audit as it was

    # --json: the same, under `containers`; the other keys are all there as they were.
    report = json.loads(audit(tmp_path, [sock], "--json").stdout)
    assert set(report) == {
        "format",  # issue 30: every document says its shape's version
        "managers",
        "loaders",
        "failed",
        "lingering",
        "missing",
        "findings",
        "accounting",  # issue 30: was "memory", which named other figures than mem_*
        "gpu_holders",
        "containers",
        # Issue 25: what a GPU allocation can get on unified memory; issue 30: under the
        # names status and preflight give the same figures.
        "mem_total",
        "mem_available",
        "unified",
        "make_room",
        "mem_free",
        "file_clean",
        "huge_free",
        "pinned",
        "floor",
    }
    assert report["format"] == 2
    by_ref = {c["unit"]: c for c in report["containers"]}
    assert sorted(by_ref) == ["container:kept", "container:llm", "container:quiet", "container:srv"]
    llm = by_ref["container:llm"]
    assert (llm["engine"], llm["name"], llm["image"]) == (sock, "llm", "vllm/vllm-openai:test")
    assert (llm["restart"], llm["running"], llm["status"]) == ("unless-stopped", True, "running")
    assert (llm["evidence"], llm["protected"], llm["command"]) == (
        ["image:vllm/vllm-openai"],
        False,
        "sleep infinity",
    )
    assert re.fullmatch(r"[0-9a-f]{64}", llm["id"])
    assert (by_ref["container:srv"]["restart"], by_ref["container:srv"]["evidence"]) == (
        "on-failure:3",
        ["exec:llama-server"],
    )
    assert (by_ref["container:quiet"]["running"], by_ref["container:quiet"]["status"]) == (
        False,
        "created",
    )
    assert by_ref["container:kept"]["protected"] is True
    codes = {(f["unit"], f["code"], f["severity"], f["fix"]) for f in report["findings"]}
    assert {c for c in codes if (c[0] or "").startswith("container:")} == {
        ("container:llm", "container-at-boot", "warning", f"{docker} update --restart=no llm"),
        ("container:srv", "container-restart", "info", f"{docker} update --restart=no srv"),
    }


@pytest.mark.engine
@pytest.mark.root
def test_the_fix_audit_gives_ends_the_boot_risk(dockerd: DockerD, tmp_path: Path) -> None:
    """The fix, typed as audit prints it, leaves the container listed under `no`, unflagged.
    (Never started, it is said to be no risk at boot yet: dockerd starts none such.)"""
    image = "vllm/vllm-openai:test"
    dockerd.docker("create", "--name", "boot", "--restart", "always", image, *SLEEP)
    try:
        before = _findings(audit(tmp_path, [dockerd.socket]).stdout)["container:boot"]
        flagged = "restart policy always: not started yet, so not at boot; once started, "
        flagged += ON_BOOT.format(name="boot")
        assert before[:3] == ("WARNING", "container-at-boot", flagged)
        argv = shlex.split(before[3])
        assert argv[0] == "docker"
        subprocess.run([DOCKER, *argv[1:]], check=True, capture_output=True, timeout=30)
        text = audit(tmp_path, [dockerd.socket]).stdout
        rows = _rows(text, f"loader containers (docker at {dockerd.socket}):")
        assert rows["container:boot"] == [image, "no", "created", "image:vllm/vllm-openai"]
        assert "container:boot" not in _findings(text)
    finally:
        dockerd.docker("rm", "-f", "boot")


@pytest.mark.engine
@pytest.mark.root
def test_an_engine_socket_where_nothing_listens_is_one_line_and_audit_goes_on(
    dockerd: DockerD, tmp_path: Path
) -> None:
    dead = str(tmp_path / "dead.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead)  # the socket file stays; nobody listens on it
    absent = str(tmp_path / "absent.sock")  # passed over without a word
    began = time.monotonic()
    out = audit(tmp_path, [absent, dead, dockerd.socket])
    assert time.monotonic() - began < 30
    alone = audit(tmp_path, [dockerd.socket])

    assert out.returncode == alone.returncode == 4, out
    named = [line for line in out.stdout.splitlines() if dead in line]
    assert named == [
        f"  INFO     engine-unreachable {dead}: container engine failed, so its containers "
        "were not all audited: list containers: Connection refused"
    ], out.stdout
    assert absent not in out.stdout and not out.stderr
    # Its fix is the next line; nothing else of the report changes but that finding (the
    # memory figures move between two runs, and so may what is said of them).
    lines = out.stdout.splitlines()
    assert lines[lines.index(named[0]) + 1].strip() == (
        "fix: start the engine, or take its socket out of [containers] engines"
    )
    report = json.loads(audit(tmp_path, [absent, dead, dockerd.socket], "--json").stdout)
    report_alone = json.loads(audit(tmp_path, [dockerd.socket], "--json").stdout)

    def said(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
        memory = ("unaccounted-memory", "gpu-holder")
        return [
            (f["severity"], f["code"], f["unit"], f["fix"])
            for f in r["findings"]
            if f["code"] not in memory
        ]

    fix = "start the engine, or take its socket out of [containers] engines"
    assert said(report) == [*said(report_alone), ("info", "engine-unreachable", dead, fix)]
    assert report["containers"] == report_alone["containers"]


# --- the judgement alone (no engine, no root) ------------------------------------------


def _info(name: str, restart: str, status: str, retries: int = 0, engine: str = "") -> Any:
    from spark_guard.system.engine import DOCKER_SOCKET, Container
    from spark_guard.tools.inventory import ContainerInfo

    c = Container(
        id="a" * 64,
        name=name,
        image="vllm/vllm-openai:latest",
        restart=restart,
        max_retries=retries,
        running=status == "running",
        status=status,
    )
    return ContainerInfo(engine or DOCKER_SOCKET, c, ("image:vllm/vllm-openai",))


def test_what_each_policy_and_state_is_said_to_do_at_boot() -> None:
    """As dockerd does at its start (seen on the private one): `always` starts a container
    stopped by hand, `unless-stopped` does not; neither starts one never started;
    `on-failure` starts one that shutdown killed (exit 137)."""
    from spark_guard.core.config import Config
    from spark_guard.tools.audit import container_findings
    from spark_guard.tools.inventory import ContainerInventory, EngineProblem

    found = ContainerInventory(
        loaders=[
            _info("a", "always", "running"),
            _info("b", "always", "exited"),
            _info("c", "unless-stopped", "exited"),
            _info("d", "unless-stopped", "created"),
            _info("e", "on-failure", "exited"),
            _info("f", "no", "running"),
            _info("g", "", "running"),
            _info("kept-1", "always", "running"),
            _info("p", "unless-stopped", "running", engine="/run/podman/podman.sock"),
            _info("q", "always", "running", engine="/run/user/1000/podman/podman.sock"),
            _info("r", "always", "running", engine="/var/run/docker.sock"),
        ],
        errors=[EngineProblem("/run/x.sock", "version: no answer within 2 s")],
    )
    config = Config(extra_protected=("container:kept-*",))
    said = {f.unit: f for f in container_findings(found, config)}
    assert set(said) == {"container:" + n for n in "abcdepqr"} | {"/run/x.sock"}

    def why(name: str) -> str:
        return said[f"container:{name}"].message.split("; spark-guard blocks", 1)[0]

    every = "its engine starts it at every boot, before anyone can log in"
    assert why("a") == f"restart policy always: {every}"
    assert why("b") == f"restart policy always: stopped now, but {every}"
    assert why("c") == (
        f"restart policy unless-stopped: stopped by hand, so not at boot until started "
        f"again; then {every}"
    )
    assert why("d") == (
        f"restart policy unless-stopped: not started yet, so not at boot; once started, {every}"
    )
    assert (said["container:e"].severity, said["container:e"].message) == (
        "info",
        "restart policy on-failure: its engine starts it again after it fails, an OOM kill "
        "among them (with no limit), and at boot if shutdown killed it",
    )
    assert {n: said[f"container:{n}"].fix for n in "apqr"} == {
        "a": "docker update --restart=no a",
        "p": "podman update --restart=no p",
        "q": "podman --url unix:///run/user/1000/podman/podman.sock update --restart=no q",
        "r": "docker update --restart=no r",
    }
    assert said["/run/x.sock"].severity == "info"
    assert said["/run/x.sock"].code == "engine-unreachable"


@pytest.mark.engine
@pytest.mark.root
def test_audit_of_one_container_by_name_and_of_one_that_is_not_there(
    dockerd: DockerD, tmp_path: Path
) -> None:
    text = audit(tmp_path, [dockerd.socket], "container:llm").stdout
    rows = _rows(text, f"loader containers (docker at {dockerd.socket}):")
    assert list(rows) == ["container:llm"]
    assert "no-such-unit" not in text
    out = audit(tmp_path, [dockerd.socket], "container:nosuch")
    found = _findings(out.stdout)["container:nosuch"]
    assert found[:2] == ("CRITICAL", "no-such-container"), out.stdout
    assert out.returncode == 4
