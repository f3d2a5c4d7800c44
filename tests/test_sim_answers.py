"""What a simulated node answers (services/common/engines/sim/answers.py): a JSON value its
schema allows when held to a response format or tools, cut at a stop string as the
embedded engine cuts, the same for the same prompt."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.engines.llama_cpp.text import GeneratedToken, TextStream
from disagg_mesh.server.common.engines.sim.answers import (
    REASONING_SHARE,
    answer,
    answer_tokens,
    json_text,
)
from disagg_mesh.server.common.tools import formats
from disagg_mesh.server.common.tools.calls import Tool
from disagg_mesh.server.common.tools.requests import ToolRequest
from disagg_mesh.server.common.types import (
    FinishReason,
    GenerationEnd,
    ResponseFormat,
    Sampling,
    TextChunk,
)

LIMITS = SchemaLimits()
SEEDS = [1, 7919, 104729, 2**61 - 1, 0xDEADBEEF]
GRADE = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 0, "maximum": 4},
        "feedback": {"type": "string"},
        "issues": {
            "type": "array",
            "items": {"type": "string", "enum": ["naming", "tests", "style"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "passed": {"type": "boolean"},
    },
    "required": ["score", "feedback", "issues"],
}
SCHEMAS: list[dict[str, Any]] = [
    GRADE,
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,5}(x|yz)?$"},
            "when": {"type": "string", "format": "date-time"},
            "short": {"type": "string", "minLength": 3, "maxLength": 5},
            "ratio": {"type": "number"},
        },
        "required": ["id", "when", "short", "ratio"],
    },
    {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/point"}, "kind": {"const": "point"}},
        "required": ["at", "kind"],
    },
    {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
    {"type": ["string", "integer"]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x"}]},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {
        "type": "object",
        "allOf": [
            {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
            {"properties": {"y": {"type": "string", "maxLength": 3}}},
        ],
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_a_structured_answer_is_a_value_its_schema_allows(schema: dict[str, Any]) -> None:
    texts = {json_text(ResponseFormat(json.dumps(schema)), seed, LIMITS) for seed in SEEDS}
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert json_text(ResponseFormat(json.dumps(schema)), SEEDS[0], LIMITS) in texts


def test_answers_are_the_prompts_own() -> None:
    """The same seed gives the same answer; other seeds other choices."""
    fmt = ResponseFormat(json.dumps(GRADE))
    assert json_text(fmt, 42, LIMITS) == json_text(fmt, 42, LIMITS)
    assert len({json_text(fmt, seed, LIMITS) for seed in SEEDS}) > 1
    anything = json.loads(json_text(ResponseFormat(), 42, LIMITS))  # json_object
    assert isinstance(anything, dict) and anything


def test_a_structured_answer_ends_with_its_json_or_at_max_tokens() -> None:
    fmt = ResponseFormat(json.dumps(GRADE))
    whole = answer(42, Sampling(max_tokens=500, response_format=fmt), 4.0, LIMITS)
    text = whole.text(len(whole))
    assert whole.finish is FinishReason.STOP and text == json_text(fmt, 42, LIMITS)
    assert len(whole) == -(-len(text) // 4)  # the profile's 4 bytes a token
    cut = answer(42, Sampling(max_tokens=5, response_format=fmt), 4.0, LIMITS)
    assert cut.finish is FinishReason.LENGTH and len(cut) == 5
    assert cut.text(5) == text[:20]


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_stop_strings_cut_the_answer_as_the_embedded_engine_does(seed: int) -> None:
    """The same tokens through the embedded engine's TextStream: the same text, the same
    count of tokens, the same finish."""
    free = answer(seed, Sampling(max_tokens=300), 4.0, LIMITS)
    words = free.text(len(free)).split()
    stops = (f" {words[8]} {words[9]}", f"{words[20][1:]} ", "never said")
    stopped = answer(seed, Sampling(max_tokens=300, stop=stops), 4.0, LIMITS)
    stream = TextStream(300, stops)
    events: list[TextChunk | GenerationEnd] = []
    for token_id, piece in zip(free.token_ids, free.texts, strict=True):
        events += stream.push(GeneratedToken(token_id, piece.encode(), is_end=False))
        if stream.done:
            break
    end = events[-1]
    assert isinstance(end, GenerationEnd)
    text = "".join(e.text for e in events if isinstance(e, TextChunk))
    assert stopped.text(len(stopped)) == text and len(stopped) == end.completion_tokens
    assert stopped.finish is end.finish_reason is FinishReason.STOP
    assert len(stopped) < min(len(free), answer_tokens(seed))


def test_tools_are_answered_as_a_call_of_one_of_them() -> None:
    """Tools as the generic format holds an answer to them: a call, its arguments allowed
    by the function's parameters."""
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string"}, "timeout_s": {"type": "integer"}},
        "required": ["code"],
    }
    tools = ToolRequest(tools=(Tool("run_tests", "Run the tests", parameters),), choice="required")
    fmt = formats.response_format(formats.ToolFormat.GENERIC, tools)
    assert fmt is not None
    for seed in SEEDS:
        written = json.loads(json_text(fmt, seed, LIMITS))
        call = written["tool_call"]
        assert call["name"] == "run_tests"
        jsonschema.validate(call["arguments"], parameters)


