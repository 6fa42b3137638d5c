"""Loader containers at boot, in the 2 GiB VM (issue 19): what dockerd's restart policy does.

Many model servers are containers started once with a restart policy
(`docker run -d --restart unless-stopped ... vllm/vllm-openai`): dockerd
starts them again at every boot. The layout:

- Debian's docker.io, enabled (lab/vm.py has it installed and disabled), on
  /run/docker.sock; no bridge and no iptables (the containers run with
  `--network none`: nothing here needs a network, and a TCG boot is slow
  enough), and unconfined by AppArmor (the guest's kernel has it, the image
  not apparmor_parser, which docker.io only recommends);
- one local image, `docker import`ed from a tarball made here (no registry):
  an empty root but for the /bin, /lib, /lib64 and /sbin links into usr/
  that Debian 12 has; every container gets the guest's /usr bind-mounted
  read-only, so the guest's python3 runs inside. It is tagged
  `vllm/vllm-openai:test` and `ollama/ollama:test`, images the guard knows
  as loaders;
- `vllm` (`--restart unless-stopped`): waits, then allocates anonymous
  memory for real and touches it, as lab/wedge.py's loaders do
  (lab/fake_loader.py), then holds it;
- `keep` (`--restart always`, ollama's image): holds KEEP_MIB at once, and
  is protected by the guard's config;
- `vllm-box.service`, the way people autostart a containerized server: a
  unit that runs `docker run --rm --name box ...` in the foreground under
  Restart=always; `box` loads as `vllm` does. Installed disabled.

What each loader does is read at each start from /usr/local/lib/sg-lab/NAME.load
("WAIT MiB RATE"), so a run can create the containers on a first boot (dockerd
must be running for that: over ssh, `create()`) with a load that fits, and
give them another for the boots it measures (`set_load()`).

The guard keeps its default engine timeout (2 s): at boot dockerd does not
answer while it restarts containers, and the guard reads who they are from
dockerd's files and kills the loader from the kernel's side until dockerd can
stop it (docs/containers.md).
"""

from __future__ import annotations

import io
import json
import shlex
import shutil
import tarfile
from pathlib import Path

from lab.vm import VM
from lab.wedge import HERE, PROBE_UNIT, _enable

LAB = "/usr/local/lib/sg-lab"  # in the guest's /usr: seen by the containers too
TARBALL = "/var/lib/sg-lab/rootfs.tar"
LOADER, KEEP = "vllm", "keep"
BOX, BOX_UNIT = "box", "vllm-box.service"  # a container that a unit runs (docker run --rm)
IMAGES = {LOADER: "vllm/vllm-openai:test", KEEP: "ollama/ollama:test"}
POLICIES = {LOADER: "unless-stopped", KEEP: "always"}
WAIT_S = 5  # after its start, before it allocates: the guard has seen it by then
LOADER_MIB = 900
LOAD_RATE = 100  # MiB/s, as lab/wedge.py
KEEP_MIB = 50
RESERVE_MIB = 200
OTHERS = (
    "/etc/systemd/system/multi-user.target.wants/earlyoom.service",
    "/etc/systemd/system/multi-user.target.wants/systemd-oomd.service",
    "/etc/systemd/system/sockets.target.wants/systemd-oomd.socket",
    "/etc/systemd/system/dbus-org.freedesktop.oom1.service",
)
DAEMON = {"bridge": "none", "iptables": False, "ip6tables": False, "log-driver": "journald"}

# The container's command: the load as the file says at this start, then the loader. sh stays
# the container's PID 1 so that SIGTERM (a `docker stop`) ends it at once: an init without a
# handler ignores it, and `--init` cannot mount docker-init through the read-only /usr.
ENTRY = (
    "trap 'kill $c 2>/dev/null; exit 0' TERM; "
    f'read w m r < {LAB}/"$0".load; sleep "$w" & c=$!; wait $c; '
    f'python3 {LAB}/fake_loader.py --alloc "$m" --rate "$r" & c=$!; wait $c'
)


