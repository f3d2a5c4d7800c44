"""What a simulated node answers: text a real node could give for the same request, the same
on every node (picked from the prompt's hash), so tests and simulations can compare texts.

- **Seeds**: greedy, the answer is the prompt's; sampled with a request's `seed`, that
  seed's too (sampled without one, still the prompt's: a simulation stays repeatable).
- **Free text**: words, one a token, ending by itself after 64-511 tokens (from the hash),
  or at max_tokens; `ignore_eos` runs it to max_tokens.
- **Held to a response format or to tools**: one JSON value its schema allows, as a grammar
  would hold a model to it (`json_object`: an object of one string). Each choice the schema
  leaves open (an anyOf branch, an enum value, a number, an array's length, a string's
  words, a pattern's characters) comes from the same hash. The schema is read as the
  embedded engine's grammar reads it (`structured/response_format.enforced_schema`: integer
  ranges as enums). The text is split into tokens of the profile's bytes a token. The
  answer ends with its JSON (or at max_tokens, cut as a real node's would be).
- **Tools**, as the embedded engine serves a model whose chat template has none (the
  generic format, tools/generic.py): the answer is a call of one of them or, unless the
  choice is `required` or named, a reply, held to that format's schema; the node reads the
  calls out of it as the embedded engine does.
- **Stop strings**: the answer ends at the first one, as the embedded engine's
  TextAssembler ends it: the text before it, the token that completed it counted.
- **Reasoning**, for a model that thinks (models.toml's `thinking`: gpt-oss): words apart
  from the answer before it, as harmony's analysis channel comes before the final one, a
  share of a free answer's length by the reasoning effort (REASONING_SHARE). They count
  among the answer's tokens and max_tokens, and stop strings do not apply to them, as with
  the embedded engine's harmony parser.

A string pattern the hash cannot follow (a back-reference, a lookaround the first try
does not satisfy) is answered with plain words instead, which do not match it.
"""

from __future__ import annotations

import importlib
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.structured.response_format import enforced_schema
from disagg_mesh.server.common.types import FinishReason, ResponseFormat, Sampling, TextChunk

VOCAB = 50_000
WORDS = (
    "the function returns a value for every input and the tests cover the edge cases "
    "style is clear names are good a docstring says what it takes and returns correctness "
    "points total fix first loop list empty negative large"
).split()
SHORTEST_ANSWER, LONGEST_ANSWER = 64, 511
# A thinking model's reasoning, as a share of a free answer's length to the same prompt, by
# reasoning effort (medium when a request sets none, as gpt-oss's template and Ollama
# default to). An assumption, not a measured figure: gpt-oss's model card reports longer
# chains of thought at higher effort on its benchmarks, not their length on a grader's
# prompts. A free answer's reasoning is the first part of its tokens (its length as
# without reasoning); a structured answer's comes before its JSON.
REASONING_SHARE = {"low": 0.125, "medium": 0.25, "high": 0.5}
# A schema's string with no length of its own: 8 to 160 characters.
SHORTEST_STRING, LONGEST_STRING = 8, 160
# An array with no bounds of its own: 1 to 3 items; past this depth, its fewest.
FEWEST_ITEMS, MOST_ITEMS, DEEPEST = 1, 3, 6
# `format` values (those the embedded engine's grammars enforce) and a value of each.
FORMAT_VALUES = {
    "date": "2026-11-27",
    "time": "09:30:00Z",
    "date-time": "2026-11-27T09:30:00Z",
    "uuid": "3f2c8a9e-1b7d-4c5e-9a0f-6d2b4e8c1a7f",
    "uuid1": "3f2c8a9e-1b7d-11ee-9a0f-6d2b4e8c1a7f",
    "uuid2": "3f2c8a9e-1b7d-21ee-9a0f-6d2b4e8c1a7f",
    "uuid3": "3f2c8a9e-1b7d-3c5e-9a0f-6d2b4e8c1a7f",
    "uuid4": "3f2c8a9e-1b7d-4c5e-9a0f-6d2b4e8c1a7f",
}
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = 0xFFFFFFFFFFFFFFFF


