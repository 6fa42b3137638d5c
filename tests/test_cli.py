"""The command line as an admin uses it: exit codes and one-line errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spark_guard.tools
from spark_guard.core.quantities import format_size
from tests import data

SHIPPED = Path(__file__).parent.parent / "packaging" / "spark-guard.toml"


def sg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spark_guard", *args], capture_output=True, text=True, timeout=60
    )


def test_check_config_ok_and_broken(tmp_path):
    ok = sg("check-config", str(SHIPPED))
    assert ok.returncode == 0 and "ok" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[budget]\nreserve = "8GiB"\n[gpu]\nenabled = 1\n')
    out = sg("check-config", str(bad))
    assert out.returncode == 1
    assert out.stderr == f"spark-guard: {bad}:4: gpu.enabled: expected true or false, got 1\n"


def test_check_config_says_the_budget_here_and_refuses_one_that_cannot_protect(tmp_path):
    """A valid config whose budget is useless on this machine (a reserve of all of
    MemTotal, of nothing, a device floor of all of it) is not "ok": each is named, exit 1.
    The effective budget on this machine is printed; a misspelled section or key gets the
    closest known name."""
    total = next(
        int(line.split()[1]) * 1024
        for line in open("/proc/meminfo")  # noqa: SIM115
        if line.startswith("MemTotal:")
    )
    ok = sg("check-config", str(SHIPPED))
    assert ok.returncode == 0 and f"on this machine (MemTotal {format_size(total)}): reserve" in (
        ok.stdout
    )
    cases = {
        '[budget]\nreserve = "100TiB"\n': "is all of MemTotal",
        '[budget]\nreserve = "0"\nreserve_percent = 0\n': "the reserve is 0 B",
        '[memory]\nfloor = "100TiB"\n': "the device floor 100.0TiB is all of MemTotal",
    }
    for text, said in cases.items():
        f = tmp_path / "c.toml"
        f.write_text(text)
        out = sg("check-config", str(f))
        assert out.returncode == 1 and said in out.stderr, (text, out.stderr)
        assert "valid, but see below" in out.stdout
    f.write_text('[budgte]\nreserve = "8GiB"\n')
    out = sg("check-config", str(f))
    assert out.returncode == 1
    assert "unknown section [budgte]; did you mean [budget]?" in out.stderr, out.stderr


def test_check_config_missing_file(tmp_path):
    out = sg("check-config", str(tmp_path / "nope.toml"))
    assert out.returncode == 1
    assert out.stderr.strip() == f"spark-guard: {tmp_path}/nope.toml: no such file"


def test_dump_shows_memory_and_phase_and_that_it_saw_no_unit(tmp_path):
    """No manager answering, dump showed the memory and no loader, exit 0: an all-clear
    it could not give. Now it says no unit was seen, and exits 4 (cannot say), as audit;
    preflight's verdict says the loaders still loading were not counted."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n')
    out = sg("dump", "--config", str(cfg))
    assert out.returncode == 4, out.stderr
    assert out.stdout.startswith("phase strict; MemAvailable ")
    assert "GPU accounting off" in out.stdout
    assert "no systemd manager reached, no unit seen" in out.stderr
    pre = sg("preflight", str(data.smollm2()), "--json", "--config", str(cfg))
    assert pre.returncode in (0, 1), pre.stderr
    doc = json.loads(pre.stdout)
    assert doc["managers"] == [] and doc["pending"] is None  # not counted, not 0
    assert "other loaders still loading were not counted" in pre.stderr


def test_dump_with_broken_proc_root_is_one_clear_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nproc = "{tmp_path}/proc"\nuser_runtime = "/nonexistent"\n'
        'system_manager = "/nonexistent"\n'
    )
    out = sg("dump", "--config", str(cfg))
    assert out.returncode == 1
    assert out.stderr.startswith(f"spark-guard: {tmp_path}/proc/meminfo: cannot read")
    assert out.stderr.count("\n") == 1


def test_console_log_lines_are_readable_key_value():
    from spark_guard.log import render_line

    line = render_line(
        None,
        "warning",
        {
            "event": "decision",
            "level": "warning",
            "msg": "stop llama.service: too big",
            "unit": "llama.service",
            "reason": "footprint",
            "models": ("/a.gguf", "/b.gguf"),
            "pathname": "/x.py",
            "lineno": 3,
            "message_id": "abc",
            "detail": "two words",
        },
    )
    assert line == (
        "warning decision: stop llama.service: too big unit=llama.service "
        "reason=footprint models=/a.gguf,/b.gguf detail='two words'"
    )


