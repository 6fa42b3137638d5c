"""The --json documents' schemas (docs/schemas/), for the tests that read a document."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"


def schema(name: str) -> dict[str, Any]:
    return dict(json.loads((SCHEMAS / f"{name}.schema.json").read_text()))


def check(doc: Any, name: str) -> None:
    """Raise jsonschema.ValidationError naming the path of the first field off its schema."""
    jsonschema.Draft202012Validator(schema(name)).validate(doc)