def token(seed: int, position: int) -> tuple[int, str]:
    """The free-text token at this position of the answer to a prompt of this seed."""
    mixed = (seed ^ (position * _GOLDEN)) & _MASK
    word = WORDS[mixed % len(WORDS)]
    return mixed % VOCAB, f" {word}"


def answer_tokens(seed: int) -> int:
    """How long a free-text answer to this prompt runs before it ends by itself."""
    return SHORTEST_ANSWER + seed % (LONGEST_ANSWER - SHORTEST_ANSWER + 1)


def reasoning_tokens(seed: int, effort: str) -> int:
    """How many tokens a thinking model reasons for before answering this prompt."""
    return max(1, round(answer_tokens(seed) * REASONING_SHARE[effort or "medium"]))


@dataclass(frozen=True)
class Answer:
    """A request's whole answer: its tokens, each token's text as delivered (nothing past a
    stop string), and how it ends. The first `reasoning` tokens are the model's reasoning,
    the rest its answer."""

    token_ids: tuple[int, ...]
    texts: tuple[str, ...]
    finish: FinishReason
    reasoning: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def chunks(self, start: int, end: int) -> list[TextChunk]:
        """Tokens start..end-1 as chunks: the reasoning's, then the answer's (one chunk
        where they are all of one), as the embedded engine's come a token each."""
        split = min(max(start, self.reasoning), end)
        out = [
            TextChunk("", list(self.token_ids[start:split]), "".join(self.texts[start:split])),
            TextChunk("".join(self.texts[split:end]), list(self.token_ids[split:end])),
        ]
        return [c for c in out if c.token_ids] or out[1:]

    def text(self, end: int) -> str:
        """The answer's text in the first `end` tokens (the reasoning left out)."""
        return "".join(self.texts[self.reasoning : end])


def answer(
    seed: int,
    sampling: Sampling,
    bytes_per_token: float,
    limits: SchemaLimits,
    effort: str | None = None,
) -> Answer:
    """The answer to a prompt of this seed under these sampling settings (the node's tools
    already turned into its response format), reasoning first at this effort (None: the
    model does not think). Sampled with a seed of the request's own, the answer is that
    seed's: another seed, another answer (greedy, or sampled without one: the prompt's)."""
    if sampling.temperature > 0 and sampling.seed is not None:
        seed = _Writer(seed ^ (sampling.seed * _GOLDEN)).below(1 << 63)
    fmt = sampling.response_format
    thought = 0 if effort is None else reasoning_tokens(seed, effort)
    if fmt is None:
        natural = sampling.max_tokens if sampling.ignore_eos else answer_tokens(seed)
        tokens = [token(seed, i) for i in range(min(natural, sampling.max_tokens))]
    else:
        tokens = [token(seed, i) for i in range(thought)]
        tokens += _split(json_text(fmt, seed, limits), bytes_per_token)
        natural = len(tokens)
        del tokens[sampling.max_tokens :]
    finish = FinishReason.LENGTH if natural >= sampling.max_tokens else FinishReason.STOP
    thought = min(thought, len(tokens))
    texts = [text for _, text in tokens]
    stopped = _stopped(texts[thought:], sampling.stop)
    if stopped is not None:
        texts, finish = texts[:thought] + stopped, FinishReason.STOP
        del tokens[len(texts) :]
    return Answer(tuple(i for i, _ in tokens), tuple(texts), finish, thought)


def _stopped(texts: list[str], stop: tuple[str, ...]) -> list[str] | None:
    """The tokens' texts up to the one that completes the first stop string, cut before
    it (None: no stop string comes)."""
    if not stop:
        return None
    longest = max(len(s) for s in stop)
    joined = ""
    for k, text in enumerate(texts):
        start = max(0, len(joined) - longest + 1)
        joined += text
        found = [i for i in (joined.find(s, start) for s in stop) if i >= 0]
        if not found:
            continue
        cut, out, at = min(found), [], 0
        for piece in texts[: k + 1]:
            out.append(piece[: max(0, cut - at)])
            at += len(piece)
        return out
    return None


