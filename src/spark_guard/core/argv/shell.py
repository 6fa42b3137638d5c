"""Through wrappers and shell scripts to the commands a command line runs.

Every reader of command lines (loadspec, lmstudio, ollama, classify) walks them
here: `env X=1 nice -n 5 llama-server ...`, `sh -c "sleep 20; exec ollama run x"`,
`bash -lc '...'`. One cap for all of them: a `sh -c` script of more than SCRIPT_MAX
characters is not read at all. Splitting shell words costs about 35 ms per 64 KiB
in Python, and a loader's script is a line; a user's 64 KiB one would cost every pass.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence

SCRIPT_MAX = 8 << 10  # characters of one `sh -c` script that are split into commands
MAX_DEPTH = 8  # wrappers of shells of wrappers
WRAPPERS = ("env", "nice", "ionice", "taskset", "numactl", "stdbuf", "chrt", "systemd-inhibit")
SHELLS = ("sh", "bash", "dash", "zsh")
# What the kernel shows for a script run by its `#!` line: the interpreter, then the
# script's path as it was exec'd (`/usr/bin/python3 /usr/local/bin/llama-server -m x`).
# A path right after one of these is the command that ran; its name says what it is.
INTERPRETERS = (*SHELLS, "python", "python3", "perl")
_VERSIONED = re.compile(r"^python3\.\d+$")
KEYWORDS = ("then", "do", "else", "elif", "if", "while", "until", "!", "{", "}", "(", "time")
_NUMERIC = re.compile(r"^(0x)?[0-9a-fA-F,.:-]+$")
_TAKES_NAME = ("-u", "--unset", "-C", "--chdir")  # env's options whose value is a word
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_VARIABLE = re.compile(r"^\$(?:([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)\})$")


def capped(argv: Sequence[str]) -> list[str]:
    """argv with any `-c` script over SCRIPT_MAX blanked: not read, as everywhere."""
    return [
        "" if i and argv[i - 1] == "-c" and len(a) > SCRIPT_MAX else a for i, a in enumerate(argv)
    ]


def first_command(argv: Sequence[str]) -> list[str]:
    """The real command behind env/nice/... and `sh -c "exec llama-server ..."`: the first
    command a `sh -c` script runs (`a; b`, `a && b`, `a | b` end it)."""
    args = capped(argv)
    for _ in range(MAX_DEPTH):  # wrappers of wrappers, but never forever
        if not args:
            return args
        base = os.path.basename(args[0])
        if base in WRAPPERS:
            args = _past_wrapper(args)
            continue
        if _interpreted(args):
            args = args[1:]
            continue
        if base in SHELLS and "-c" in args[1:]:
            script = args[args.index("-c") + 1] if args.index("-c") + 1 < len(args) else ""
            lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            try:
                words = list(lexer)
            except ValueError:
                return args
            end = next((i for i, w in enumerate(words) if w and set(w) <= set(";&|")), len(words))
            words = words[:end]
            args = words[1:] if words[:1] == ["exec"] else words
            continue
        return args
    return args


def _interpreted(args: Sequence[str]) -> bool:
    """`INTERPRETER /path/to/script ...`: a script run through its `#!` line (or by
    hand), whose own path is the command."""
    base = os.path.basename(args[0])
    return (
        len(args) > 1
        and (base in INTERPRETERS or bool(_VERSIONED.match(base)))
        and args[1].startswith("/")
    )


def _past_wrapper(args: list[str]) -> list[str]:
    """What a wrapper runs: past its name, its options, VAR=value and numbers (nice -n 5,
    taskset 0x3, chrt 10)."""
    args = args[1:]
    while args and (args[0].startswith("-") or "=" in args[0] or _NUMERIC.match(args[0])):
        args = args[2:] if args[0] in _TAKES_NAME else args[1:]
    return args


def commands(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[list[str]]:
    """The simple commands a command line runs: itself, or behind env/nice/..., or each
    command of a `sh -c` script (`sleep 60; lms load x`, `a && b`, `a | b`, `until curl
    ...; do ...`), each without a leading shell keyword or variable assignment."""
    out: list[list[str]] = []
    _walk([_expand(a, env) for a in capped(argv)], env, out, 0)
    return out


def _expand(word: str, env: Mapping[str, str] | None) -> str:
    """`$VAR` or `${VAR}` as a whole word, from the environment (systemd and the shell do)."""
    m = _VARIABLE.match(word)
    if m and env:
        value = env.get(m.group(1) or m.group(2))
        if value is not None:
            return value
    return word


def _walk(args: list[str], env: Mapping[str, str] | None, out: list[list[str]], depth: int) -> None:
    for _ in range(MAX_DEPTH):
        while args and (_ASSIGN.match(args[0]) or args[0] in ("exec", *KEYWORDS)):
            args = args[1:]
        if not args:
            return
        base = os.path.basename(args[0])
        if base in WRAPPERS:
            args = _past_wrapper(args)
            continue
        if _interpreted(args):
            args = args[1:]
            continue
        if base in SHELLS:
            script = _script(args)
            if script is not None:
                if depth < MAX_DEPTH:
                    for command in _split(script):
                        _walk([_expand(w, env) for w in command], env, out, depth + 1)
                return
        out.append(args)
        return


def _script(args: Sequence[str]) -> str | None:
    """The script of `sh -c SCRIPT`, `bash -lc SCRIPT`, `bash --login -o pipefail -c SCRIPT`."""
    i = 1
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ("-o", "+o", "-O", "+O"):  # a shell option's name follows
            i += 1
        elif arg == "--" or not arg.startswith(("-", "+")):
            return None
        elif not arg.startswith("--") and "c" in arg[1:]:
            rest = [a for a in args[i:] if not a.startswith("-")]
            return rest[0] if rest else None
    return None


def _split(script: str) -> list[list[str]]:
    """Each simple command of a script; [] if it does not split."""
    text = script[:SCRIPT_MAX].replace("\\\n", " ").replace("\n", ";")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        return []
    out: list[list[str]] = []
    current: list[str] = []
    skip = False
    for word in words:
        if skip:  # the target of a redirection
            skip = False
            continue
        if word and set(word) <= set(";&|()"):
            if current:
                out.append(current)
            current = []
        elif word and set(word) <= set("<>&|") and ("<" in word or ">" in word):
            skip = True
        else:
            current.append(word)
    if current:
        out.append(current)
    return out
