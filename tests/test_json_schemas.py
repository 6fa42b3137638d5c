"""Every --json document has a schema (docs/schemas/), and says its `format` first.

Here the documents are the tools' own, on this machine without a manager (the
running guard's status and a dump with loaders are checked in the tests that
have a real manager: test_toolkit_usermanager, test_guard_usermanager)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from lab import synth
from tests.jsonschemas import SCHEMAS, check, schema

TINY = synth.Spec("Tiny", "llama", 2, 256, 4, 4, 64, 64, 2048, 1000, n_ff=512)
TOOLS = ("status", "audit", "doctor", "preflight", "dump")


def test_each_tool_has_one_valid_schema_whose_format_is_its_first_key():
    assert sorted(p.name for p in SCHEMAS.glob("*.schema.json")) == sorted(
        f"{t}.schema.json" for t in TOOLS
    )
    for tool in TOOLS:
        s = schema(tool)
        jsonschema.Draft202012Validator.check_schema(s)
        assert "format" in s["required"] and "const" in s["properties"]["format"]
        assert s["additionalProperties"] is False  # a new field is a schema change


@pytest.mark.parametrize("tool", ["audit", "doctor", "dump", "preflight"])
def test_a_tools_document_matches_its_schema(tool, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[paths]\nsystem_manager = "/nonexistent"\nuser_runtime = "/nonexistent"\n'
        "[containers]\nenabled = false\n"
    )
    args = [str(synth.write(TINY, tmp_path))] if tool == "preflight" else []
    for mode in ("--json", "--json=short"):
        out = subprocess.run(
            [sys.executable, "-m", "spark_guard", tool, *args, mode, "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.stdout.startswith('{\n "format": ' if mode == "--json" else '{"format":')
        doc = json.loads(out.stdout)
        check(doc, tool)
        assert doc["format"] == schema(tool)["properties"]["format"]["const"]


def test_a_document_off_its_schema_is_refused_by_name():
    """The check can fail: a figure under another name, or a string where a number is."""
    doc = {"format": 1, "classification": "no-gpu", "worst": "info", "findings": []}
    check(doc, "doctor")
    with pytest.raises(jsonschema.ValidationError, match="'memory' was unexpected"):
        check({**doc, "memory": {}}, "doctor")
    with pytest.raises(jsonschema.ValidationError, match="is not one of"):
        check({**doc, "worst": "fine"}, "doctor")


def test_the_schemas_are_named_in_the_docs():
    text = (Path(__file__).resolve().parent.parent / "docs" / "json.md").read_text()
    for tool in TOOLS:
        assert f"schemas/{tool}.schema.json" in text
