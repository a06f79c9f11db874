"""What every format's reader shares: the error of a bad row, short descriptions of JSON values, lists
written as JSON text (how a .csv cell holds one)."""

from __future__ import annotations

import json
from typing import Any


class BadRow(Exception):
    """A row that cannot be used: which field, and what is wrong with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field `{field}`: {problem}")


def describe(value: Any) -> str:
    """A short description of a JSON value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value[:30]!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def list_value(value: Any) -> Any:
    """A list written as JSON text (how a .csv cell holds one) is read as the list; anything else is kept."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value
