"""The incident in a box: a wedge-prone model-serving machine booted with systemd as PID 1.

Run by demo/run (which installs what is missing and builds the .deb) as
`python -m demo.incident DEB` from the checkout's root. Lays out, in a
Debian 12 container (lab/nspawn.py), what ../shared/seeds' incident report
describes: llama-server on both levels (one a linger user's), the same
model twice, an idle server holding memory, and a loader of a model far
bigger than the machine (a sparse GGUF with DeepSeek-V3's
real metadata: a few kB on disk, 200+ GiB as far as any reader can tell).
Boots it, shows what an admin would see, releases one unit, and removes
everything it started. Exit 0 when the guard did what it should.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lab import LAB
from lab.harness import file_tree
from lab.nspawn import Container
from lab.synth import SPECS, Spec, write

ALICE = 1000
LOADER = """[Unit]
Description={what}
After=network.target
[Service]
ExecStart={exec_start}
Restart=on-failure
[Install]
WantedBy={target}
"""
CONFIG = """# The demo's budget: a 2 GiB reserve (a Spark's default is 8 GiB or 7 %).
[budget]
reserve = "2GiB"
reserve_percent = 0
[loaders.footprint]
"ollama.service" = "600MiB"
"""
# Always blocked: the model that cannot fit, on both levels (the incident's own case:
# alice's copy starts under her linger manager, beside the guard, at boot). Of the two
# copies of the model that fits, the one whose manager started it second is blocked.
BIG = "llama-deepseek.service"
BIGS = (BIG, f"user:{ALICE}:{BIG}")
COPIES = ("llama-qwen.service", "user:1000:llama-qwen.service")


def say(text: str = "") -> None:
    print(text, flush=True)


def step(text: str) -> None:
    say(f"\n==> {text}")


def show(c: Container, title: str, *cmd: str, user: int | None = None) -> str:
    out = c.run(*cmd, check=False, user=user, timeout=120)
    say(f"\n$ {title}")
    text = (out.stdout + out.stderr).rstrip()
    say("\n".join("  " + line for line in text.splitlines()))
    return text


def lay_out(c: Container) -> None:
    models = c.path("/srv/models")
    models.mkdir(parents=True)
    big = write(SPECS["deepseek-v3"], models)
    big.rename(models / "deepseek-v3-q2_k.gguf")
    small = Spec("Qwen3-0.6B", "qwen3", 28, 1024, 16, 8, 128, 128, 40960, 151936, n_ff=3072)
    write(small, models).rename(models / "qwen3-0.6b-q4_k.gguf")
    for name in ("llama-server", "ollama"):
        dest = c.path(f"/usr/local/bin/{name}")
        shutil.copy(LAB / "fake_loader.py", dest)
        text = dest.read_text()
        dest.write_text("#!/usr/bin/python3\n" + text)
        dest.chmod(0o755)
    system = c.path("/etc/systemd/system")
    wants = system / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    units = {
        "llama-qwen.service": (
            "llama.cpp server: Qwen3-0.6B",
            "/usr/local/bin/llama-server -m /srv/models/qwen3-0.6b-q4_k.gguf -c 4096 "
            "--alloc 300 --rate 150",
        ),
        "llama-deepseek.service": (
            "llama.cpp server: DeepSeek-V3 (Q2_K)",
            "/usr/local/bin/llama-server -m /srv/models/deepseek-v3-q2_k.gguf -c 8192 "
            "--alloc 300 --rate 150",
        ),
        "ollama.service": ("Ollama: idle, its model loaded", "/usr/local/bin/ollama --alloc 400"),
    }
    for name, (what, exec_start) in units.items():
        (system / name).write_text(
            LOADER.format(what=what, exec_start=exec_start, target="multi-user.target")
        )
        (wants / name).symlink_to(f"/etc/systemd/system/{name}")
    # alice lingers: her manager starts at boot and with it her copy of the same model.
    for name, line in (
        ("passwd", f"alice:x:{ALICE}:{ALICE}:Alice:/home/alice:/bin/sh"),
        ("group", f"alice:x:{ALICE}:"),
        ("shadow", "alice:!:20000:0:99999:7:::"),
    ):
        with open(c.path(f"/etc/{name}"), "a") as f:
            f.write(line + "\n")
    user_dir = c.path("/home/alice/.config/systemd/user")
    (user_dir / "default.target.wants").mkdir(parents=True)
    for name, what in (("llama-qwen.service", "Qwen3-0.6B"), (BIG, "DeepSeek-V3 (Q2_K)")):
        (user_dir / name).write_text(
            LOADER.format(
                what=f"alice's llama.cpp server: {what}",
                exec_start=units[name][1],
                target="default.target",
            )
        )
        (user_dir / "default.target.wants" / name).symlink_to(
            f"/home/alice/.config/systemd/user/{name}"
        )
    for dirpath, dirs, files in os.walk(c.path("/home/alice")):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            os.lchown(name, ALICE, ALICE)
    c.path("/var/lib/systemd/linger").mkdir(parents=True, exist_ok=True)
    c.path("/var/lib/systemd/linger/alice").touch()


def wait_blocked(c: Container, timeout: float = 120) -> bool:
    """Until the big loader and one copy are blocked: their records there, and at step
    `blocked` (a block under way can wait for a user's manager to answer at boot)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = c.run("ls", "/var/lib/spark-guard/blocked", check=False).stdout.split()
        done = {
            name[: -len(".json")]
            for name in found
            if name.endswith(".json") and _step(c, name) == "blocked"
        }
        if all(unit in done for unit in BIGS) and any(unit in done for unit in COPIES):
            return True
        time.sleep(1)
    return False


def _step(c: Container, name: str) -> str:
    text = c.run("cat", f"/var/lib/spark-guard/blocked/{name}", check=False).stdout
    try:
        return str(json.loads(text).get("step", ""))
    except ValueError:
        return ""


# Where each loader's enablement link lives: what `disable` must remove, `release` put back.
def wants_link(c: Container, unit: str) -> Path:
    if unit.startswith(f"user:{ALICE}:"):
        name = unit.split(":", 2)[2]
        return c.path(f"/home/alice/.config/systemd/user/default.target.wants/{name}")
    return c.path(f"/etc/systemd/system/multi-user.target.wants/{unit}")


def unit_files(c: Container) -> dict[str, tuple[object, ...]]:
    """The loaders' unit files and links on both levels: type, content or target, owner, mode.
    (Only theirs: a first boot may enable other units by preset.)"""
    tree = file_tree(c.path("/etc/systemd/system"), c.path("/home/alice/.config/systemd"))
    names = {"llama-qwen.service", BIG, "ollama.service"}
    return {path: what for path, what in tree.items() if Path(path).name in names}


def states(c: Container) -> dict[str, dict[str, str]]:
    props = ("LoadState", "ActiveState", "UnitFileState", "NRestarts")
    out = {
        name: c.show(name, *props)
        for name in ("llama-qwen.service", "llama-deepseek.service", "ollama.service")
    }
    for name in ("llama-qwen.service", BIG):
        out[f"user:{ALICE}:{name}"] = c.show(name, *props, user=ALICE)
    return out


def main() -> int:
    deb = Path(sys.argv[1])
    started = time.monotonic()
    with Container("bookworm", extra=("openssh-server",)) as c:
        step("laying out a wedge-prone model-serving machine")
        lay_out(c)
        say("  system: llama-qwen (Qwen3-0.6B), llama-deepseek (DeepSeek-V3 Q2_K, sparse")
        say("          GGUF of 200+ GiB: real header, no data on disk), ollama (idle, 400 MiB)")
        say("  alice (linger): llama-qwen, the same Qwen3-0.6B again, and llama-deepseek,")
        say("          the same DeepSeek-V3 again: the incident's copy on both levels")
        say("  all enabled, Restart=on-failure")

        step("installing spark-guard from the .deb (dpkg, its maintainer scripts run)")
        out = subprocess.run(
            ["dpkg", "--root", str(c.root), "-i", str(deb)], capture_output=True, text=True
        )
        if out.returncode != 0:
            say(out.stdout[-2000:] + out.stderr[-2000:])
            return 1
        c.path("/etc/spark-guard.toml").write_text(CONFIG)
        say("  enabled at install; ordered before basic.target, so before every loader")
        say("  its budget (/etc/spark-guard.toml): reserve 2 GiB")

        before = unit_files(c)

        step("booting it: systemd as PID 1, the loaders start as on the day of the incident")
        c.boot()
        blocked = wait_blocked(c)

        step("what an admin sees")
        show(
            c,
            "systemctl status spark-guard",
            "systemctl",
            "status",
            "--no-pager",
            "-n",
            "0",
            "spark-guard",
        )
        show(
            c,
            "journalctl -u spark-guard -o cat",
            "journalctl",
            "-u",
            "spark-guard",
            "--no-pager",
            "-o",
            "cat",
        )
        verbose = c.run(
            "journalctl", "--no-pager", "-o", "verbose", "SG_EVENT=unit-blocked", check=False
        ).stdout
        say("\n$ journalctl SG_EVENT=unit-blocked -o verbose   (their fields)")
        for line in verbose.splitlines():
            if line.strip().startswith(("MESSAGE=", "MESSAGE_ID=", "SG_", "PRIORITY=")):
                say("  " + line.strip())
        show(c, "spark-guard status", "spark-guard", "status")
        show(c, "spark-guard audit", "spark-guard", "audit")
        ssh = show(c, "systemctl is-active ssh", "systemctl", "is-active", "ssh")
        unit_states = states(c)
        say("\n$ the loaders (systemctl show: LoadState ActiveState UnitFileState NRestarts)")
        for unit, s in unit_states.items():
            say(
                f"  {unit:32} {s.get('LoadState')} {s.get('ActiveState')} "
                f"{s.get('UnitFileState')} restarts={s.get('NRestarts')}"
            )

        # Disabled, not only stopped and masked: each blocked unit's wants link is gone.
        blocked_units = [u for u in (*BIGS, *COPIES) if unit_states[u].get("LoadState") == "masked"]
        still_enabled = [u for u in blocked_units if wants_link(c, u).is_symlink()]

        step("releasing one unit: spark-guard release llama-deepseek.service")
        show(
            c,
            "spark-guard release llama-deepseek.service",
            "spark-guard",
            "release",
            "llama-deepseek.service",
        )
        released = c.show("llama-deepseek.service", "LoadState", "UnitFileState")
        say(
            f"  llama-deepseek.service is now {released.get('LoadState')}, "
            f"{released.get('UnitFileState')} (not started: that is the admin's call)"
        )
        # Exactly undone: every unit file and link as before the boot, but for the links of
        # the units still blocked; the released unit's link is back, target, owner and mode.
        after = unit_files(c)
        expected = {
            path: what
            for path, what in before.items()
            if path not in {str(wants_link(c, u)) for u in blocked_units if u != BIG}
        }
        undone = [
            f"{path}: {expected.get(path, 'absent')} -> {after.get(path, 'absent')}"
            for path in sorted(set(expected) | set(after))
            if expected.get(path) != after.get(path)
        ]
        reasons = (
            c.run("journalctl", "--no-pager", "-o", "cat", "SG_EVENT=decision", check=False)
            .stdout.strip()
            .splitlines()
        )

        step("shutting down and removing everything the demo started")

    copies = [unit_states[u] for u in COPIES]
    stopped = [s for s in [*(unit_states[u] for u in BIGS), *copies] if s["LoadState"] == "masked"]
    ok = (
        blocked
        and ssh.strip() == "active"
        and all(unit_states[u]["LoadState"] == "masked" for u in BIGS)
        and sorted(s["ActiveState"] for s in copies) == ["active", "inactive"]
        and len(stopped) == 3
        and all(s["ActiveState"] in ("inactive", "failed") for s in stopped)
        and all(s["NRestarts"] == "0" and s["UnitFileState"] == "masked-runtime" for s in stopped)
        and unit_states["ollama.service"]["ActiveState"] == "active"
        and released.get("LoadState") == "loaded"
        and len(blocked_units) == 3
        and not still_enabled
        and not undone
    )
    step(f"summary (booted, judged, shown and removed in {time.monotonic() - started:.0f} s)")
    say("  spark-guard started before the loaders and acted while the machine booted:")
    for line in reasons:
        say(f"  - {line}")
    say("  DeepSeek-V3 was stopped on both levels: alice's copy too, seen at boot before")
    say("  her manager answered and foreseen from what the kernel showed of it.")
    say("  Each one was stopped and masked (in the manager's runtime control directory)")
    say("  and stayed down: Restart= could not bring it back. The one Qwen3 copy that fits")
    say("  and the idle ollama were left running; sshd stayed reachable.")
    if still_enabled or len(blocked_units) != 3:
        say(f"  NOT disabled: {', '.join(still_enabled) or 'not three units blocked'}")
    else:
        say(f"  disabled (checked: no wants link left for {', '.join(blocked_units)})")
    if undone:
        say("  `spark-guard release` did NOT undo the block exactly:")
        for line in undone:
            say(f"    {line}")
    else:
        say("  `spark-guard release` undid a block exactly (checked: every loader's unit file")
        say("  and link on both levels as before the boot, owners and modes too, but for the")
        say("  unit still blocked)")
    say("  result: " + ("as expected" if ok else "NOT as expected: see above"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
