"""The man page's SYNOPSIS and the bash completion, made from the command line's own parser.

Written by hand they drifted from it (spark-guard(8) lacked --log, most preflight flags,
--stop-timeout and --config; the completion offered harden's options for audit and
lacked release --no-start). Both are checked in; tests/test_clidoc.py fails when they
differ from what this makes, and `python -m lab.clidoc --write` writes them again.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from spark_guard.cli import COMMANDS, _parser

ROOT = Path(__file__).resolve().parent.parent
MAN = ROOT / "packaging" / "man" / "spark-guard.8"
COMPLETION = ROOT / "packaging" / "spark-guard.bash-completion"
BEGIN = '.\\" SYNOPSIS: made by lab/clidoc.py from the parser; do not edit'
END = '.\\" end of SYNOPSIS'

# What a command's positional arguments are, for the completion: a shell function below.
POSITIONAL = {
    "audit": "_spark_guard_units",
    "preflight": "_spark_guard_models; _spark_guard_units",
    "harden": "_spark_guard_units",
    "release": "_spark_guard_blocked",
    "check-config": "_spark_guard_files",
}
# Options whose value is a file or a directory.
FILE_VALUES = {"--config", "--mmproj", "--directory"}


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = _parser(name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices[name]
    assert isinstance(chosen, argparse.ArgumentParser)
    return chosen


def _options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and a.dest != "help"]


def _positionals(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if not a.option_strings]


def _roff(text: str) -> str:
    return text.replace("\\", "\\\\").replace("-", "\\-")


def synopsis() -> str:
    """The SYNOPSIS lines, one command each, every option the parser takes."""
    lines = [BEGIN]
    for name in COMMANDS:
        p = command_parser(name)
        lines.append(f".B spark-guard {_roff(name)}")
        for a in _positionals(p):
            shown = _roff(str(a.metavar or a.dest))
            more = " ..." if a.nargs in ("*", "+") else ""
            optional = a.nargs in ("?", "*")
            lines.append(f".RI [ {shown}{more} ]" if optional else f".IR {shown}{more}")
        for a in _options(p):
            flags = " | ".join(_roff(o) for o in a.option_strings)
            if a.nargs == 0:
                lines.append(f".RB [ {flags} ]")
            else:
                value = a.metavar or (
                    "{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper()
                )
                lines.append(f".RB [ {flags}")
                lines.append(f".IR {_roff(str(value))} ]")
        lines.append(".br")
    lines[-1] = END
    return "\n".join(lines) + "\n"


def man_page(current: str) -> str:
    """The man page with its SYNOPSIS section's body replaced by synopsis()."""
    pattern = re.compile(r"(?s)(\.SH SYNOPSIS\n).*?(\.SH DESCRIPTION\n)")
    if not pattern.search(current):
        raise ValueError(f"{MAN}: no SYNOPSIS section")
    return pattern.sub(lambda m: m.group(1) + synopsis() + m.group(2), current, count=1)


COMPLETION_HEAD = """\
# bash completion for spark-guard: made by lab/clidoc.py from the parser; do not edit.
_spark_guard_units() {
    COMPREPLY+=($(compgen -W "$(systemctl list-units --type=service --all --no-legend --plain 2>/dev/null | awk '{print $1}')" -- "$cur"))
    COMPREPLY+=($(compgen -W "$(systemctl list-unit-files --type=service --no-legend 2>/dev/null | awk '{print $1}')" -- "$cur"))
    local sock
    for sock in /run/user/*/systemd/private; do
        [ -S "$sock" ] || continue
        local uid=${sock#/run/user/}; uid=${uid%%/*}
        COMPREPLY+=($(compgen -W "$(systemctl --user -M "$uid@" list-units --type=service --no-legend --plain 2>/dev/null | awk -v u="$uid" '{print "user:" u ":" $1}')" -- "$cur"))
    done
    command -v docker >/dev/null 2>&1 &&
        COMPREPLY+=($(compgen -W "$(docker ps -a --format 'container:{{.Names}}' 2>/dev/null)" -- "$cur"))
}
_spark_guard_models() {
    compopt -o filenames 2>/dev/null
    COMPREPLY+=($(compgen -f -X '!*.gguf' -- "$cur") $(compgen -d -- "$cur"))
}
_spark_guard_files() {
    compopt -o filenames 2>/dev/null
    COMPREPLY+=($(compgen -f -- "$cur"))
}
_spark_guard_blocked() {
    COMPREPLY+=($(compgen -W "$(ls /var/lib/spark-guard/blocked 2>/dev/null | sed 's/\\.json$//')" -- "$cur"))
}
_spark_guard() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd=${COMP_WORDS[1]}
    COMPREPLY=()
"""


def completion() -> str:
    """The bash completion: each command's own options, its values, its positionals."""
    out = [COMPLETION_HEAD]
    out.append('    if [ "$COMP_CWORD" -eq 1 ]; then\n')
    out.append(
        f'        COMPREPLY=($(compgen -W "{" ".join(COMMANDS)} --help --version" -- "$cur"))\n'
    )
    out.append("        return\n    fi\n")
    out.append("    case $prev in\n")
    files = sorted(FILE_VALUES)
    out.append(f"        {'|'.join(files)}) _spark_guard_files; return ;;\n")
    out.append("    esac\n    case $cmd in\n")
    for name in COMMANDS:
        p = command_parser(name)
        flags = [o for a in _options(p) for o in a.option_strings]
        choices = {o: a.choices for a in _options(p) if a.choices for o in a.option_strings}
        out.append(f"        {name})\n")
        for flag, values in choices.items():
            out.append(
                f'            [ "$prev" = {flag} ] && {{ COMPREPLY=($(compgen -W "{" ".join(map(str, values))}" -- "$cur")); return; }}\n'
            )
        out.append(
            f'            if [[ $cur == -* ]]; then COMPREPLY=($(compgen -W "{" ".join(["--help", *flags])}" -- "$cur")); return; fi\n'
        )
        if name in POSITIONAL:
            out.append(f"            {POSITIONAL[name]} ;;\n")
        else:
            out.append("            ;;\n")
    out.append("    esac\n}\ncomplete -F _spark_guard spark-guard\n")
    return "".join(out)


def main(argv: list[str]) -> int:
    made = {MAN: man_page(MAN.read_text()), COMPLETION: completion()}
    if "--write" in argv:
        for path, text in made.items():
            path.write_text(text)
        return 0
    stale = [p for p, text in made.items() if p.read_text() != text]
    for path in stale:
        print(f"{path}: differs from the parser; python -m lab.clidoc --write", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
