"""The guard in a real 2 GiB VM, where MemAvailable is real: two loaders that cannot both fit.

A first step of the boot test (issue 7): the package installed with dpkg,
two enabled loader units (Restart=on-failure) that allocate 1.1 GiB of
anonymous memory each at 200 MiB/s, the same model on both. Together they
would take more than the machine has. The guard must let one load, stop,
mask and disable the other before it allocates, keep sshd reachable, and
keep MemAvailable above the reserve.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from vm import VM

pytestmark = pytest.mark.vm

REPO = Path(__file__).parent.parent
MiB = 1024**2

CONFIG = """
[budget]
reserve = "256MiB"
reserve_percent = 5
[boot]
grace = "10min"
[loaders.footprint]
"llama-*" = "1200MiB"
"""

LOADER = """[Unit]
Description=model server {n}
[Service]
ExecStart=/usr/bin/python3 /opt/fake-loader.py -m /srv/models/ds4.gguf --alloc 1100 --rate 200
Restart=on-failure
[Install]
WantedBy=multi-user.target
"""


def test_in_a_real_vm_one_loader_loads_the_other_is_blocked_and_ssh_stays_up(deb):
    with VM(memory_mib=2048) as vm:
        vm.install(deb)
        vm.path("/etc/spark-guard.toml").write_text(CONFIG)
        shutil.copy(REPO / "tests" / "fake_loader.py", vm.path("/opt/fake-loader.py"))
        vm.path("/srv/models").mkdir(parents=True)
        vm.path("/srv/models/ds4.gguf").write_bytes(b"GGUF" + b"\0" * 4096)
        wants = vm.path("/etc/systemd/system/multi-user.target.wants")
        wants.mkdir(exist_ok=True)
        for n in ("a", "b"):
            vm.path(f"/etc/systemd/system/llama-{n}.service").write_text(LOADER.format(n=n))
            (wants / f"llama-{n}.service").symlink_to(f"/etc/systemd/system/llama-{n}.service")
        vm.boot()
        # The load window: give the admitted loader time to allocate all of it.
        deadline = time.monotonic() + 120
        states: dict[str, dict[str, str]] = {}
        while time.monotonic() < deadline:
            for n in "ab":
                out = vm.ssh(
                    f"systemctl show llama-{n} -p LoadState -p ActiveState -p NRestarts",
                    check=False,
                ).stdout
                states[n] = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
            loads = {states[n].get("LoadState") for n in "ab"}
            actives = {states[n].get("ActiveState") for n in "ab"}
            if "masked" in loads and "active" in actives:
                break
            time.sleep(2)
        # One loads (whichever systemd started first), the other is blocked for good.
        blocked = [n for n in "ab" if states[n].get("LoadState") == "masked"]
        running = [n for n in "ab" if states[n].get("ActiveState") == "active"]
        assert len(blocked) == 1 and len(running) == 1, (states, vm.console_text()[-2000:])
        b = blocked[0]
        assert states[b]["ActiveState"] in ("inactive", "failed"), states
        assert states[b]["NRestarts"] == "0", states
        enabled = vm.ssh(f"systemctl is-enabled llama-{b}.service", check=False).stdout
        assert enabled.strip() in ("masked-runtime", "masked"), enabled
        time.sleep(8)  # the admitted loader has finished allocating
        available = int(vm.ssh("grep MemAvailable /proc/meminfo").stdout.split()[1]) * 1024
        assert available > 256 * MiB, available
        assert vm.ssh(f"systemctl show llama-{b} -p NRestarts --value").stdout.strip() == "0"
        status = vm.ssh("spark-guard status").stdout
        assert f"llama-{b}.service: blocked" in status and "llama-" in status
        assert vm.ssh("true", check=False).returncode == 0  # sshd still lets us in
