"""Size limits on structured-output specs, checked before anything is compiled.

A grammar's compile time grows steeply with some shapes of spec (a 100k-value enum took
minutes, arrays nested 5k deep tens of seconds), so each spec is measured first, by counts a
plain walk can take, and refused naming the limit it exceeds. The walk is iterative and
bounded by the byte limit, which is checked first.
"""

from __future__ import annotations

import json
from typing import Any

from everystop.config import StructuredOutputConfig
from everystop.sampling_params import StructuredOutput, StructuredOutputError


class SpecOverLimit(StructuredOutputError):
    """A spec over one of StructuredOutputConfig's limits; `limit` is the limit's name."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


def check_spec(so: StructuredOutput, limits: StructuredOutputConfig) -> None:
    """Raise SpecOverLimit when `so` is over a limit (a malformed spec passes: the compiler
    says what is wrong with it)."""
    what = {"json_schema": "the JSON schema", "regex": "the regex", "choice": "the choice list",
            "grammar": "the grammar"}.get(so.kind)
    if what is None:  # json_object: a built-in grammar, nothing to measure
        return
    if so.kind == "regex":
        _at_most(len(so.spec), limits.max_regex_chars, "max_regex_chars",
                 f"{what} has {len(so.spec)} characters")
        return
    num_bytes = len(so.spec.encode("utf-8", "surrogatepass"))
    _at_most(num_bytes, limits.max_spec_bytes, "max_spec_bytes", f"{what} is {num_bytes} bytes")
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError:
            return
        count = len(choices) if isinstance(choices, list) else 0
        _at_most(count, limits.max_choices, "max_choices", f"{what} has {count} entries")
    elif so.kind == "json_schema":
        try:
            schema = json.loads(so.spec)
        except RecursionError:
            raise _over("max_schema_depth", f"{what} nests deeper than max_schema_depth "
                        f"({limits.max_schema_depth})") from None
        except ValueError:
            return
        check_schema(schema, limits, what)


def check_schema(schema: Any, limits: StructuredOutputConfig, what: str) -> None:
    """Nesting depth, enum/const values and property names of a parsed JSON schema."""
    depth_limit = limits.max_schema_depth
    num_values = num_properties = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        if depth > depth_limit:
            raise _over("max_schema_depth", f"{what} nests deeper than max_schema_depth "
                        f"({depth_limit})")
        if isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
            continue
        enum = value.get("enum")
        num_values += (len(enum) if isinstance(enum, list) else 0) + ("const" in value)
        props = value.get("properties")
        num_properties += len(props) if isinstance(props, dict) else 0
        _at_most(num_values, limits.max_enum_values, "max_enum_values",
                 f"{what} has at least {num_values} enum/const values")
        _at_most(num_properties, limits.max_schema_properties, "max_schema_properties",
                 f"{what} has at least {num_properties} properties")
        stack.extend((item, depth + 1) for item in value.values())


def _at_most(value: int, limit: int, name: str, what: str) -> None:
    if value > limit:
        raise _over(name, f"{what}, over {name} ({limit})")


def _over(name: str, message: str) -> SpecOverLimit:
    return SpecOverLimit(name, message)
