"""The container a unit's docker or podman client runs: argv/engines.py, plain data."""

from spark_guard.core.argv.engines import launched_container


def test_the_container_a_client_runs_in_the_foreground_is_named():
    cases = {
        ("/usr/bin/docker", "run", "--rm", "--name", "vllm", "--gpus", "all", "img"): "vllm",
        ("docker", "-H", "unix:///run/docker.sock", "run", "--name=llm", "img"): "llm",
        ("podman", "--log-level", "info", "container", "run", "--name", "q", "img"): "q",
        ("docker", "start", "-a", "vllm"): "vllm",
        ("sh", "-c", "exec /usr/bin/docker run --rm --name srv img serve"): "srv",
        ("env", "A=1", "docker", "run", "--name", "x1", "img"): "x1",
    }
    for argv, name in cases.items():
        assert launched_container(argv) == name, argv


def test_anything_else_names_no_container():
    for argv in (
        ("docker", "run", "--rm", "img"),  # no name: nothing to follow
        ("docker", "start", "vllm"),  # detached: the unit does not hold it
        ("docker", "ps"),
        ("docker", "run", "--name", "../../etc", "img"),  # not a name docker takes
        ("llama-server", "--name", "x"),
        ("sleep", "infinity", "docker", "run", "--name", "x"),
        (),
    ):
        assert launched_container(argv) is None, argv


def test_an_attached_compose_up_launches_its_project():
    """`docker compose up` in a unit (Restart=always) starts every container of its
    project again: its project is named by -p, or by the folder of its first -f file, as
    compose normalizes names; `up -d` returns at once (the containers' own policy is what
    restarts them), and without -p or -f the project is the unit's working directory's,
    not known from the command line."""
    f = "/srv/LLM Stack/compose.yaml"
    assert launched_container(["/usr/bin/docker", "compose", "-f", f, "up"]) == "compose:llmstack"
    assert launched_container(["docker", "compose", "-p", "Vllm_1", "up", "vllm"]) == (
        "compose:vllm_1"
    )
    assert launched_container(["docker-compose", "--project-name=llm", "up"]) == "compose:llm"
    assert launched_container(["sh", "-c", f"exec podman-compose -f '{f}' up"]) == (
        "compose:llmstack"
    )
    for argv in (
        ["docker", "compose", "-p", "llm", "up", "-d"],
        ["docker", "compose", "up"],
        ["docker", "compose", "-p", "llm", "down"],
        ["docker", "compose", "-f", "relative.yaml", "up"],
    ):
        assert launched_container(argv) is None, argv