def guard_config(footprint: str = "3GiB", grace: str = "60s") -> str:
    """The guard's config: the loader container's footprint, `keep` protected."""
    return f"""
[budget]
reserve = "{RESERVE_MIB}MiB"
[boot]
grace = "{grace}"
[loaders.footprint]
"container:{LOADER}" = "{footprint}"
"container:{BOX}" = "3GiB"
[protected]
extra = ["container:{KEEP}"]
"""


def rootfs_tar() -> bytes:
    """The image's root: Debian 12's merged-/usr links, and the directories a container needs."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("usr", "etc", "proc", "sys", "dev", "tmp", "run", "var", "var/tmp"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name.endswith("tmp") else 0o755
            tar.addfile(info)
        for name in ("bin", "lib", "lib64", "sbin"):
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, f"usr/{name}", 0o777
            tar.addfile(info)
    return buf.getvalue()


def prepare(
    vm: VM,
    deb: Path | None,
    *,
    config: str | None = None,
    loader: tuple[int, int, int] = (WAIT_S, LOADER_MIB, LOAD_RATE),
    probe: bool = False,
) -> None:
    """Lay the container case out in vm.root: docker enabled, the image's tarball, the loads.

    With a deb the guard is installed with `config`, and disabled: the first boot, which
    creates the containers, runs without it (`enable_guard()` before powering off).
    """
    lab = vm.path(LAB)
    lab.mkdir(parents=True)
    shutil.copy(HERE / "fake_loader.py", lab / "fake_loader.py")
    (lab / f"{LOADER}.load").write_text("{} {} {}\n".format(*loader))
    (lab / f"{KEEP}.load").write_text(f"0 {KEEP_MIB} 0\n")
    (lab / f"{BOX}.load").write_text("{} {} {}\n".format(*loader))
    # The wrapper's script: a unit file would expand the entry's $ words itself.
    (lab / f"{BOX}.sh").write_text(f"exec {_docker_run(BOX, ['--rm'])}\n")
    vm.path(f"/etc/systemd/system/{BOX_UNIT}").write_text(BOX_UNIT_TEXT)
    vm.path(TARBALL).parent.mkdir(parents=True)
    vm.path(TARBALL).write_bytes(rootfs_tar())
    vm.path("/etc/docker").mkdir(exist_ok=True)
    vm.path("/etc/docker/daemon.json").write_text(json.dumps(DAEMON) + "\n")
    vm.enable_docker()
    # The base image has earlyoom and systemd-oomd enabled: off, as lab/wedge.py has them.
    for link in OTHERS:
        vm.path(link).unlink(missing_ok=True)
    if probe:
        shutil.copy(HERE / "probe.py", vm.path("/opt/probe.py"))
        vm.path("/etc/systemd/system/probe.service").write_text(PROBE_UNIT)
        _enable(vm, "/etc/systemd/system/sysinit.target.wants", "/etc/systemd/system/probe.service")
    if deb is not None:
        vm.install(deb)
        vm.path("/etc/spark-guard.toml").write_text(config or guard_config())
        vm.chroot("systemctl", "disable", "--quiet", "spark-guard.service")


def _docker_run(name: str, how: list[str], image: str = IMAGES[LOADER]) -> str:
    return shlex.join(
        [
            "docker", "run", *how, "--name", name,
            # the guest's kernel has AppArmor, the image not its parser (a Recommends)
            "--security-opt", "apparmor=unconfined",
            "--network", "none", "-v", "/usr:/usr:ro", image, "sh", "-c", ENTRY, name,
        ]
    )  # fmt: skip


def _run(name: str) -> str:
    return _docker_run(name, ["-d", "--restart", POLICIES[name]], IMAGES[name])


BOX_UNIT_TEXT = f"""[Unit]
Description=a containerized model server, as people autostart one
After=docker.service
Requires=docker.service

[Service]
ExecStartPre=-/usr/bin/docker rm -f {BOX}
ExecStart=/bin/sh {LAB}/{BOX}.sh
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


