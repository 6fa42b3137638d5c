"""A loader container that dockerd starts at boot is blocked by the guard, and stays down.

lab/containers_vm.py lays the case out in the 2 GiB VM: Debian's docker.io on
/run/docker.sock; `vllm` (image `vllm/vllm-openai:test`, `--restart
unless-stopped`) waits 5 s, then loads 900 MiB at 100 MiB/s; `keep` (image
`ollama/ollama:test`, `--restart always`) holds 50 MiB and is protected by
config. The guard's config gives `container:vllm` a footprint of 3 GiB: more
than the VM has, so at boot (the strict phase) it is refused on sight, before
it allocates.

One disk, two boots (snapshot=False keeps what each does):

1. The containers are made with the guard off (dockerd must run for that).
   Then what a boot does to them is done with the guard in its boot phase
   (`grace = "1h"`): dockerd is stopped, as at shutdown (they ran, so its next
   start starts them again), the guard is started, and dockerd is started: it
   restarts both by their policy before its API answers, as at boot. The guard
   reads who `vllm` is from dockerd's files, refuses it on its footprint, kills
   it from the kernel's side while dockerd is silent, then stops it through
   dockerd and sets its restart policy to `no`, with its record (the old
   policy, that it ran); `keep` runs on. (A third boot only for dockerd's
   start at boot would cost a minute of CI for the same dockerd start.)
   `vllm-box.service`, a unit that wraps `docker run --rm --name box` (issue
   29), is enabled and started then too, as multi-user.target starts it after
   dockerd: its container is refused on its footprint before it loads, stopped
   (and removed: `--rm`), and the unit, which would run it again, is stopped,
   disabled and masked with it.
2. The reboot: dockerd does not start `vllm`, nor anything `box`; its record is still there. The
   admin gives it a footprint that fits and reloads the guard; `spark-guard
   release container:vllm`: the exact policy is back, it runs and loads (100 MiB, at
   once), and `keep` was never touched.

About 3.5 minutes (2 CPUs, TCG): each boot to ssh 35-50 s with dockerd.
"""

from __future__ import annotations

import json
import shlex
import sys
import time

import pytest

from lab import containers_vm as cv
from lab.vm import VM

pytestmark = pytest.mark.vm

RECORD = f"/var/lib/spark-guard/blocked/container:{cv.LOADER}.json"
BOX_RECORD = f"/var/lib/spark-guard/blocked/{cv.BOX_UNIT}.json"
REF = f"container:{cv.LOADER}"
RELEASED_MIB = 100  # what vllm loads once released (within the footprint the admin gave it)


def _why(vm: VM, *extra: object) -> str:
    return (
        "".join(f"{e}\n" for e in extra)
        + f"guard:\n{cv.guard_log(vm)}\ndocker:\n{cv.docker_log(vm)}\n"
        + f"vllm: {cv.state(vm, cv.LOADER)}\nkeep: {cv.state(vm, cv.KEEP)}"
    )


def _kinds(vm: VM, ref: str) -> list[object]:
    return [e.get("SG_EVENT") for e in cv.events(vm, ref)]


def _running(name: str) -> str:
    return f"[ \"$(docker inspect -f '{{{{.State.Running}}}}' {name} 2>/dev/null)\" = true ]"


def _box(vm: VM) -> tuple[str, str, str]:
    """The wrapped unit's ActiveState, LoadState and UnitFileState."""
    each = "for p in ActiveState LoadState UnitFileState; do systemctl show -P $p {}; done"
    out = [*vm.ssh(each.format(cv.BOX_UNIT)).stdout.split(), "?", "?", "?"]
    return out[0], out[1], out[2]