def _split(text: str, bytes_per_token: float) -> list[tuple[int, str]]:
    """A structured answer's text as tokens of about the profile's bytes a token."""
    step = max(1, round(bytes_per_token))
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    return [(zlib.crc32(p.encode()) % VOCAB, p) for p in pieces]


def json_text(fmt: ResponseFormat, seed: int, limits: SchemaLimits) -> str:
    """One JSON value the response format allows, written as a model writes JSON."""
    writer = _Writer(seed)
    if fmt.json_schema is None:
        # Any object: one string as long as a free answer to this prompt would run.
        value: Any = {"answer": writer.words(answer_tokens(seed) * 4)}
    else:
        schema = enforced_schema(fmt.json_schema, limits)
        value = _Schema(schema, writer).value(schema, 0)
    return json.dumps(value, ensure_ascii=False)


class _Writer:
    """The hash's choices, one after another."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK

    def below(self, n: int) -> int:
        """A number in 0..n-1 (splitmix64)."""
        self._state = (self._state + _GOLDEN) & _MASK
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return (z ^ (z >> 31)) % max(n, 1)

    def between(self, low: int, high: int) -> int:
        return low + self.below(high - low + 1)

    def words(self, chars: int) -> str:
        """Words, about `chars` characters."""
        out: list[str] = []
        length = -1
        while length < chars:
            out.append(WORDS[self.below(len(WORDS))])
            length += len(out[-1]) + 1
        return " ".join(out)


class _Schema:
    """A JSON value one (enforced) schema allows."""

    def __init__(self, root: dict[str, Any], writer: _Writer) -> None:
        self._root = root
        self._w = writer

    def value(self, schema: Any, depth: int) -> Any:
        if not isinstance(schema, dict) or not schema:
            return self._string({})
        if "$ref" in schema:
            return self.value(self._resolve(schema["$ref"]), depth + 1)
        for key in ("oneOf", "anyOf"):
            if schema.get(key):
                branches = schema[key]
                return self.value(branches[self._w.below(len(branches))], depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.value({**schema, "type": kind[self._w.below(len(kind))]}, depth)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return schema["enum"][self._w.below(len(schema["enum"]))]
        if kind in (None, "object") and (
            "properties" in schema or schema.get("additionalProperties", True) is not True
        ):
            return self._object(schema, depth)
        if kind in (None, "object") and "allOf" in schema:
            return self._object(self._merged(schema["allOf"]), depth)
        if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            return self._array(schema, depth)
        if kind in (None, "string"):
            return self._string(schema)
        return self._scalar(kind)

    def _scalar(self, kind: str) -> Any:
        if kind == "integer":
            return self._w.below(101)
        if kind == "number":
            return self._w.below(101) + self._w.below(4) / 4
        if kind == "boolean":
            return self._w.below(2) == 1
        if kind == "object":
            return {}
        if kind == "array":
            return []
        return None

    def _resolve(self, ref: str) -> Any:
        node: Any = self._root
        for part in ref.removeprefix("#").strip("/").split("/"):
            if part:
                node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def _merged(self, schemas: list[Any]) -> dict[str, Any]:
        """allOf's schemas as one object schema: their properties and required together."""
        properties: dict[str, Any] = {}
        required: list[str] = []
        for sub in schemas:
            sub = self._resolve(sub["$ref"]) if isinstance(sub, dict) and "$ref" in sub else sub
            if isinstance(sub, dict):
                properties.update(sub.get("properties", {}))
                required += [r for r in sub.get("required", []) if r not in required]
        return {"type": "object", "properties": properties, "required": required}

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        """The required properties, then (above the deepest level) the optional ones, in
        the schema's order, as llama.cpp's converter orders them."""
        properties: dict[str, Any] = schema.get("properties", {})
        required = [k for k in properties if k in schema.get("required", [])]
        optional = [k for k in properties if k not in required] if depth < DEEPEST else []
        out = {k: self.value(properties[k], depth + 1) for k in [*required, *optional]}
        extra = schema.get("additionalProperties", True)
        if not properties and isinstance(extra, dict) and depth < DEEPEST:
            out[self._w.words(4)] = self.value(extra, depth + 1)
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems", [])
        items = schema.get("items")
        if isinstance(items, list):  # the older spelling of prefixItems
            prefix, items = items, None
        low = schema.get("minItems", 0)
        high = schema.get("maxItems", max(low, MOST_ITEMS))
        wanted = (
            low
            if depth >= DEEPEST
            else max(low, min(high, self._w.between(FEWEST_ITEMS, MOST_ITEMS)))
        )
        if items is None:
            wanted = min(max(wanted, len(prefix)), len(prefix))
        out = [self.value(s, depth + 1) for s in prefix[:wanted]]
        out += [self.value(items, depth + 1) for _ in range(wanted - len(out))]
        return out

    def _string(self, schema: dict[str, Any]) -> str:
        if "pattern" in schema:
            matched = _Pattern(self._w).matching(schema["pattern"])
            if matched is not None:
                return matched
        if schema.get("format") in FORMAT_VALUES:
            return FORMAT_VALUES[schema["format"]]
        low: int = schema.get("minLength", 0)
        high: int = schema.get("maxLength", max(low, LONGEST_STRING))
        chars = max(low, min(high, self._w.between(SHORTEST_STRING, LONGEST_STRING)))
        text = self._w.words(chars)[:high]
        return text + "x" * (low - len(text))


