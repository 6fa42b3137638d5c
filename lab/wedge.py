"""The layout that wedges real machines, in a 2 GiB VM, and what an admin would measure of it.

Laid out before boot (issue 7, after the incident in ../shared/seeds/):

- `llama-server.service` in /etc/systemd/system, enabled;
- the same loader, same model, as alice's user unit; alice lingers, so her
  manager starts it at boot too;
- `ollama.service`, a server that loads a smaller model at once and then
  holds it at idle;
- Restart=on-failure on all three; the loaders allocate anonymous memory
  for real at LOAD_RATE, as a GPU load on unified memory does.

Together they want more than the VM has. `prepare()` installs one of the
compared protections; `observe()` boots, logs in over ssh every second from
the host, and reads the in-guest probe (lab/probe.py) from the second
serial port; `collect()` asks the guest what happened.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab.vm import VM

HERE = Path(__file__).parent
MiB = 1024**2

LOADER_MIB = 900  # each llama-server
SERVER_MIB = 200  # ollama at idle
LOAD_RATE = 100  # MiB/s, anonymous and touched: a 10 s load, as 100 GB in 30 s on a Spark
RESERVE_MIB = 200
# The PSI trigger's threshold in this VM: at the default 150 ms of stall per 2 s no event came
# while the loader that fights back took 200 MiB/s (measured); at 20 ms one did (one run).
PSI_STALL_MS = 20
PROTECTIONS = ("none", "earlyoom", "systemd-oomd", "spark-guard")
UID = 1000

# What each holds, as an admin who measured them would write it, with 50 MiB to spare for
# the interpreter (a loader that outgrows its figure is fair game for the trend rule). At
# boot, while the loaders start, about 1.5-1.75 GiB is available: one loader, the server
# and the reserve fit (1400 MiB); a second loader does not, and without a guard the three
# (2000 MiB) do not fit at all.
GUARD_CONFIG = f"""
[budget]
reserve = "{RESERVE_MIB}MiB"
[poll]
psi_stall = "{PSI_STALL_MS}ms"
[loaders.footprint]
"llama-server.service" = "{LOADER_MIB + 50}MiB"
"ollama.service" = "{SERVER_MIB + 50}MiB"
"""

UNIT = """[Unit]
Description={description}
After=network.target
[Service]
ExecStart={binary} -m {model} --alloc {mib} --rate {rate}
Restart=on-failure
[Install]
WantedBy={target}
"""

PROBE_UNIT = """[Unit]
Description=fork latency and MemAvailable probe (benchmark)
DefaultDependencies=no
[Service]
ExecStart=/usr/bin/python3 /opt/probe.py
OOMScoreAdjust=-1000
[Install]
WantedBy=sysinit.target
"""

# What systemd-oomd's own documentation suggests: pressure-based killing on the
# slices that hold the workloads (system services, and each user's manager as
# distributions ship for user@.service), with the documented 60 % default limit
# spelled out; swap-based killing needs swap, which this VM, like a Spark, has not.
OOMD_DROPINS = {
    "system.slice.d/50-oomd.conf": "[Slice]\nManagedOOMMemoryPressure=kill\n"
    "ManagedOOMMemoryPressureLimit=60%\n",
    "user@.service.d/50-oomd.conf": "[Service]\nManagedOOMMemoryPressure=kill\n"
    "ManagedOOMMemoryPressureLimit=60%\n",
    "-.slice.d/50-oomd.conf": "[Slice]\nManagedOOMSwap=kill\n",
}

# The loader that fights back (issue 16): started by hand once the wedge has settled, it
# ignores SIGTERM and allocates as fast as the VM can touch pages, more than is left.
FIGHT_UNIT = "llama-fight.service"
FIGHT_MIB = 1536
FIGHT = f"""[Unit]
Description=a loader that fights back: ignores SIGTERM, allocates flat out
[Service]
ExecStart=/usr/local/bin/llama-server -m /srv/models/fight.gguf --alloc {FIGHT_MIB} --ignore-term
Restart=on-failure
"""
# Whether PID 1 thaws a frozen unit to stop it: a SIGTERM handler that exits, frozen, stopped.
THAW_CHECK = (
    "systemd-run -q --unit=thaw-check /usr/bin/python3 -c "
    "'import signal,sys,time; signal.signal(15, lambda *a: sys.exit(0)); time.sleep(600)'"
    " && sleep 2 && systemctl freeze thaw-check"
    " && systemctl show -p FreezerState --value thaw-check"
    " && a=$(cut -d' ' -f1 /proc/uptime) && timeout 30 systemctl stop thaw-check"
    " && b=$(cut -d' ' -f1 /proc/uptime) && echo \"$a $b\""
)

LOADERS = (("system", "llama-server.service"), ("user", "llama-server.service"))
UNITS = (*LOADERS, ("system", "ollama.service"))


def _enable(vm: VM, wants_dir: str, unit_path: str, *, owner: int = 0) -> None:
    wants = vm.path(wants_dir)
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / Path(unit_path).name
    link.symlink_to(unit_path)
    if owner:
        shutil.chown(wants, owner, owner)
        subprocess.run(["chown", "-h", f"{owner}:{owner}", str(link)], check=True)


def disable_comparisons(vm: VM) -> None:
    """The comparison daemons are in the image, enabled by their packages: each run enables
    only its own (an earlyoom left on kills the loaders the guard is being tested on)."""
    system = "/etc/systemd/system"
    for link in (
        f"{system}/multi-user.target.wants/earlyoom.service",
        f"{system}/multi-user.target.wants/systemd-oomd.service",
        f"{system}/sockets.target.wants/systemd-oomd.socket",
        f"{system}/dbus-org.freedesktop.oom1.service",
    ):
        vm.path(link).unlink(missing_ok=True)


def prepare(vm: VM, protection: str, deb: Path | None) -> None:
    """Lay the wedge out in vm.root and install one protection (or none)."""
    assert protection in PROTECTIONS, protection
    shutil.copy(HERE / "fake_loader.py", vm.path("/opt/fake-loader.py"))
    shutil.copy(HERE / "probe.py", vm.path("/opt/probe.py"))
    # The loaders run under llama-server's name and flags, as in the incident: the guard
    # reads their command lines as it reads a real server's.
    server = vm.path("/usr/local/bin/llama-server")
    server.write_text('#!/bin/sh\nexec /usr/bin/python3 /opt/fake-loader.py "$@"\n')
    server.chmod(0o755)
    vm.path("/etc/systemd/system/probe.service").write_text(PROBE_UNIT)
    _enable(vm, "/etc/systemd/system/sysinit.target.wants", "/etc/systemd/system/probe.service")
    vm.path("/srv/models").mkdir(parents=True)
    vm.path(f"/etc/systemd/system/{FIGHT_UNIT}").write_text(FIGHT)  # not enabled
    for name in ("qwen3-coder.gguf", "gemma-small.gguf", "fight.gguf"):
        vm.path(f"/srv/models/{name}").write_bytes(b"GGUF" + b"\0" * 4096)

    system = "/etc/systemd/system"
    user_dir = "/home/alice/.config/systemd/user"
    # alice: the same loader as her own unit, started at boot because she lingers.
    vm.chroot("useradd", "--create-home", "--uid", str(UID), "--shell", "/bin/bash", "alice")
    vm.path(user_dir).mkdir(parents=True)
    for directory, name, what, model, mib, rate, target, owner in (
        (system, "llama-server", "llama.cpp server (system)", "qwen3-coder", LOADER_MIB,
         LOAD_RATE, "multi-user.target", 0),
        (system, "ollama", "Ollama-style server, idle with its model loaded", "gemma-small",
         SERVER_MIB, 0, "multi-user.target", 0),
        (user_dir, "llama-server", "llama.cpp server (alice)", "qwen3-coder", LOADER_MIB,
         LOAD_RATE, "default.target", UID),
    ):  # fmt: skip
        unit = f"{directory}/{name}.service"
        vm.path(unit).write_text(
            UNIT.format(
                description=what,
                binary="/usr/local/bin/llama-server"
                if name == "llama-server"
                else "/usr/bin/python3 /opt/fake-loader.py",
                model=f"/srv/models/{model}.gguf",
                mib=mib,
                rate=rate,
                target=target,
            )
        )
        _enable(vm, f"{directory}/{target}.wants", unit, owner=owner)
    subprocess.run(["chown", "-R", f"{UID}:{UID}", str(vm.path("/home/alice"))], check=True)
    vm.path("/var/lib/systemd/linger").mkdir(parents=True, exist_ok=True)
    vm.path("/var/lib/systemd/linger/alice").touch()

    disable_comparisons(vm)
    if protection == "earlyoom":
        _enable(vm, f"{system}/multi-user.target.wants", "/lib/systemd/system/earlyoom.service")
    elif protection == "systemd-oomd":
        _enable(vm, f"{system}/multi-user.target.wants", "/lib/systemd/system/systemd-oomd.service")
        _enable(vm, f"{system}/sockets.target.wants", "/lib/systemd/system/systemd-oomd.socket")
        vm.path(f"{system}/dbus-org.freedesktop.oom1.service").symlink_to(
            "/lib/systemd/system/systemd-oomd.service"
        )
        for name, text in OOMD_DROPINS.items():
            vm.path(f"{system}/{name}").parent.mkdir(parents=True, exist_ok=True)
            vm.path(f"{system}/{name}").write_text(text)
    elif protection == "spark-guard":
        assert deb is not None
        vm.install(deb)
        vm.path("/etc/spark-guard.toml").write_text(GUARD_CONFIG)


@dataclass
class Login:
    at: float  # host monotonic, seconds from qemu's start
    ok: bool
    uptime: float | None  # the guest's CLOCK_BOOTTIME when it answered


@dataclass
class Sample:
    uptime: float
    fork_ms: float
    late_ms: float
    available: int  # bytes


class _ProbeFigures:
    """What the probe's samples say, for a whole run and for the fight-back window alike."""

    samples: list[Sample]

    @property
    def min_available(self) -> int:
        return min((s.available for s in self.samples), default=0)

    @property
    def worst_fork_ms(self) -> float:
        return max((s.fork_ms for s in self.samples), default=float("nan"))

    @property
    def worst_stall_ms(self) -> float:
        """The worst of: a fork+exec+wait, or the probe itself not running on time."""
        return max((max(s.fork_ms, s.late_ms) for s in self.samples), default=float("nan"))

    @property
    def worst_gap_s(self) -> float:
        """The longest time between two probe samples: a probe that could not run at all."""
        return max((b.uptime - a.uptime for a, b in itertools.pairwise(self.samples)), default=0.0)