def test_the_daemon_never_imports_the_admin_tools(tmp_path):
    cfg = tmp_path / "guard.toml"
    cfg.write_text(f"""
[paths]
system_manager = "/nonexistent/systemd/private"
user_runtime = "/nonexistent"
state = "{tmp_path}/state"
motd = "{tmp_path}/motd"
issue = "{tmp_path}/issue"
runtime = "{tmp_path}/run"
[metrics]
textfile = ""
""")
    seen, log = tmp_path / "modules.json", tmp_path / "guard.log"
    # What the process loaded over its whole life, written as it exits after SIGTERM.
    code = (
        "import atexit, json, sys\n"
        f"atexit.register(lambda: json.dump(sorted(sys.modules), open({str(seen)!r}, 'w')))\n"
        "from spark_guard.cli import main\n"
        f"sys.exit(main(['run', '--config', {str(cfg)!r}, '--dry-run', '--log', 'console']))\n"
    )
    with log.open("w") as out:
        guard = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while "spark-guard watching" not in log.read_text():
            assert guard.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=30) == 0, log.read_text()
    finally:
        guard.kill()
        guard.wait()
    loaded = set(json.loads(seen.read_text()))
    assert "spark_guard.daemon" in loaded
    # The admin's tools and what only they use live under spark_guard.tools: the daemon
    # must never load any of it (memory, start-up).
    assert sorted(m for m in loaded if m.startswith("spark_guard.tools")) == []
    # Nor OpenSSL (libssl and libcrypto: about 4 MB that mlockall() keeps resident): the
    # guard speaks no TLS and makes no hash; structlog's asyncio would load it (run_cli).
    # The metrics do load it (prometheus_client): off here, as on a machine without
    # node_exporter. A None entry left behind would turn them off: no "ssl" key at all.
    assert sorted(loaded & {"ssl", "_ssl", "hashlib", "_hashlib", "secrets"}) == []
    tools = Path(spark_guard.tools.__file__).parent
    assert len([p for p in tools.rglob("*.py") if p.name != "__init__.py"]) >= 15


