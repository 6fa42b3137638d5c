"""The config parser: what an admin writes, what they are told when it is wrong."""

import re
from pathlib import Path

import pytest

from spark_guard import config as cfg
from spark_guard.core.config import SCHEMA, Config, ConfigError, parse
from spark_guard.core.quantities import parse_duration, parse_size

SHIPPED = Path(__file__).parent.parent / "packaging" / "spark-guard.toml"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 1024**3),
        ("512 MiB", 512 * 1024**2),
        ("1.5G", int(1.5 * 1024**3)),
        ("100", 100),
        (4096, 4096),
        ("2tib", 2 * 1024**4),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["8 parsecs", "", "-1G", "G8", True, 1.5, None, -5])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_decimal_sizes_are_refused_as_systemd_refuses_them():
    """'8GB' was 8 * 1000**3, 7.5 GiB, without a word, while '8G' is 8 GiB; systemd
    refuses GB. So does the guard, saying what to write."""
    with pytest.raises(ValueError, match="write '8G' or '8GiB'"):
        parse_size("8GB")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", 30.0),
        ("250ms", 0.25),
        ("2min", 120.0),
        ("1h", 3600.0),
        (5, 5.0),
        ("1.5", 1.5),
        ("1d", 86400.0),
        ("1h 30min", 5400.0),
        ("1h30min", 5400.0),
        ("2 weeks", 1209600.0),
    ],
)
def test_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["garbage", "1h 30", "", "1x", "-1s", "30s" * 30])
def test_bad_durations_are_refused(bad):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(bad)


def test_empty_file_is_the_built_in_defaults():
    c = parse("", "x.toml")
    assert c == Config()
    assert c.reserve == 8 * 1024**3
    assert c.steady == "guard"


def test_default_reserve_is_max_of_8gib_and_7_percent():
    c = Config()
    spark = 121 * 1024**3
    assert c.reserve_for(spark) == int(spark * 0.07)  # 8.47 GiB > 8 GiB
    assert c.reserve_for(16 * 1024**3) == 8 * 1024**3


def test_values_are_read():
    c = parse(
        '[budget]\nreserve = "12GiB"\nsteady = "warn"\n'
        '[boot]\ngrace = "90s"\nrescue_units = ["sshd.service"]\n'
        '[loaders]\nextra_patterns = ["mistral"]\n'
        '[loaders.footprint]\n"llama-ds4-0731.service" = "115GiB"\n"llama@*.service" = "40G"\n'
        '[protected]\nextra = ["my-precious.service"]\n',
        "x.toml",
    )
    assert c.reserve == 12 * 1024**3 and c.steady == "warn" and c.grace == 90.0
    assert c.rescue_units == ("sshd.service",)
    assert "mistral" in c.loader_patterns and "llama" in c.loader_patterns
    assert c.footprint["llama-ds4-0731.service"] == 115 * 1024**3
    assert "my-precious.service" in c.protected_units and "ssh.service" in c.protected_units


def _error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        parse(text, "/etc/spark-guard.toml")
    return e.value


def test_unknown_key_names_file_key_and_line():
    e = _error('[budget]\nreserve = "8GiB"\n\nreserv_percent = 5\n')
    assert (e.path, e.key, e.line) == ("/etc/spark-guard.toml", "budget.reserv_percent", 4)
    assert str(e).startswith("/etc/spark-guard.toml:4: budget.reserv_percent: unknown key")
    assert "reserve_percent" in str(e)  # the known keys are suggested


def test_unknown_section():
    """A misspelled section is named as a section, on its own line, with the closest one."""
    e = _error('[budget]\nreserve = "8GiB"\n[bugdet]\nsteady = "off"\n')
    assert e.key == "bugdet" and e.line == 3
    assert "unknown section [bugdet]; did you mean [budget]?" in str(e)


def test_wrong_type_names_key_and_line():
    e = _error('[gpu]\nenabled = "yes"\n')
    assert (e.key, e.line) == ("gpu.enabled", 2)
    assert "true or false" in str(e)


def test_bad_size_names_key_and_line():
    e = _error('# comment\n[budget]\n  reserve = "eight gigs"\n')
    assert (e.key, e.line) == ("budget.reserve", 3)
    assert "'eight gigs'" in str(e)


def test_bad_footprint_size_names_the_unit():
    e = _error('[loaders.footprint]\n"a.service" = "1GiB"\n"llama.service" = "lots"\n')
    assert (e.key, e.line) == ("loaders.footprint.llama.service", 3)


def test_enum_choices_are_listed():
    e = _error('[budget]\nsteady = "kill"\n')
    assert "guard, warn, off" in str(e)


def test_toml_syntax_error_has_the_line():
    e = _error('[budget]\nreserve = "8GiB"\nsteady = \n')
    assert e.line == 3 and e.key is None


def test_poll_min_above_max_is_refused():
    e = _error('[poll]\nmin = "5s"\nmax = "1s"\n')
    assert e.key == "poll.min"


def test_missing_named_file_is_an_error_but_missing_default_is_not(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="no such file"):
        cfg.load(tmp_path / "nope.toml")
    monkeypatch.setattr(cfg, "DEFAULT_PATH", tmp_path / "absent.toml")
    assert cfg.load(tmp_path / "absent.toml") == Config()


def test_shipped_file_is_valid_and_documents_every_key():
    text = SHIPPED.read_text()
    assert parse(text, str(SHIPPED)) == Config()
    # Uncommenting every example key gives the built-in defaults back (footprint
    # examples aside), so the file tells the truth about the defaults.
    uncommented = re.sub(r"(?m)^# ([a-z_]+ = .*)$", r"\1", text)
    c = parse(uncommented, "uncommented")
    assert c == Config()
    for section, key in SCHEMA:
        assert re.search(rf"(?m)^# {key} = ", text), f"[{section}] {key} is not documented"