class _Pattern:
    """A string matching a regular expression, from Python's own parse of it."""

    def __init__(self, writer: _Writer) -> None:
        self._w = writer
        self._parser: Any = importlib.import_module("re._parser")
        self._constants: Any = importlib.import_module("re._constants")

    def matching(self, pattern: str) -> str | None:
        try:
            text = self._emit(self._parser.parse(pattern))
        except (ValueError, KeyError, IndexError, re.error):
            return None
        return text if re.search(pattern, text) else None

    def _emit(self, parsed: Any) -> str:
        c = self._constants
        out: list[str] = []
        for op, arg in parsed:
            if op is c.LITERAL:
                out.append(chr(arg))
            elif op is c.NOT_LITERAL:
                out.append("a" if arg != ord("a") else "b")
            elif op is c.ANY:
                out.append(WORDS[0][0])
            elif op is c.IN:
                out.append(self._char(arg))
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                low, high, sub = arg
                high = min(high, low + 3) if high != c.MAXREPEAT else low + 3
                out += [self._emit(sub) for _ in range(self._w.between(low, high))]
            elif op is c.SUBPATTERN:
                out.append(self._emit(arg[-1]))
            elif op is c.BRANCH:
                branches = arg[1]
                out.append(self._emit(branches[self._w.below(len(branches))]))
            elif op is c.ATOMIC_GROUP:
                out.append(self._emit(arg))
            elif op in (c.AT, c.ASSERT, c.ASSERT_NOT):
                continue  # anchors and lookarounds: checked at the end
            else:
                raise ValueError(f"pattern part {op} is not followed")
        return "".join(out)

    def _char(self, items: Any) -> str:
        """A character of a class `[...]`."""
        c = self._constants
        if items and items[0][0] is c.NEGATE:
            taken = {chr(v) for op, v in items[1:] if op is c.LITERAL}
            return next(ch for ch in "a0A_ -x" if ch not in taken)
        op, value = items[self._w.below(len(items))]
        if op is c.LITERAL:
            return chr(value)
        if op is c.RANGE:
            return chr(self._w.between(*value))
        if op is c.CATEGORY:
            name = str(value)
            if "NOT" in name:
                return "a" if "WORD" not in name else " "
            return "0" if "DIGIT" in name else " " if "SPACE" in name else "a"
        raise ValueError(f"class part {op} is not followed")