def test_bad_arguments_are_one_line_and_exit_two_and_a_closed_pipe_is_no_traceback(tmp_path):
    """doctor over a time that is none, or a journal directory that is not there, was a
    clean run ("ok", exit 0); `--since -1h` needed `=`; a tool piped into `head` ended in
    BrokenPipeError. Now: one line naming the argument, exit 2; -1h taken as
    journalctl takes it; a closed pipe ends the tool quietly, as coreutils' do."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n')
    for args, said in (
        (["doctor", "--since", "garbage"], "--since garbage: not a time journalctl reads"),
        (["doctor", "--directory", str(tmp_path / "none")], "no such directory"),
        (["rescue", "--stop-timeout", "-5"], "--stop-timeout: -5: must be more than 0"),
    ):
        out = sg(*args, "--config", str(cfg))
        assert out.returncode == 2, (args, out.stderr)
        assert said in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
    assert sg("doctor", "--since", "-1h", "--config", str(cfg)).returncode in (0, 1, 3, 4)
    assert "expected one argument" not in sg("doctor", "--since", "-1h").stderr
    for line, first in ((f"dump --json --config {cfg}", "{"), ("preflight --help", "u")):
        # A reader that has gone before the first write: --help is printed while parsing.
        piped = subprocess.run(
            f"{sys.executable} -m spark_guard {line} | head -c 1",
            shell=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert piped.stdout == first and "Traceback" not in piped.stderr, (line, piped.stderr)
        closed = subprocess.run(
            f"{sys.executable} -m spark_guard {line} | true",
            shell=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "Traceback" not in closed.stderr, (line, closed.stderr)
        assert "Exception ignored" not in closed.stderr, (line, closed.stderr)


def test_rescue_that_reaches_no_manager_says_so_and_fails(tmp_path):
    """No manager answering (no systemd as PID 1, a socket gone): rescue printed "no model
    loaders found" and exited 0, a false all-clear. Now it says nothing was checked, exit
    1; and without root it says it cannot act, exit 1."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n'
        f'state = "{tmp_path}/state"\nmotd = "{tmp_path}/motd"\nissue = "{tmp_path}/issue"\n'
        "[containers]\nenabled = false\n"
    )
    out = sg("rescue", "--config", str(cfg))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no systemd manager could be reached: no unit was checked" in out.stdout
    assert "no model loaders found" not in out.stdout
    if os.geteuid() == 0:
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        nobody = subprocess.run(
            [*drop, sys.executable, "-m", "spark_guard", "rescue", "--config", str(SHIPPED)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert nobody.returncode == 1 and "needs root" in nobody.stderr, nobody.stderr


BAD_INPUTS = [
    # (command line, exit status, what the one line names)
    (["check-config", "{tmp}/none.toml"], 1, "no such file"),
    (["check-config", "{tmp}/broken.toml"], 1, "broken.toml:1"),
    # The README's footprint pasted with its header below the shipped file's own.
    (["check-config", "{tmp}/twice.toml"], 1, "twice.toml:3: [loaders.footprint] is already"),
    (["check-config", "{tmp}/key.toml"], 1, "key.toml:3: reserve is set twice in its section"),
    (["check-config", "{tmp}/fps.toml"], 1, "fps.toml:1: loaders.footprints: unknown table"),
    (["preflight", "{tmp}", "--config", "{cfg}"], 4, "a directory, not a model file"),
    (["preflight", "user:abc:llama", "--config", "{cfg}"], 2, "not a manager key: 'user:abc'"),
    (["release", "--all", "x.service", "--config", "{cfg}"], 2, "units or --all, not both"),
    (["-q", "--config", "{cfg}", "audit", "--bogus"], 2, "spark-guard audit: error: unrec"),
    (["dump", "--config", "{tmp}/broken.toml"], 2, "broken.toml:1"),
    (["status", "--config", "{tmp}/broken.toml"], 2, "broken.toml:1"),
    (["audit", "--config", "{tmp}/broken.toml"], 2, "broken.toml:1"),
    # Rescue goes on with the built-in defaults, as the daemon does (here none answers).
    (["rescue", "--dry-run", "--config", "{tmp}/broken.toml"], 1, "going on with the built-in"),
    (["doctor", "--config", "{tmp}/broken.toml"], 2, "broken.toml:1"),
    (["release", "--all", "--config", "{tmp}/broken.toml"], 2, "broken.toml:1"),
    (["preflight", "x.gguf", "--config", "{tmp}/broken.toml"], 2, "broken.toml:1"),
    (["preflight", "{tmp}/none.gguf", "--config", "{cfg}"], 4, "none.gguf"),
    (["preflight", "/dev/null", "--config", "{cfg}"], 4, "/dev/null"),
    (["preflight", "{tmp}/fifo.gguf", "--config", "{cfg}"], 4, "fifo.gguf"),
    (["preflight", "{tmp}/junk.gguf", "--config", "{cfg}"], 4, "junk.gguf"),
    (["preflight", "x.gguf", "-c", "lots", "--config", "{cfg}"], 2, "not a whole number"),
    (["preflight", "x.gguf", "-fa", "maybe", "--config", "{cfg}"], 2, "invalid choice"),
    (["status", "--config", "{cfg}"], 3, "not running"),
    (["release", "nope.service", "--config", "{cfg}"], 1, "nope.service"),
    (["release", "--config", "{cfg}"], 2, "name the units to release"),
    (["harden", "nope.service", "--config", "{cfg}"], 2, "nope.service"),
    (["doctor", "--since", "yesterdayish", "--config", "{cfg}"], 2, "--since"),
    (["nosuchcommand"], 2, "invalid choice"),
    # A command's own usage for its own errors (it was the top level's).
    (["release", "--bogus", "--config", "{cfg}"], 2, "spark-guard release: error: unrec"),
    (["--config", "{cfg}", "audit", "--bogus"], 2, "spark-guard audit: error: unrec"),
]


@pytest.mark.parametrize(
    ("argv", "code", "said"), BAD_INPUTS, ids=[" ".join(b[0][:2]) for b in BAD_INPUTS]
)
def test_bad_input_to_any_command_is_one_line_and_its_documented_exit(tmp_path, argv, code, said):
    """Every command over a table of bad inputs (issue 30 §2): no traceback, one line on
    stderr naming what and where, and the exit status its --help documents (exits.py)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n'
        f'state = "{tmp_path}/state"\nruntime = "{tmp_path}/run"\n'
        f'motd = "{tmp_path}/motd"\nissue = "{tmp_path}/issue"\n'
        "[containers]\nenabled = false\n[gpu]\nenabled = false\n"
    )
    (tmp_path / "broken.toml").write_text("[budget\n")
    (tmp_path / "fps.toml").write_text('[loaders.footprints]\n"a.service" = "1GiB"\n')
    (tmp_path / "key.toml").write_text('[budget]\nreserve = "8GiB"\nreserve = "9GiB"\n')
    (tmp_path / "twice.toml").write_text(
        '[loaders.footprint]\n# "x.service" = "1GiB"\n[loaders.footprint]\n"x.service" = "1GiB"\n'
    )
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    os.mkfifo(tmp_path / "fifo.gguf")
    args = [a.format(tmp=tmp_path, cfg=cfg) for a in argv]
    out = sg(*args)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == code, (args, out.returncode, out.stderr)
    errors = [line for line in out.stderr.splitlines() if line.startswith("spark-guard")]
    assert errors, out.stderr
    assert said in out.stderr, out.stderr
    assert len([e for e in errors if "error" in e or said in e]) >= 1


def test_release_dry_run_shows_what_it_would_put_back_and_changes_nothing(tmp_path):
    """Preview before trust (issue 30 §3): `release --dry-run` shows, from the record
    alone, the mask it would remove and each link it would put back, and the record
    stays."""
    from spark_guard.block.records import LinkRecord, Record, RecordStore

    store = RecordStore(str(tmp_path / "state"))
    record = Record(
        unit="llama.service",
        manager="system",
        reason="footprint",
        detail="expects 115GiB",
        phase="strict",
        mask_path="/run/systemd/system.control/llama.service",
        links=[
            LinkRecord(
                "/etc/systemd/system/multi-user.target.wants/llama.service",
                "/etc/systemd/system/llama.service",
                0,
                0,
                True,
            )
        ],
    )
    store.save(record)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n'
        f'state = "{tmp_path}/state"\nmotd = "{tmp_path}/motd"\nissue = "{tmp_path}/issue"\n'
    )
    out = sg("release", "--all", "--dry-run", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "would release llama.service:",
        "  remove the mask /run/systemd/system.control/llama.service (if it is still the guard's)",
        "  put back /etc/systemd/system/multi-user.target.wants/llama.service -> "
        "/etc/systemd/system/llama.service (uid 0)",
    ]
    assert [str(r.ref) for r in store.all()[0]] == ["llama.service"]
    empty = tmp_path / "empty.toml"
    empty.write_text(cfg.read_text().replace(f"{tmp_path}/state", f"{tmp_path}/none"))
    nothing = sg("release", "--all", "--dry-run", "--config", str(empty))
    assert nothing.returncode == 0 and nothing.stdout.startswith("nothing blocked"), nothing
    rescue = sg("rescue", "--dry-run", "--config", str(cfg))
    assert rescue.returncode == 1 and "no systemd manager could be reached" in rescue.stdout


def test_every_json_document_says_its_format_pretty_or_short(tmp_path):
    """`--json` (and `--json=pretty`) is indented, `--json=short` one line, as systemd's
    tools take it; every document begins with its `format`; another mode is a usage error."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n'
        f'runtime = "{tmp_path}/run"\n[containers]\nenabled = false\n[gpu]\nenabled = false\n'
    )
    # The format each document's schema names (docs/json.md): 2 where a field was renamed.
    formats = {"dump": 2, "audit": 2, "doctor": 1, "preflight": 1}
    for command in (["dump"], ["audit"], ["doctor"], ["preflight", str(data.smollm2())]):
        short = sg(*command, "--json=short", "--config", str(cfg))
        assert short.stdout.count("\n") == 1, (command, short.stdout[:200], short.stderr)
        doc = json.loads(short.stdout)
        want = formats[command[0]]
        assert next(iter(doc)) == "format" and doc["format"] == want, command
        pretty = sg(*command, "--json", "--config", str(cfg))
        assert json.loads(pretty.stdout).keys() == doc.keys(), command  # the figures move
        assert pretty.stdout.startswith(f'{{\n "format": {want},'), command
    bad = sg("dump", "--json=yaml", "--config", str(cfg))
    assert bad.returncode == 2 and "--json=pretty or --json=short" in bad.stderr