@dataclass
class Run(_ProbeFigures):
    protection: str
    logins: list[Login] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    units: dict[str, dict[str, str]] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)
    guard_stops: int = 0
    load_window: tuple[float, float] | None = None  # guest uptime
    ssh_at_end: bool = False
    console_tail: str = ""
    guard_log: str = ""

    # --- the figures of the comparison table ---

    @property
    def logins_after_up(self) -> list[Login]:
        first = next((i for i, lg in enumerate(self.logins) if lg.ok), None)
        return [] if first is None else self.logins[first:]

    @property
    def ssh_failures(self) -> int:
        return sum(not lg.ok for lg in self.logins_after_up)

    @property
    def longest_ssh_gap(self) -> float:
        """Longest time between two logins that worked, once sshd had first let us in."""
        ok = [lg.at for lg in self.logins_after_up if lg.ok]
        return max((b - a for a, b in itertools.pairwise(ok)), default=0.0)

    @property
    def logins_in_load_window(self) -> int:
        if self.load_window is None:
            return 0
        start, end = self.load_window
        return sum(1 for lg in self.logins if lg.ok and lg.uptime and start <= lg.uptime <= end)

    @property
    def worst_fork_in_window_ms(self) -> float:
        if self.load_window is None:
            return float("nan")
        start, end = self.load_window
        inside = [s.fork_ms for s in self.samples if start <= s.uptime <= end]
        return max(inside, default=float("nan"))

    @property
    def median_fork_ms(self) -> float:
        return statistics.median(s.fork_ms for s in self.samples) if self.samples else 0.0

    @property
    def restarts(self) -> int:
        return sum(int(u.get("NRestarts", "0") or 0) for u in self.units.values())