def create(vm: VM) -> None:
    """On the running guest: import the image, tag it, run both containers."""
    script = " && ".join(
        [
            f"docker import {TARBALL} {IMAGES[LOADER]} >/dev/null",
            f"docker tag {IMAGES[LOADER]} {IMAGES[KEEP]}",
            f"{_run(LOADER)} >/dev/null",
            f"{_run(KEEP)} >/dev/null",
        ]
    )
    vm.ssh(script, timeout=180)


def set_load(vm: VM, wait: int, mib: int, rate: int) -> None:
    """On the running guest: what `vllm` loads from its next start on."""
    vm.ssh(f"echo '{wait} {mib} {rate}' > {LAB}/{LOADER}.load")


def enable_guard(vm: VM) -> None:
    vm.ssh("systemctl enable --quiet spark-guard.service")


def inspect(vm: VM, name: str) -> dict[str, object]:
    """`docker inspect NAME` on the guest ({} when it cannot answer)."""
    out = vm.ssh(f"docker inspect {name}", check=False, timeout=60)
    try:
        found = json.loads(out.stdout)
    except ValueError:
        return {}
    return found[0] if isinstance(found, list) and found and isinstance(found[0], dict) else {}


def state(vm: VM, name: str) -> dict[str, str]:
    """What matters of a container, flat: Status, Running, StartedAt, RestartPolicy,
    MaximumRetryCount, RestartCount, OOMKilled, ExitCode."""
    found = inspect(vm, name)
    if not found:
        return {}
    st, host, config = (found.get(k) or {} for k in ("State", "HostConfig", "Config"))
    assert isinstance(st, dict) and isinstance(host, dict) and isinstance(config, dict)
    policy = host.get("RestartPolicy") or {}
    return {
        "Status": str(st.get("Status")),
        "Running": str(st.get("Running")),
        "StartedAt": str(st.get("StartedAt")),
        "RestartPolicy": str(policy.get("Name")),
        "MaximumRetryCount": str(policy.get("MaximumRetryCount")),
        "RestartCount": str(found.get("RestartCount")),
        "OOMKilled": str(st.get("OOMKilled")),
        "ExitCode": str(st.get("ExitCode")),
        "Id": str(found.get("Id")),
        "Image": str(config.get("Image")),
    }


def docker_log(vm: VM) -> str:
    """docker's state and its journal, for an assertion's message."""
    return vm.ssh(
        "docker ps -a --no-trunc 2>&1; systemctl is-active docker containerd 2>&1; "
        "journalctl -b -q -u docker -u containerd -o cat --no-pager | tail -n 30",
        check=False,
        timeout=60,
    ).stdout


def guard_log(vm: VM) -> str:
    return vm.ssh(
        "systemctl is-active spark-guard; journalctl -b -q -u spark-guard -o cat --no-pager "
        "| tail -n 60",
        check=False,
        timeout=60,
    ).stdout


def events(vm: VM, unit: str) -> list[dict[str, object]]:
    """The guard's journal events about `unit` on this boot (SG_EVENT, SG_UNIT, ...)."""
    out = vm.ssh(
        f"journalctl -b -q -u spark-guard -o json --no-pager SG_UNIT={shlex.quote(unit)}",
        check=False,
        timeout=60,
    ).stdout
    found = []
    for line in out.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            found.append(entry)
    return found


def kernel_kills(vm: VM) -> int:
    out = vm.ssh(
        "journalctl -b -k -q --no-pager | grep -c 'Out of memory: Killed'", check=False, timeout=60
    ).stdout.strip()
    return int(out) if out.isdigit() else -1


def wait_for(vm: VM, command: str, timeout: float) -> bool:
    """Until `command` succeeds on the guest (polled once a second there), or `timeout`."""
    return (
        vm.ssh(
            f"for i in $(seq {int(timeout)}); do {command} && exit 0; sleep 1; done; exit 1",
            check=False,
            timeout=timeout + 60,
        ).returncode
        == 0
    )