def test_a_loader_container_started_by_dockerd_at_boot_is_blocked_and_stays_down(deb):
    began = time.monotonic()
    times: dict[str, float] = {}
    try:
        with VM(memory_mib=2048) as vm:
            cv.prepare(vm, deb, config=cv.guard_config(grace="1h"))

            # Boot 1: the containers are made, then dockerd's start at boot is done again
            # with the guard in its boot phase.
            times["boot 1"] = vm.boot(snapshot=False)
            cv.create(vm)
            assert cv.wait_for(vm, f"{_running(cv.LOADER)} && {_running(cv.KEEP)}", 60), _why(vm)
            enabled = vm.ssh("systemctl is-enabled spark-guard", check=False).stdout.strip()
            assert enabled == "disabled", _why(vm)
            vm.ssh("systemctl stop docker.socket docker.service", timeout=180)
            cv.enable_guard(vm)
            vm.ssh("systemctl start spark-guard.service", timeout=120)
            times["guard started"] = time.monotonic() - vm.started
            vm.ssh("systemctl start docker.service", timeout=180)
            vm.ssh(
                f"systemctl enable --quiet {cv.BOX_UNIT}; systemctl start --no-block {cv.BOX_UNIT}"
            )
            blocked = f'grep -Eq \'"step": *"blocked"\' {shlex.quote(RECORD)} 2>/dev/null'
            assert cv.wait_for(vm, blocked, 120), _why(vm, "no blocked record")
            times["record"] = time.monotonic() - vm.started
            record = json.loads(vm.ssh(f"cat {shlex.quote(RECORD)}").stdout)
            loader, keep = cv.state(vm, cv.LOADER), cv.state(vm, cv.KEEP)
            assert {k: record.get(k) for k in ("manager", "unit", "step", "reason", "phase")} == {
                "manager": "container",
                "unit": cv.LOADER,
                "step": "blocked",
                "reason": "footprint",
                "phase": "strict",
            }, _why(vm, record)
            held = record["container"]
            assert held["id"] == loader["Id"], _why(vm, record)
            assert held["image"] == cv.IMAGES[cv.LOADER], _why(vm, record)
            assert held["engine"] == "/run/docker.sock", _why(vm, record)
            assert (held["restart"], held["max_retries"], held["was_running"]) == (
                "unless-stopped",
                0,
                True,
            ), _why(vm, record)
            assert (loader["RestartPolicy"], loader["Running"]) == ("no", "False"), _why(vm, record)
            assert loader["StartedAt"] != "0001-01-01T00:00:00Z", _why(vm)  # dockerd started it
            assert {"unit-stop-requested", "unit-blocked"} <= set(_kinds(vm, REF)), _why(vm, record)
            assert (keep["Running"], keep["RestartPolicy"]) == ("True", "always"), _why(vm, record)
            assert _kinds(vm, f"container:{cv.KEEP}") == [], _why(vm, record)
            assert cv.kernel_kills(vm) == 0, _why(vm, record)
            assert REF in vm.ssh("spark-guard status", check=False).stdout, _why(vm, record)
            # The wrapped unit: its container refused before it loads, the unit blocked with it.
            boxed = f'grep -Eq \'"step": *"blocked"\' {shlex.quote(BOX_RECORD)} 2>/dev/null'
            assert cv.wait_for(vm, boxed, 120), _why(vm, "no blocked record of the unit")
            unit = json.loads(vm.ssh(f"cat {shlex.quote(BOX_RECORD)}").stdout)
            assert (unit["reason"], unit["phase"]) == ("footprint", "strict"), _why(vm, unit)
            assert unit["detail"].startswith(f"it runs container:{cv.BOX}, stopped:"), unit
            active, load, enabled = _box(vm)
            # (its docker client killed with the container: "failed" is as down)
            assert active in ("inactive", "failed") and load == "masked", _why(vm, unit, active)
            assert enabled != "enabled", _why(vm, unit, enabled)  # masked-runtime, disabled
            assert cv.state(vm, cv.BOX) == {}, _why(vm, unit)  # --rm: gone with its stop
            kinds = _kinds(vm, f"container:{cv.BOX}")
            assert "unit-stop-requested" in kinds, _why(vm, unit, kinds)
            said = vm.ssh(f"journalctl -b -q -o cat CONTAINER_NAME={cv.BOX}", check=False).stdout
            assert "holding" not in said, _why(vm, said)  # stopped before it loaded
            assert cv.kernel_kills(vm) == 0, _why(vm, unit)
            started_1 = loader["StartedAt"]
            times["session 1"] = time.monotonic() - vm.started
            assert vm.poweroff(), "the guest did not shut down by itself"

            # Boot 2: vllm never starts; released, it runs and loads again.
            times["boot 2"] = vm.boot(snapshot=False)
            assert cv.wait_for(vm, _running(cv.KEEP), 120), _why(vm, "keep did not start")
            loader, keep = cv.state(vm, cv.LOADER), cv.state(vm, cv.KEEP)
            assert (loader["Status"], loader["RestartPolicy"]) == ("exited", "no"), _why(vm)
            assert loader["StartedAt"] == started_1, _why(vm)  # never started on this boot
            assert vm.ssh(f"test -e {shlex.quote(RECORD)}", check=False).returncode == 0, _why(vm)
            assert REF in vm.ssh("spark-guard status", check=False).stdout, _why(vm)
            # The wrapped unit never started on this boot, and nothing made a box.
            active, _load, enabled = _box(vm)
            assert active in ("inactive", "failed") and enabled != "enabled", _why(vm, active)
            never = f"systemctl show -P ExecMainStartTimestampMonotonic {cv.BOX_UNIT}"
            assert vm.ssh(never).stdout.strip() == "0", _why(vm)
            assert cv.state(vm, cv.BOX) == {}, _why(vm)
            # A footprint that fits, taken in by the running guard (still in its boot phase).
            config = cv.guard_config(footprint=f"{cv.LOADER_MIB + 50}MiB")
            vm.ssh(f"printf %s {shlex.quote(config)} > /etc/spark-guard.toml")
            vm.ssh("systemctl reload spark-guard")
            reloaded = "journalctl -b -q -u spark-guard SG_EVENT=config-reloaded -o cat | grep -q ."
            assert cv.wait_for(vm, reloaded, 60), _why(vm, "the config was not reloaded")
            times["reloaded"] = time.monotonic() - vm.started
            cv.set_load(vm, 0, RELEASED_MIB, 0)  # from its next start: at once, and small
            out = vm.ssh(f"spark-guard release {REF}", check=False, timeout=120)
            assert out.returncode == 0, _why(vm, out.stdout, out.stderr)
            assert cv.wait_for(vm, _running(cv.LOADER), 60), _why(vm, "vllm did not start again")
            loader = cv.state(vm, cv.LOADER)
            assert (loader["RestartPolicy"], loader["MaximumRetryCount"]) == ("unless-stopped", "0")
            holding = f"docker logs {cv.LOADER} 2>&1 | grep -q 'holding {RELEASED_MIB} MiB'"
            assert cv.wait_for(vm, holding, 60), _why(vm, "vllm did not load")
            loader, after = cv.state(vm, cv.LOADER), cv.state(vm, cv.KEEP)
            assert loader["Running"] == "True" and loader["RestartPolicy"] == "unless-stopped"
            assert after["StartedAt"] == keep["StartedAt"] and after["Running"] == "True", _why(vm)
            assert after["RestartPolicy"] == "always", _why(vm)
            assert _kinds(vm, f"container:{cv.KEEP}") == [], _why(vm)
            times["session 2"] = time.monotonic() - vm.started
    finally:
        times["total"] = time.monotonic() - began
        print("\nTIMES " + " ".join(f"{k}={v:.0f}s" for k, v in times.items()), file=sys.stderr)
