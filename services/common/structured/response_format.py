"""Structured output's response format: whether it can be enforced, and the GBNF grammar
llama.cpp's grammar sampler takes for it (shared by the router's checks and the engine's
samplers). The JSON-Schema conversion is llama-cpp-python's (`llama_cpp.llama_grammar`, a port
of llama.cpp's json_schema_to_grammar.py); this module only reads the schema first, so a
keyword the converter would silently leave unenforced is refused by name instead, and so is
a schema over the topology's `SchemaLimits` (its size, depth, repetition counts, enums and
patterns, then the grammar's size, rules and nesting), before any native code sees it.

One rewrite, because graders ask for it: an integer bounded on both sides by
minimum/maximum (pydantic's `Field(ge=0, le=4)`) becomes the enum of its values, which the
converter does enforce. An unbounded or wide range is refused.

`checked` runs the whole check off the event loop within the limits' time budget; its
result is cached, so the synchronous `check` and `grammar` that follow cost nothing.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.structured.offload import OverBudget, off_loop
from disagg_mesh.server.common.structured.patterns import pattern_cost
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
DEFAULT_LIMITS = SchemaLimits()
FIELD = "sampling.response_format.json_schema"
COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
# Keywords that constrain a value (the others of ENFORCED only hold schemas).
CONSTRAINTS = ENFORCED - {"$defs", "definitions"}
# What the converter needs beside a keyword to enforce it.
NEEDS = {
    "minLength": 'type "string"',
    "maxLength": 'type "string"',
    "minItems": '"items" or "prefixItems"',
    "maxItems": '"items" or "prefixItems"',
    "required": '"properties"',
}


class _Refused(Exception):
    """Why a schema cannot be enforced (the caller names the field)."""


def check(fmt: ResponseFormat, field: str, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """InvalidArgument naming `field` (and the keyword and where it is) unless the format
    converts, within `limits`, to a grammar that enforces all of it."""
    grammar(fmt, field, limits)


async def checked(fmt: ResponseFormat, field: str, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """check(), off the event loop (a large-stack thread) within limits.check_budget_s: a
    schema that takes longer is refused, and the caller's loop serves others meanwhile."""
    if fmt.json_schema is None:
        return
    try:
        await off_loop(lambda: check(fmt, field, limits), limits.check_budget_s)
    except OverBudget as exc:
        raise InvalidArgument(field, f"checking the schema {exc}") from None


def schema_text(schema: Any, field: str, limits: SchemaLimits = DEFAULT_LIMITS) -> ResponseFormat:
    """The response format of a schema a request gave as parsed JSON (a door's body, a tool's
    parameters): written out as JSON, unless it is surely over limits.max_schema_bytes,
    which is refused naming `field` without writing it out. Writing an enum of 100,000
    values (~1 MB) out took 7.8 ms on the event loop, more than parsing the request's body
    (5.7 ms on a 2-core AMD EPYC): time a plain request waited behind the refusal."""
    size = json_bytes_at_least(schema, limits.max_schema_bytes)
    if size > limits.max_schema_bytes:
        raise InvalidArgument(field, _too_big(f"at least {size}", limits))
    return ResponseFormat(json_schema=json.dumps(schema))


def json_bytes_at_least(value: Any, limit: int) -> int:
    """A lower bound on len(json.dumps(value).encode()), counted until it passes `limit`:
    each string's characters and quotes, each other scalar one byte, each array's and
    object's brackets and ", " separators, each key's quotes and ": ". A container's own
    bytes count before its members are visited, so a container far over the limit costs
    nothing to count."""
    total, pending = 0, [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, dict):
            total += 6 * len(item) or 2  # {}, and for each key "": and ", " but the last
            if total <= limit:
                total += sum(len(str(key)) for key in item)
                pending.extend(item.values())
        elif isinstance(item, list | tuple):
            total += 2 * len(item) or 2  # [], and ", " between members
            if total <= limit:
                pending.extend(item)
        else:
            total += 1
    return total


