"""Reading /etc/spark-guard.toml: the file's part of the config (core.config parses it)."""

from __future__ import annotations

import sys
from pathlib import Path

from .core.config import Config, ConfigError, parse

__all__ = ["DEFAULT_PATH", "Config", "ConfigError", "load", "load_for_command"]

DEFAULT_PATH = Path("/etc/spark-guard.toml")


def load(path: Path | str = DEFAULT_PATH) -> Config:
    """Read and parse a config file; a missing default file means built-in defaults."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        if p == DEFAULT_PATH:
            return Config()
        raise ConfigError(str(p), None, None, "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(p), None, None, f"cannot read: {e}") from None
    return parse(text, str(p))


def load_for_command(path: Path | str, *, or_defaults: bool = False) -> Config | None:
    """load() for a command line: the error goes to stderr as one line, and None back; or,
    `or_defaults` (rescue, which must not fail for a typo at 3 a.m., as the daemon does
    not), the built-in defaults, said on the same line."""
    try:
        return load(path)
    except ConfigError as e:
        if or_defaults:
            print(f"spark-guard: {e}; going on with the built-in defaults", file=sys.stderr)
            return Config()
        print(f"spark-guard: {e}", file=sys.stderr)
        return None
