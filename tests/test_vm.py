"""The rescue window never closes: the wedge layout booted in a real 2 GiB VM with the guard.

tests/wedge.py lays out what wedges real machines: llama-server as a system
unit, the same loader and model as a linger user's unit, an idle server
holding memory, Restart=on-failure on all, loaders allocating anonymous
memory for real at 100 MiB/s. Together they want more than the VM has. The
guard is installed from the .deb with its budget in /etc/spark-guard.toml.

The bound on fork latency: under qemu's software emulation a fork+exec+wait
of /bin/true from the probe takes about 60 ms when the guest is calm, and
boot itself (systemd starting ~100 units on 2 emulated CPUs) pushes it to
0.5-0.75 s (benchmarks/boot_wedge.py, every protection, before any loader
starts). Emulation speed varies up to 2x between hosts. A guest out of
memory stalls a fork for seconds to tens of seconds (the same benchmark: 52 s
with no guard, 22 s with systemd-oomd). FORK_BOUND_MS sits between: 2 s,
above emulated boot noise on a slow host, and an order of magnitude under a
real memory stall.

The tolerance on MemAvailable: the guard polls every 0.5 s in the strict
phase, and a loader it has not judged yet can allocate one poll's worth at
100 MiB/s; 64 MiB covers that and the page cache the kernel counts in and out.

The probe's own gaps are bounded too: a probe that is not scheduled writes no
sample, so the longest time between two samples must stay under GAP_BOUND_S
(the fork bound plus its 100 ms tick), and no sample may start later than the
fork bound.

The loader that fights back (issue 16, tests/wedge.py `fight`) is not
asserted here yet: in two runs on this boot it was frozen and killed within
60 ms of the guard's decision, but the decision comes only once MemAvailable
has crossed the reserve (steady phase) plus a full look (0.4 s under
emulation), and at 200 MiB/s MemAvailable fell to 81 MiB and then 11 MiB,
where the guard's reserve rule also stopped PID 1's llama-server. See
docs/benchmarks.md.
"""

from __future__ import annotations

import pytest

from vm import VM
from wedge import LOADERS, RESERVE_MIB, MiB, Run, collect, observe, prepare

pytestmark = pytest.mark.vm

FORK_BOUND_MS = 2000
GAP_BOUND_S = (FORK_BOUND_MS + 500) / 1000
TOLERANCE = 64 * MiB
WANTS = {
    "system": "/etc/systemd/system/multi-user.target.wants/llama-server.service",
    "user": "/home/alice/.config/systemd/user/default.target.wants/llama-server.service",
}


def _why(run: Run) -> str:
    return (
        f"units={run.units} kills={run.kills}\nguard:\n{run.guard_log[-3000:]}\n"
        f"console:\n{run.console_tail[-1500:]}"
    )


def test_the_wedge_at_boot_one_loader_loads_the_duplicate_is_blocked_and_the_window_stays_open(
    deb,
):
    run = Run("spark-guard")
    with VM(memory_mib=2048) as vm:
        prepare(vm, "spark-guard", deb)
        observe(vm, run, seconds=60, snapshot=False)
        collect(vm, run)
        assert run.ssh_at_end, _why(run)

        # PID 1's llama-server loads, whichever started first; the user's copy is
        # stopped, masked and disabled, and never restarted. The idle server stays.
        loaders = {level: run.units[f"{level}:llama-server.service"] for level, _ in LOADERS}
        blocked = [lv for lv, u in loaders.items() if u.get("LoadState") == "masked"]
        loaded = [lv for lv, u in loaders.items() if u.get("ActiveState") == "active"]
        assert (blocked, loaded) == (["user"], ["system"]), _why(run)
        offender = loaders[blocked[0]]
        assert offender["ActiveState"] in ("inactive", "failed"), _why(run)
        assert offender["UnitFileState"] == "masked-runtime", _why(run)
        assert offender["NRestarts"] == "0", _why(run)
        assert vm.ssh(f"test -e {WANTS[blocked[0]]}", check=False).returncode == 1  # disabled
        assert run.units["system:ollama.service"]["ActiveState"] == "active", _why(run)
        assert run.restarts == 0, _why(run)
        assert run.kills["kernel"] == 0, _why(run)

        # The rescue window: every login from the first one on worked, some while loading.
        assert run.ssh_failures == 0, run.logins
        assert run.logins_in_load_window >= 1, (run.load_window, run.logins)
        assert len(run.samples) > 300, "the probe ran from early boot"
        assert run.worst_fork_ms < FORK_BOUND_MS, sorted(s.fork_ms for s in run.samples)[-5:]
        assert run.worst_stall_ms < FORK_BOUND_MS, sorted(s.late_ms for s in run.samples)[-5:]
        assert run.worst_gap_s < GAP_BOUND_S, run.worst_gap_s
        assert run.min_available >= RESERVE_MIB * MiB - TOLERANCE, run.min_available / MiB
        status = vm.ssh("spark-guard status").stdout
        assert "llama-server.service: blocked" in status, status

        # Second boot of the same disk: the offender stays down, the admitted one loads again.
        assert vm.poweroff(), "the guest did not shut down by itself"
        again = Run("spark-guard, second boot")
        observe(vm, again, seconds=30, snapshot=False)
        collect(vm, again)
        offender = again.units[f"{blocked[0]}:llama-server.service"]
        assert offender["ActiveState"] == "inactive", _why(again)
        assert offender["ExecMainStartTimestampMonotonic"] == "0", _why(again)  # never ran
        assert offender["LoadState"] == "masked", _why(again)
        assert again.units[f"{loaded[0]}:llama-server.service"]["ActiveState"] == "active"
        # The mask lived in /run: the guard laid it again from its record before the unit ran.
        assert "laying the mask on " in again.guard_log, _why(again)
        assert again.guard_stops == 0, _why(again)  # it was not running: nothing to stop
        assert again.ssh_failures == 0, again.logins