def grammar(fmt: ResponseFormat, field: str = FIELD, limits: SchemaLimits = DEFAULT_LIMITS) -> str:
    """The GBNF grammar of a response format (root rule "root"); InvalidArgument naming
    `field` when it cannot be enforced within `limits`."""
    if fmt.json_schema is None:
        return JSON_GBNF  # llama.cpp's grammars/json.gbnf: root is an object
    try:
        return _grammar_for_schema(fmt.json_schema, limits)
    except _Refused as exc:
        raise InvalidArgument(field, str(exc)) from None


def enforced_schema(text: str, limits: SchemaLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The schema as its grammar enforces it (an integer range as the enum of its values),
    for an engine that writes a value of it without a grammar (the simulated one);
    InvalidArgument naming the response format as grammar() does."""
    grammar(ResponseFormat(text), FIELD, limits)  # checked whole, and cached
    return _enforced(text, limits)  # the walk the grammar was made from (cached)


@functools.lru_cache(maxsize=64)
def _enforced(text: str, limits: SchemaLimits) -> dict[str, Any]:
    """The schema read once per schema, limits and process: its size, its JSON, then the
    walk (integer ranges as enums); _Refused for what the converter would not enforce."""
    size = len(text.encode())
    if size > limits.max_schema_bytes:
        raise _Refused(_too_big(str(size), limits))
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise _Refused(f"is not valid JSON: {exc}") from None
    except RecursionError:
        raise _Refused(_too_deep("", limits)) from None
    if not isinstance(schema, dict):
        raise _Refused(f"must be a JSON Schema object, got {text[:60]!r}")
    walked: dict[str, Any] = _Walk(limits).checked(schema, "", 0)
    return walked


@functools.lru_cache(maxsize=64)
def _grammar_for_schema(text: str, limits: SchemaLimits) -> str:
    """Converted once per schema, limits and process (the door, the router's checks and each
    node's samplers ask for the same one)."""
    schema = _enforced(text, limits)
    try:
        rules = str(json_schema_to_gbnf(json.dumps(schema)))
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _Refused(f"llama.cpp's JSON-schema-to-grammar converter refused it: {exc}") from None
    # The port's string characters include control characters, which JSON forbids inside
    # strings (a raw newline there fails json.loads); llama.cpp's own rule leaves them out.
    rules = re.sub(r"(?m)^char ::= .*$", lambda _: CHAR_RULE, rules)
    _check_grammar(rules, limits)
    _check_parses(rules)
    return rules


def _check_parses(rules: str) -> None:
    """llama.cpp's own grammar parser takes the grammar (a trial without a vocabulary, as
    llama.cpp's grammar tests parse): what it refuses is refused here by the router, naming
    the field, rather than by a node. Its reason goes to llama.cpp's log."""
    sampler = llama_cpp.llama_sampler_init_grammar(None, rules.encode(), b"root")
    if not sampler:
        raise _Refused(
            "llama.cpp's grammar parser refused the grammar it converts to (most often: "
            "repetitions that multiply past its limit of 2,000 once unrolled)"
        )
    llama_cpp.llama_sampler_free(sampler)


def _check_grammar(rules: str, limits: SchemaLimits) -> None:
    """The converted grammar's size, rules (named ones and groups, each a rule of
    llama.cpp's) and group nesting, against the limits."""
    size = len(rules.encode())
    if size > limits.max_grammar_bytes:
        raise _Refused(
            f"its grammar would be {size} bytes; the limit is {limits.max_grammar_bytes} "
            "(mesh.schema_limits.max_grammar_bytes)"
        )
    named = depth = deepest = groups = 0
    quote: str | None = None
    escaped = False
    for line in rules.splitlines():
        named += "::=" in line
        for c in line:
            if escaped:
                escaped = False
            elif c == "\\" and quote:
                escaped = True
            elif quote:
                quote = None if c == quote else quote
            elif c == '"':
                quote = '"'
            elif c == "[":
                quote = "]"
            elif c == "(":
                groups += 1
                depth += 1
                deepest = max(deepest, depth)
            elif c == ")":
                depth -= 1
    if named + groups > limits.max_grammar_rules:
        raise _Refused(
            f"its grammar would have {named + groups} rules; the limit is "
            f"{limits.max_grammar_rules} (mesh.schema_limits.max_grammar_rules)"
        )
    if deepest > limits.max_grammar_nesting:
        raise _Refused(
            f"its grammar's groups would nest {deepest} deep; the limit is "
            f"{limits.max_grammar_nesting} (mesh.schema_limits.max_grammar_nesting)"
        )


def _too_big(size: str, limits: SchemaLimits) -> str:
    return (
        f"the schema is {size} bytes; the limit is {limits.max_schema_bytes} "
        "(mesh.schema_limits.max_schema_bytes)"
    )


def _too_deep(where: str, limits: SchemaLimits) -> str:
    return (
        f"schemas nest more than {limits.max_depth} deep{_at(where)} (mesh.schema_limits.max_depth)"
    )


class _Walk:
    """One schema's walk: the schema with integer ranges as enums; _Refused for what the
    converter would not enforce or what is over a limit."""

    def __init__(self, limits: SchemaLimits) -> None:
        self.limits = limits

    def checked(self, schema: Any, where: str, depth: int) -> Any:
        if depth > self.limits.max_depth:
            raise _Refused(_too_deep(where, self.limits))
        out = _checked_keywords(schema, where)
        if isinstance(schema, bool):
            return out
        for key, value in schema.items():
            path = f"{where}.{key}" if where else key
            if key in ("properties", "$defs", "definitions"):
                out[key] = {k: self.checked(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems") or (
                key == "items" and isinstance(value, list)
            ):
                out[key] = [self.checked(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
            elif key == "items" or (key == "additionalProperties" and not isinstance(value, bool)):
                out[key] = self.checked(value, path, depth + 1)
            elif key in COUNTS:
                self._count(key, value, where)
            elif key == "enum":
                self._enum(value, where)
            elif key == "pattern":
                self._pattern(value, where)
        if "minItems" in schema and "maxItems" in schema:
            _ordered(schema, "minItems", "maxItems", where)
        if "minLength" in schema and "maxLength" in schema:
            _ordered(schema, "minLength", "maxLength", where)
        if any(k in schema for k in BOUNDS):
            out = _integer_range(out, where, self.limits)
        _check_enforced(out, where)
        return out

    def _count(self, key: str, value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _Refused(
                f"keyword {key!r}{_at(where)} must be a whole number >= 0, got {value!r}"
            )
        if value > self.limits.max_repetition:
            raise _Refused(
                f"keyword {key!r}{_at(where)} is {value}; the limit is "
                f"{self.limits.max_repetition} (mesh.schema_limits.max_repetition)"
            )

    def _enum(self, value: Any, where: str) -> None:
        if not isinstance(value, list) or not value:
            raise _Refused(f"keyword 'enum'{_at(where)} must be a non-empty list")
        if len(value) > self.limits.max_enum_values:
            raise _Refused(
                f"keyword 'enum'{_at(where)} has {len(value)} values; the limit is "
                f"{self.limits.max_enum_values} (mesh.schema_limits.max_enum_values)"
            )

    def _pattern(self, value: Any, where: str) -> None:
        limits = self.limits
        if not isinstance(value, str):
            raise _Refused(f"keyword 'pattern'{_at(where)} must be a string, got {value!r}")
        if len(value) > limits.max_pattern_chars:
            raise _Refused(
                f"keyword 'pattern'{_at(where)} is {len(value)} characters; the limit is "
                f"{limits.max_pattern_chars} (mesh.schema_limits.max_pattern_chars)"
            )
        try:
            cost = pattern_cost(value)
        except RecursionError:
            raise _Refused(f"keyword 'pattern'{_at(where)}: its groups nest too deep") from None
        if cost.largest_bound > limits.max_repetition:
            raise _Refused(
                f"keyword 'pattern'{_at(where)} repeats {cost.largest_bound} times; the limit "
                f"is {limits.max_repetition} (mesh.schema_limits.max_repetition)"
            )
        if cost.nested_repetition > limits.max_nested_repetition:
            raise _Refused(
                f"keyword 'pattern'{_at(where)} nests repetitions whose bounds multiply to "
                f"{cost.nested_repetition}; the limit is {limits.max_nested_repetition} "
                "(mesh.schema_limits.max_nested_repetition)"
            )


def _check_enforced(schema: dict[str, Any], where: str) -> None:
    """_Refused for a keyword the converter would pass over in this schema object: it
    enforces one branch per object, the first that applies in its order ($ref, anyOf/oneOf,
    a list of types, const, enum, properties, allOf, items, pattern, format, lengths), and
    silently ignores whatever else constrains (a pattern's maxLength, lengths without type
    "string", minItems without items, ...)."""
    kind = schema.get("type")
    fmt = schema.get("format")
    used: set[str] = {"type"}
    if "$ref" in schema:
        used, main = {"$ref"}, "$ref"
    elif "oneOf" in schema or "anyOf" in schema:
        main = "oneOf" if schema.get("oneOf") else "anyOf"
        used = {main}
    elif isinstance(kind, list):
        main = "type"
    elif "const" in schema or "enum" in schema:
        main = "const" if "const" in schema else "enum"
        used.add(main)
    elif kind in (None, "object") and (
        "properties" in schema or schema.get("additionalProperties", True) is not True
    ):
        main = "properties" if "properties" in schema else "additionalProperties"
        used |= {"properties", "required", "additionalProperties"}
    elif kind in (None, "object") and "allOf" in schema:
        main = "allOf"
        used.add(main)
    elif kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
        main = "items" if "items" in schema else "prefixItems"
        used |= {"items", "prefixItems", "minItems", "maxItems"}
    elif kind in (None, "string") and "pattern" in schema:
        main = "pattern"
        used.add(main)
    elif kind in (None, "string") and fmt in FORMATS:
        main = "format"
        used.add(main)
    elif kind == "string" and ("minLength" in schema or "maxLength" in schema):
        main = "minLength" if "minLength" in schema else "maxLength"
        used |= {"minLength", "maxLength"}
    else:
        main = ""
    ignored = sorted((set(schema) & CONSTRAINTS) - used)
    if not ignored:
        return
    if not main:
        raise _Refused(
            f"keyword {ignored[0]!r}{_at(where)} would not be enforced: llama.cpp's "
            f"JSON-schema-to-grammar converter applies it only with "
            f"{NEEDS.get(ignored[0], 'other keywords')}",
        )
    raise _Refused(
        f"keyword {ignored[0]!r}{_at(where)} cannot be combined with {main!r}: llama.cpp's "
        f"JSON-schema-to-grammar converter enforces {main!r} and would silently ignore "
        f"{ignored[0]!r}",
    )


def _ordered(schema: dict[str, Any], low: str, high: str, where: str) -> None:
    if schema[low] > schema[high]:
        raise _Refused(
            f"keyword {low!r}{_at(where)} is {schema[low]}, more than {high!r} ({schema[high]})"
        )


def _checked_keywords(schema: Any, where: str) -> dict[str, Any]:
    """A copy of the schema object; _Refused for a keyword the converter would not enforce
    (or a malformed one)."""
    if isinstance(schema, bool):
        if schema:
            return {}
        raise _Refused(f"the schema `false`{_at(where)} accepts nothing")
    if not isinstance(schema, dict):
        raise _Refused(f"expected a schema object{_at(where)}, got {schema!r}")
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
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if not isinstance(value, list):
                raise _Refused(f"{path} must be a list of schemas")
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
    return dict(schema)


def _integer_range(schema: dict[str, Any], where: str, limits: SchemaLimits) -> dict[str, Any]:
    bound = next(k for k in BOUNDS if k in schema)
    if schema.get("type") != "integer":
        raise _Refused(
            f"keyword {bound!r}{_at(where)} is supported on integers only (as the enum of "
            "the values it allows)",
        )
    low = _bound(schema, "minimum", "exclusiveMinimum", 1)
    high = _bound(schema, "maximum", "exclusiveMaximum", -1)
    if low is None or high is None or not 0 <= high - low < limits.max_enum_values:
        raise _Refused(
            f"keyword {bound!r}{_at(where)}: an integer range is supported when both ends are "
            f"set and it holds 1 to {limits.max_enum_values} values "
            "(mesh.schema_limits.max_enum_values)",
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
