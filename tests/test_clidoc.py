"""The man page's synopsis and the bash completion are the parser's (lab/clidoc.py)."""

from __future__ import annotations

import subprocess

from lab import clidoc
from spark_guard.cli import COMMANDS


def test_the_man_pages_synopsis_and_the_completion_are_made_from_the_parser():
    """Written by hand they drifted: spark-guard(8) lacked --log, most preflight flags,
    --stop-timeout and --config; the completion offered harden's options for audit and
    lacked release --no-start. Both are what the parser says, byte for byte."""
    assert clidoc.MAN.read_text() == clidoc.man_page(clidoc.MAN.read_text())
    assert clidoc.COMPLETION.read_text() == clidoc.completion()
    man = clidoc.MAN.read_text()
    for name in COMMANDS:
        for action in clidoc.command_parser(name)._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert clidoc._roff(flag) in man, (name, flag)


def test_every_option_and_argument_of_every_command_says_what_it_is():
    """Issue 30 §3: `--help` text for every option. --json, --config, -fa, --swa-full,
    --log-level and the positional arguments had none."""
    bare = [
        (name, action.option_strings or action.dest)
        for name in COMMANDS
        for action in clidoc.command_parser(name)._actions
        if not (action.help or "").strip() and action.dest != "help"
    ]
    assert bare == []


def _complete(*words: str) -> list[str]:
    """What bash offers after `spark-guard WORDS...` (the last word is the one completed)."""
    script = (
        f"source {clidoc.COMPLETION}\n"
        f"COMP_WORDS=(spark-guard {' '.join(words)}); COMP_CWORD={len(words)}\n"
        '_spark_guard; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def test_the_completion_offers_each_commands_own_options():
    assert "--no-start" in _complete("release", "--")
    audit = _complete("audit", "--")
    assert "--json" in audit and "--yes" not in audit  # harden's, not audit's
    assert {"--stop-timeout", "--config"} <= set(_complete("rescue", "--"))
    assert _complete("preflight", "-fa", "") == ["on", "off", "auto"]
    assert "check-config" in _complete("c")


def test_every_config_key_is_in_the_man_page_and_the_shipped_file():
    """spark-guard.toml(5) lacked docker_root, [paths] and [poll]'s keys: every key the
    config reads is named in the man page and, commented out, in the shipped file."""
    from pathlib import Path

    from spark_guard.core.config import SCHEMA

    root = Path(clidoc.__file__).resolve().parent.parent
    man = (root / "packaging" / "man" / "spark-guard.toml.5").read_text().replace("\\-", "-")
    shipped = (root / "packaging" / "spark-guard.toml").read_text()
    for section, key in SCHEMA:
        assert f".B {key}" in man or f".BR {key}" in man, (section, key)
        assert f"# {key} =" in shipped, (section, key)
