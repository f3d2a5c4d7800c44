"""Structured output's response format: whether it can be enforced, and the GBNF grammar
llama.cpp's grammar sampler takes for it (shared by the router's checks and the engine's
samplers). The JSON-Schema conversion is llama-cpp-python's (`llama_cpp.llama_grammar`, a port
of llama.cpp's json_schema_to_grammar.py); this module only reads the schema first, so a
keyword the converter would silently leave unenforced is refused by name instead.

One rewrite, because graders ask for it: an integer bounded on both sides by
minimum/maximum (pydantic's `Field(ge=0, le=4)`) becomes the enum of its values, which the
converter does enforce. An unbounded or wide range is refused.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.types import ResponseFormat

# Keywords the converter turns into grammar rules.
ENFORCED = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "pattern",
        "format",
        "minLength",
        "maxLength",
    }
)
# Keywords that say something about a value without constraining it.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4"})
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# llama.cpp's (common/json-schema-to-grammar.cpp) JSON string character.
CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
# An integer range enforced as an enum of at most this many values.
MAX_INTEGER_RANGE = 1024


class _Refused(Exception):
    """Why a schema cannot be enforced (the caller names the field)."""


def check(fmt: ResponseFormat, field: str) -> None:
    """InvalidArgument naming `field` (and the keyword and where it is) unless the format
    converts to a grammar that enforces all of it."""
    grammar(fmt, field)


def grammar(fmt: ResponseFormat, field: str = "sampling.response_format.json_schema") -> str:
    """The GBNF grammar of a response format (root rule "root"); InvalidArgument naming
    `field` when it cannot be enforced."""
    if fmt.json_schema is None:
        return JSON_GBNF  # llama.cpp's grammars/json.gbnf: root is an object
    try:
        return _grammar_for_schema(fmt.json_schema)
    except _Refused as exc:
        raise InvalidArgument(field, str(exc)) from None


@functools.lru_cache(maxsize=64)
def _grammar_for_schema(text: str) -> str:
    """Converted once per schema and process (the door, the router's checks and each node's
    samplers ask for the same one)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise _Refused(f"is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise _Refused(f"must be a JSON Schema object, got {text[:60]!r}")
    schema = _checked(schema, "")
    try:
        rules = str(json_schema_to_gbnf(json.dumps(schema)))
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _Refused(f"llama.cpp's JSON-schema-to-grammar converter refused it: {exc}") from None
    # The port's string characters include control characters, which JSON forbids inside
    # strings (a raw newline there fails json.loads); llama.cpp's own rule leaves them out.
    return re.sub(r"(?m)^char ::= .*$", lambda _: CHAR_RULE, rules)


def _checked(schema: Any, where: str) -> Any:
    """The schema with integer ranges as enums; _Refused for what the converter would not
    enforce."""
    if isinstance(schema, bool):
        if schema:
            return {}
        raise _Refused(f"the schema `false`{_at(where)} accepts nothing")
    if not isinstance(schema, dict):
        raise _Refused(f"expected a schema object{_at(where)}, got {schema!r}")
    out = dict(schema)
    if any(k in schema for k in BOUNDS):
        out = _integer_range(schema, where)
    for key, value in schema.items():
        if key in ANNOTATIONS or key in BOUNDS:
            continue
        if key not in ENFORCED:
            raise _Refused(
                f"keyword {key!r}{_at(where)} is not supported: llama.cpp's "
                "JSON-schema-to-grammar converter would not enforce it",
            )
        path = f"{where}.{key}" if where else key
        if key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise _Refused(f"{path} must be an object")
            out[key] = {k: _checked(v, f"{path}.{k}") for k, v in value.items()}
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") or (
            key == "items" and isinstance(value, list)
        ):
            if not isinstance(value, list):
                raise _Refused(f"{path} must be a list of schemas")
            out[key] = [_checked(v, f"{path}[{i}]") for i, v in enumerate(value)]
        elif key == "items" or (key == "additionalProperties" and not isinstance(value, bool)):
            out[key] = _checked(value, path)
        elif key == "type":
            types = value if isinstance(value, list) else [value]
            unknown = [t for t in types if t not in TYPES]
            if unknown:
                raise _Refused(f"type {unknown[0]!r}{_at(where)} is not a JSON type")
        elif key == "format" and value not in FORMATS:
            raise _Refused(
                f"format {value!r}{_at(where)} is not supported (supported: "
                f"{', '.join(sorted(FORMATS))})",
            )
    return out


def _integer_range(schema: dict[str, Any], where: str) -> dict[str, Any]:
    bound = next(k for k in BOUNDS if k in schema)
    if schema.get("type") != "integer":
        raise _Refused(
            f"keyword {bound!r}{_at(where)} is supported on integers only (as the enum of "
            "the values it allows)",
        )
    low = _bound(schema, "minimum", "exclusiveMinimum", 1)
    high = _bound(schema, "maximum", "exclusiveMaximum", -1)
    if low is None or high is None or not 0 <= high - low < MAX_INTEGER_RANGE:
        raise _Refused(
            f"keyword {bound!r}{_at(where)}: an integer range is supported when both ends are "
            f"set and it holds 1 to {MAX_INTEGER_RANGE} values",
        )
    rest = {k: v for k, v in schema.items() if k not in BOUNDS and k != "type"}
    return {**rest, "enum": list(range(low, high + 1))}


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str, step: int) -> int | None:
    """The lowest (step 1) or highest (step -1) integer the bounds allow."""
    values = []
    for key in (inclusive, exclusive):
        value = schema.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        whole = math.ceil(value) if step > 0 else math.floor(value)
        if key == exclusive and whole == value:
            whole += step
        values.append(whole)
    if not values:
        return None
    return max(values) if step > 0 else min(values)


def _at(where: str) -> str:
    return f" (at {where})" if where else ""
