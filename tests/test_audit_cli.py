"""`spark-guard audit` where no systemd manager answers: it says it audited nothing, and fails."""

import json
import subprocess
import sys


def audit(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[paths]\nsystem_manager = "{tmp_path}/no-pid1/private"\n'
        f'user_runtime = "{tmp_path}/run-user"\nlinger = "{tmp_path}/linger"\n'
        "[gpu]\nenabled = false\n"
    )
    (tmp_path / "run-user").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "spark_guard", "audit", *args, "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_audit_with_no_manager_says_nothing_was_audited_and_exits_4(tmp_path):
    out = audit(tmp_path)
    assert out.returncode == 4, out  # cannot say: apart from a usage error's 2
    assert out.stdout.startswith("managers: none reachable\n"), out.stdout
    assert "no findings" not in out.stdout
    assert "CRITICAL nothing-audited" in out.stdout
    assert (
        "no systemd manager reachable, so no running unit was audited (no manager socket at "
        f"{tmp_path}/no-pid1/private or under {tmp_path}/run-user)"
    ) in out.stdout
    assert "fix: run it as root on a machine where systemd is PID 1" in out.stdout


def test_audit_json_with_no_manager_carries_the_finding(tmp_path):
    out = audit(tmp_path, "--json")
    assert out.returncode == 4, out
    report = json.loads(out.stdout)
    assert report["managers"] == []
    assert report["findings"][0]["code"] == "nothing-audited"
    assert report["findings"][0]["severity"] == "critical"


def test_each_loaders_footprint_shows_its_rule_and_a_client_its_server(tmp_path, capsys):
    """audit's footprints: the prediction's source and rule for each loader, the admin's
    [loaders.footprint] where given, and a client charged to the server its load lands in
    (policy.charge_clients), on the incident's pair; in text and in --json."""
    from lab import synth
    from spark_guard.core.config import Config
    from spark_guard.core.snapshot import UnitRef
    from spark_guard.foresight.predict import Prediction, Predictor
    from spark_guard.tools import audit_cli
    from spark_guard.tools.audit import footprints
    from spark_guard.tools.inventory import Inventory, UnitInfo, foresee

    model = synth.write(synth.SPECS["qwen3-30b-a3b"], tmp_path)

    def unit(manager, name, *argv):
        return UnitInfo(UnitRef(manager, name), "", "loaded", "inactive", "enabled", (argv,))

    kobold = unit("system", "kobold.service", "koboldcpp", str(model), "--contextsize", "4096")
    box = unit("system", "box.service", "llama-box", "-m", str(tmp_path / "gone.gguf"))
    fixed = unit("system", "big.service", "llama-server", "-m", str(model))
    server = unit("user:1000", "lmstudio-server.service", "lms", "server", "start")
    client = unit("system", "lms-load.service", "/bin/sh", "-c", "sleep 60; lms load qwen")
    inv = Inventory(loaders=[kobold, box, fixed, server, client])
    config = Config(footprint={"big.service": 70 * 2**30})
    predictions = foresee(Inventory(loaders=[kobold, box, fixed, server]), 128 * 2**30, Predictor())
    predictions[client.ref] = Prediction(20 * 2**30, "lms load qwen → ...", runs_as=1000)
    feet = footprints(inv, predictions, config)

    assert feet[kobold.ref].kind == "llama.cpp" and feet[kobold.ref].bytes is not None
    assert feet[kobold.ref].source.startswith("koboldcpp Qwen3-30B-A3B.gguf, ctx 4352: ")
    assert "gone.gguf: cannot open the model" in feet[box.ref].source
    assert feet[box.ref].bytes is None
    assert (feet[fixed.ref].bytes, feet[fixed.ref].source) == (
        70 * 2**30,
        "[loaders.footprint] in the config",
    )
    assert feet[client.ref].charged_to == server.ref
    assert feet[server.ref].clients == (client.ref,) and feet[server.ref].bytes == 20 * 2**30

    audit_cli._print_footprints(inv, feet)
    text = capsys.readouterr().out
    assert "footprints (what the guard expects, and by which rule):" in text
    # The rule is in the source once, not again.
    assert "  kobold.service  " in text and text.count("+ 128 cells koboldcpp adds") == 1
    assert (
        "lms-load.service  -  charged to user:1000:lmstudio-server.service, whose process "
        "the load lands in: lms load qwen → ..."
    ) in text
    assert (
        "user:1000:lmstudio-server.service  20.0GiB  the loads its clients ask of it; with "
        "the loads of lms-load.service"
    ) in text
    report = audit_cli._json(inv, [], _memory(), [], feet)
    by_ref = {u["unit"]: u for u in report["loaders"]}
    assert by_ref["lms-load.service"]["footprint"]["charged_to"] == (
        "user:1000:lmstudio-server.service"
    )
    assert by_ref["big.service"]["footprint"]["kind"] == "config"
    assert by_ref["kobold.service"]["footprint"]["rule"] == (
        "flash attention on (its default); + 128 cells koboldcpp adds"
    )


def _memory():
    from spark_guard.tools.audit import reconcile

    return reconcile({"MemTotal": 2**37, "MemAvailable": 2**36}, 0, 0, False)


def test_colours_as_systemds_tools_decide_them_and_quiet_as_systemctls(tmp_path):
    """One set of severity words for audit and doctor, coloured on a terminal or when
    SYSTEMD_COLORS says so, never when NO_COLOR is set or SYSTEMD_COLORS=0; -q prints
    nothing on stdout and keeps the exit status; --no-pager is accepted."""
    import os

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        cfg = tmp_path / "c.toml"
        cfg.write_text(
            f'[paths]\nsystem_manager = "{tmp_path}/no-pid1/private"\n'
            f'user_runtime = "{tmp_path}/run-user"\n[containers]\nenabled = false\n'
        )
        (tmp_path / "run-user").mkdir(exist_ok=True)
        return subprocess.run(
            [sys.executable, "-m", "spark_guard", "audit", *args, "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k not in ("NO_COLOR",)} | env,
        )

    assert "\x1b[1;31mCRITICAL\x1b[0m nothing-audited" in run(SYSTEMD_COLORS="1").stdout
    assert "\x1b[" not in run(SYSTEMD_COLORS="0").stdout
    assert "\x1b[" not in run(NO_COLOR="1").stdout
    assert "\x1b[" not in run().stdout  # not a terminal
    quiet = run("-q", "--no-pager")
    assert quiet.stdout == "" and quiet.returncode == 4, quiet


def test_with_nothing_reached_a_named_unit_is_not_called_missing_nor_gpu_memory_zero(tmp_path):
    """A newcomer's audit where no manager answers and NVML is not there: the unit it names
    was never looked up (no "no such unit"), and the GPU's memory is "not counted", not a
    0B that adds up."""
    out = audit(tmp_path, "llama.service")
    assert out.returncode == 4, out
    assert "no-such-unit" not in out.stdout
    assert "GPU (not counted: no NVML)" in out.stdout
    assert "the figures add up" not in out.stdout