def read_probe(vm: VM) -> list[Sample]:
    samples = []
    for line in vm.probe_log.read_text(errors="replace").splitlines():
        parts = line.strip().split()
        if len(parts) == 5 and parts[0] == "P":
            try:
                samples.append(
                    Sample(float(parts[1]), float(parts[2]), float(parts[3]), int(parts[4]) * 1024)
                )
            except ValueError:
                continue  # a line torn by the serial port
    return samples


class _Logins(threading.Thread):
    """From the host, a fresh ssh login every second, as an admin trying to get in would."""

    def __init__(self, vm: VM) -> None:
        super().__init__(daemon=True)
        self.vm, self.logins, self.stop = vm, list[Login](), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                out = self.vm.ssh("cat /proc/uptime", check=False, timeout=15, connect=10)
                ok = out.returncode == 0
                uptime = float(out.stdout.split()[0]) if ok else None
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                ok, uptime = False, None
            self.logins.append(Login(began - self.vm.started, ok, uptime))
            self.stop.wait(max(1.0 - (time.monotonic() - began), 0.0))


def observe(vm: VM, run: Run, seconds: float, *, snapshot: bool = True) -> None:
    """Boot, then watch for `seconds` after sshd first let us in (or after 300 s without)."""
    vm.start(snapshot=snapshot)
    logins = _Logins(vm)
    logins.start()  # before sshd is up they fail fast; only failures after the first login count
    try:
        deadline = time.monotonic() + 300
        while not any(lg.ok for lg in logins.logins) and time.monotonic() < deadline:
            if vm.proc is not None and vm.proc.poll() is not None:
                raise RuntimeError(f"qemu exited: {vm.console_text()[-2000:]}")
            time.sleep(1)
        time.sleep(seconds)
    finally:
        logins.stop.set()
        if logins.is_alive():
            logins.join(timeout=30)
        run.logins = logins.logins
        run.samples = read_probe(vm)
        run.console_tail = vm.console_text()[-3000:]