def test_a_sampled_answer_is_its_seeds() -> None:
    """Greedy: the prompt's answer whatever the seed; sampled with a seed: that seed's, the
    same each time, another for another seed."""
    greedy = [
        answer(42, Sampling(max_tokens=40, temperature=0.0, seed=s), 4.0, LIMITS) for s in (1, 2)
    ]
    seeded = [
        answer(42, Sampling(max_tokens=40, temperature=0.8, seed=s), 4.0, LIMITS) for s in (1, 1, 2)
    ]
    unseeded = answer(42, Sampling(max_tokens=40, temperature=0.8), 4.0, LIMITS)
    assert greedy[0] == greedy[1] == unseeded
    assert seeded[0] == seeded[1] != seeded[2] and seeded[0] != greedy[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_thinking_models_answer_reasons_first_then_answers(seed: int) -> None:
    """A model that thinks (gpt-oss): its reasoning is the free answer's first part, its
    share by effort; chunks keep the reasoning apart from the answer, split where it ends;
    a stop string cuts only the answer; a structured answer reasons, then writes its JSON;
    max_tokens counts both."""
    plain = answer(seed, Sampling(max_tokens=600), 4.0, LIMITS)
    for effort, share in REASONING_SHARE.items():
        got = answer(seed, Sampling(max_tokens=600), 4.0, LIMITS, effort)
        assert got.token_ids == plain.token_ids and got.finish is plain.finish
        assert got.reasoning == max(1, round(answer_tokens(seed) * share))
        assert got.text(len(got)) == "".join(plain.texts[got.reasoning :])
        # Any chunking gives the same reasoning and answer, never one chunk of both.
        chunks = [c for i in range(0, len(got), 7) for c in got.chunks(i, min(i + 7, len(got)))]
        assert all(not (c.reasoning and c.text) for c in chunks)
        assert "".join(c.reasoning for c in chunks) == "".join(got.texts[: got.reasoning])
        assert "".join(c.text for c in chunks) == got.text(len(got))
        assert sum(len(c.token_ids) for c in chunks) == len(got)
    medium = answer(seed, Sampling(max_tokens=600), 4.0, LIMITS, "medium")
    said = medium.text(len(medium))
    # A stop string the reasoning says too cuts the answer only.
    thought = medium.texts[: medium.reasoning]
    stop = next(t for t in medium.texts[medium.reasoning :] if t in thought)
    stopped = answer(seed, Sampling(max_tokens=600, stop=(stop,)), 4.0, LIMITS, "medium")
    assert stopped.reasoning == medium.reasoning
    assert stopped.text(len(stopped)) == said[: said.index(stop)]
    assert stopped.finish is FinishReason.STOP
    # Cut inside the reasoning: no answer, finish length.
    cut = answer(seed, Sampling(max_tokens=medium.reasoning - 1 or 1), 4.0, LIMITS, "medium")
    assert cut.text(len(cut)) == "" and cut.finish is FinishReason.LENGTH
    # Held to a schema: the reasoning, then JSON the schema allows.
    fmt = ResponseFormat(json.dumps(GRADE))
    graded = answer(seed, Sampling(max_tokens=4096, response_format=fmt), 4.0, LIMITS, "low")
    assert graded.reasoning == max(1, round(answer_tokens(seed) * REASONING_SHARE["low"]))
    jsonschema.validate(json.loads(graded.text(len(graded))), GRADE)
    assert graded.finish is FinishReason.STOP