def _show(vm: VM, level: str, unit: str) -> dict[str, str]:
    props = "-p LoadState -p ActiveState -p UnitFileState -p NRestarts"
    props += " -p ExecMainStartTimestampMonotonic"
    cmd = f"systemctl show {unit} {props}"
    if level == "user":  # `systemctl --user -M alice@` needs machined, which the image has not
        as_alice = f"runuser -u alice -- env XDG_RUNTIME_DIR=/run/user/{UID}"
        cmd = f"{as_alice} systemctl --user show {unit} {props}"
    out = vm.ssh(cmd, check=False, timeout=60).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _count(vm: VM, command: str) -> int:
    out = vm.ssh(command + " | wc -l", check=False, timeout=60).stdout.strip()
    return int(out) if out.isdigit() else -1


def collect(vm: VM, run: Run) -> None:
    """Ask the guest (over ssh, with patience) for unit states, kills and the load window."""
    for _ in range(10):
        if vm.ssh("true", check=False, timeout=60, connect=20).returncode == 0:
            run.ssh_at_end = True
            break
        time.sleep(5)
    if not run.ssh_at_end:
        return
    for level, unit in UNITS:
        run.units[f"{level}:{unit}"] = _show(vm, level, unit)
    run.kills = {
        "kernel": _count(vm, "journalctl -b -k -q --no-pager | grep 'Out of memory: Killed'"),
        "earlyoom": _count(vm, "journalctl -b -q -u earlyoom --no-pager | grep -i 'sending SIG'"),
        "systemd-oomd": _count(
            vm, "journalctl -b -q -u systemd-oomd --no-pager | grep -i 'killed'"
        ),
    }
    run.guard_log = vm.ssh(
        "journalctl -b -q -u spark-guard -o cat --no-pager", check=False, timeout=60
    ).stdout
    run.guard_stops = _count(
        vm, "journalctl -b -q -o cat MESSAGE_ID=068574cbf2c74b65a6744f41ff55b762 --no-pager"
    )
    # The load window: from the first loader start to the last loader done (or now).
    out = vm.ssh(
        "journalctl -b -q -o json --no-pager --output-fields=MESSAGE,_SYSTEMD_UNIT,"
        "_SYSTEMD_USER_UNIT,UNIT,USER_UNIT",
        check=False,
        timeout=120,
    ).stdout
    starts, done = [], []
    for line in out.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        msg = entry.get("MESSAGE")
        if not isinstance(msg, str):
            continue
        t = int(entry.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
        units = {entry.get(k) for k in ("_SYSTEMD_UNIT", "_SYSTEMD_USER_UNIT", "UNIT", "USER_UNIT")}
        if "llama-server.service" not in units:
            continue
        if msg.startswith("Started "):
            starts.append(t)
        elif msg.startswith("fake loader holding"):
            done.append(t)
    if starts:
        now = float(vm.ssh("cat /proc/uptime", check=False).stdout.split()[0] or 0)
        restarting = run.restarts > 0
        run.load_window = (min(starts), now if restarting or not done else max(done))


@dataclass
class Fight(_ProbeFigures):
    """The loader that fights back, seen from the probe, the host's logins and the journal."""

    started: float  # guest uptime when the start was requested
    seconds: float
    available_before: int = 0
    logins: list[Login] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    braked: float | None = None  # guest uptime the brake froze it, before any decision
    brake_why: str = ""
    decided: float | None = None  # guest uptime of the guard's decision on the unit
    reason: str = ""
    frozen: str = ""  # SG_FROZEN of the stop request
    killed: list[tuple[float, str, str]] = field(default_factory=list)  # (uptime, how, why)
    stopped: float | None = None
    pressure_wakes: list[tuple[float, float, float]] = field(default_factory=list)
    unit: dict[str, str] = field(default_factory=dict)
    bystander: tuple[dict[str, str], dict[str, str]] = ({}, {})  # PID 1's loader, before/after
    kernel_kills: int = -1
    thaw_check: str = ""

    @property
    def logins_ok(self) -> int:
        return sum(lg.ok for lg in self.logins)

    @property
    def fill_rate(self) -> float:
        """How fast the loader took MemAvailable in the second before the brake (bytes/s):
        the emulated CPU's pace, which the host sets (200-270 MiB/s when the test was
        written, about 550 MiB/s on later ones)."""
        if self.braked is None:
            return 0.0
        window = [s for s in self.samples if self.braked - 1.0 <= s.uptime <= self.braked]
        if len(window) < 2:
            return 0.0
        top = max(window, key=lambda s: s.available)
        dt = window[-1].uptime - top.uptime
        return max(0.0, (top.available - window[-1].available) / dt) if dt > 0 else 0.0

    @property
    def wakes_in_window(self) -> list[tuple[float, float, float]]:
        end = self.started + self.seconds
        return [w for w in self.pressure_wakes if self.started <= w[0] <= end]


def _uptime(vm: VM) -> float:
    return float(vm.ssh("cat /proc/uptime", timeout=60).stdout.split()[0])


def fight(vm: VM, seconds: float = 25) -> Fight:
    """Start the loader that fights back on the running guest and watch it for `seconds`."""
    before = vm.ssh("grep MemAvailable /proc/meminfo", timeout=60).stdout.split()
    bystander = _show(vm, "system", "llama-server.service")
    logins = _Logins(vm)
    logins.start()
    try:
        started = _uptime(vm)
        vm.ssh(f"systemctl start --no-block {FIGHT_UNIT}", timeout=60)
        time.sleep(seconds)
    finally:
        logins.stop.set()
        logins.join(timeout=30)
    out = Fight(started, seconds, available_before=int(before[1]) * 1024)
    end = started + seconds
    out.samples = [s for s in read_probe(vm) if started <= s.uptime <= end]
    # Logins from the host, placed by the guest's uptime when they answered (failures count
    # too: a login that did not answer within the window is a failed one).
    out.logins = logins.logins
    out.unit = _show(vm, "system", FIGHT_UNIT)
    out.bystander = (bystander, _show(vm, "system", "llama-server.service"))
    out.kernel_kills = _count(vm, "journalctl -b -k -q --no-pager | grep 'Out of memory: Killed'")
    journal = vm.ssh(
        "journalctl -b -q -u spark-guard -o json --no-pager --output-fields="
        "SG_EVENT,SG_UNIT,SG_UNITS,SG_REASON,SG_HOW,SG_ERROR,SG_FROZEN,SG_WAITED,SG_POLL",
        check=False,
        timeout=120,
    ).stdout
    unit = FIGHT_UNIT  # PID 1's units are named bare in the journal
    for line in journal.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        t = int(e.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
        kind = e.get("SG_EVENT")
        if kind == "pressure-wake":
            with contextlib.suppress(TypeError, ValueError):
                out.pressure_wakes.append((t, float(e["SG_WAITED"]), float(e["SG_POLL"])))
            continue
        if kind == "brake" and t >= started and out.braked is None:
            if unit in str(e.get("SG_UNITS", "")):
                out.braked, out.brake_why = t, str(e.get("SG_ERROR", ""))
            continue
        if e.get("SG_UNIT") != unit or t < started:
            continue
        if kind == "decision" and out.decided is None:
            out.decided, out.reason = t, str(e.get("SG_REASON", ""))
        elif kind == "unit-stop-requested" and not out.frozen:
            out.frozen = str(e.get("SG_FROZEN", ""))
        elif kind == "unit-killed":
            out.killed.append((t, str(e.get("SG_HOW", "")), str(e.get("SG_ERROR", ""))))
        elif kind == "unit-stopped" and out.stopped is None:
            out.stopped = t
    out.thaw_check = vm.ssh(THAW_CHECK, check=False, timeout=120).stdout.strip()
    return out


# Memory pressure without memory use: a reader that re-reads a file a little larger than
# its cgroup's MemoryMax. Each pass evicts what the next pass needs (refault distance
# under the cgroup's cache: the kernel's thrashing detection), so every read waits on
# the disk as a memory stall, counted in /proc/pressure/memory, while MemAvailable
# hardly moves (24 MiB of cache at most). The guard's poll is then its longest, and
# only the PSI trigger can wake it early.
THRASH = (
    "set -e; f=/var/tmp/sg-thrash.bin; "
    "[ -e $f ] || dd if=/dev/urandom of=$f bs=1M count=64 status=none; "
    "sync; echo 1 > /proc/sys/vm/drop_caches; "
    "systemd-run --unit=sg-thrash -p MemoryMax=48M -p MemorySwapMax=0 "
    "/bin/sh -c 'while :; do cat /var/tmp/sg-thrash.bin > /dev/null; done'"
)


def thrash(vm: VM, seconds: float = 8) -> tuple[float, float, list[tuple[float, float, float]]]:
    """(guest uptime at the start, at the end, the guard's pressure wakes in between)."""
    vm.ssh(THRASH, timeout=120)
    started = _uptime(vm)
    time.sleep(seconds)
    vm.ssh("systemctl stop sg-thrash.service", check=False, timeout=60)
    ended = _uptime(vm)
    journal = vm.ssh(
        "journalctl -b -q -u spark-guard -o json --no-pager --output-fields="
        "SG_EVENT,SG_WAITED,SG_POLL",
        check=False,
        timeout=120,
    ).stdout
    wakes = []
    for line in journal.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            e = json.loads(line)
            t = int(e.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
            if e.get("SG_EVENT") == "pressure-wake" and started <= t <= ended:
                wakes.append((t, float(e["SG_WAITED"]), float(e["SG_POLL"])))
    return started, ended, wakes
