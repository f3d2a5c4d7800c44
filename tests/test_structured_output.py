"""Structured output through the session's mesh of real nodes: Ollama's `format` and
OpenAI's `response_format` through their own client libraries, the gRPC field, the client
and the CLI; every answer validates against its schema, disaggregated and decode_only, and
bad schemas are refused naming the field and the keyword. (Across a migration:
test_migration.py; mixed with free-text streams on one node: test_batching.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import grpc
import httpx
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from disagg_mesh.client import GenerateCall, MeshClient
from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.structured.response_format import check, grammar
from disagg_mesh.server.common.types import ResponseFormat
from tests.conftest import ROOT, Mesh
from tests.streams import collect
from tests.test_http_api import http_url

QWEN = "qwen3-coder:30b"
DECODE_ONLY = "test/decode-only"
QUESTION = (
    "Grade this Python function on correctness and style, each 0 to 4:\n"
    "def add(a, b):\n    return a - b\n"
)


class Criterion(BaseModel):
    criterion: str = Field(max_length=24)
    score: int = Field(ge=0, le=4)
    reason: str = Field(max_length=60)


class Grade(BaseModel):
    criteria: list[Criterion] = Field(min_length=1, max_length=2)


SCHEMA = Grade.model_json_schema()


def test_integer_ranges_become_enums_and_other_bounds_are_refused() -> None:
    class Bounded(BaseModel):
        inclusive: int = Field(ge=0, le=4)
        exclusive: int = Field(gt=0, lt=5)

    schema = Bounded.model_json_schema()
    schema["properties"]["half"] = {"type": "integer", "exclusiveMinimum": 0.5, "maximum": 2.5}
    rules = grammar(ResponseFormat(json.dumps(schema)))
    assert 'inclusive ::= "0" | "1" | "2" | "3" | "4"' in rules
    assert 'exclusive ::= "1" | "2" | "3" | "4"' in rules
    assert 'half ::= "1" | "2"' in rules
    with pytest.raises(InvalidArgument, match="1 to 1024 values"):
        check(ResponseFormat('{"type": "integer", "minimum": 0, "maximum": 5000}'), "f")
    with pytest.raises(InvalidArgument, match=r"the schema `false` \(at properties\.a\) accepts"):
        check(ResponseFormat('{"properties": {"a": false}}'), "f")


@pytest.mark.parametrize("model", [QWEN, DECODE_ONLY])
def test_ollama_format_schema_answers_validate(mesh: Mesh, model: str) -> None:
    client = ollama.Client(host=http_url(mesh))
    for seed in (None, 3):
        options = {"temperature": 0.0 if seed is None else 0.9, "seed": seed, "num_predict": 400}
        reply = client.chat(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            format=SCHEMA,
            options=options,
        )
        assert reply.done_reason == "stop", reply.message.content
        Grade.model_validate_json(reply.message.content or "")


def test_ollama_format_json_gives_a_json_object(mesh: Mesh) -> None:
    client = ollama.Client(host=http_url(mesh))
    pieces = list(
        client.generate(
            model=QWEN,
            prompt="List two colors.",
            format="json",
            stream=True,
            options={"temperature": 0, "num_predict": 300},
        )
    )
    assert pieces[-1].done_reason == "stop"
    assert isinstance(json.loads("".join(p.response or "" for p in pieces)), dict)


def openai_client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("model", [QWEN, DECODE_ONLY])
def test_openai_parse_with_a_pydantic_model(mesh: Mesh, model: str) -> None:
    completion = openai_client(mesh).chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        response_format=Grade,
        temperature=0,
        max_tokens=400,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Grade) and choice.message.parsed.criteria


def test_openai_json_object_streamed_and_cut_at_max_tokens(mesh: Mesh) -> None:
    client = openai_client(mesh)
    chunks = list(
        client.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": "Describe a cat."}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=300,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    # max_tokens before the JSON closes: finish_reason "length", the JSON cut short.
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "grade", "schema": SCHEMA}}
    whole, cut = (
        client.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": QUESTION}],
            response_format=fmt,
            temperature=0,
            max_tokens=n,
        ).choices[0]
        for n in (400, 6)
    )
    assert (whole.finish_reason, cut.finish_reason) == ("stop", "length")
    assert (whole.message.content or "").startswith(cut.message.content or "-")
    with pytest.raises(ValueError):
        json.loads(cut.message.content or "")


BAD = [
    ({"type": "number", "minimum": 0}, "'minimum'"),
    ({"type": "object", "properties": {"a": {"not": {}}}}, "'not' (at properties.a)"),
    ({"type": "string", "format": "email"}, "format 'email'"),
    ({"type": "integer", "minimum": 0}, "both ends"),
    ({"$ref": "#/$defs/Missing"}, "converter refused it"),
]


@pytest.mark.parametrize(("schema", "says"), BAD)
def test_bad_schemas_are_refused_naming_field_and_keyword(
    mesh: Mesh, schema: dict[str, object], says: str
) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=http_url(mesh)).generate(model=QWEN, prompt="x", format=schema)
    assert info.value.status_code == 400
    assert info.value.error.startswith("format: ") and says in info.value.error
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client(mesh).chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "g", "schema": schema}},
        )
    assert bad.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert says in bad.value.message


def test_vllms_guided_json_is_response_formats_schema_and_other_guides_are_refused(
    mesh: Mesh,
) -> None:
    """vLLM's guided_json (the schema, or its JSON text) gives response_format's answer;
    its other extra parameters the mesh does not apply are refused naming them, but for
    the values vLLM takes by default, which clients written for it send unasked."""
    client = openai_client(mesh)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "grade", "schema": SCHEMA}}
    ask: Any = {
        "model": QWEN,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 400,
    }
    expected = client.chat.completions.create(**ask, response_format=fmt)
    for guide in (SCHEMA, json.dumps(SCHEMA)):
        got = client.chat.completions.create(**ask, extra_body={"guided_json": guide})
        assert got.choices[0].message.content == expected.choices[0].message.content
    Grade.model_validate_json(expected.choices[0].message.content or "")
    defaults = {"skip_special_tokens": True, "min_tokens": 0, "length_penalty": 1, "priority": 0}
    ask["max_tokens"] = 2
    assert client.chat.completions.create(**ask, extra_body=defaults).choices
    for extra, field in (
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "number", "minimum": 0}}, "guided_json"),
        ({"guided_choice": ["A", "B"]}, "guided_choice"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"stop_token_ids": [2]}, "stop_token_ids"),
        ({"use_beam_search": 1}, "use_beam_search"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ({"echo": True}, "echo"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**ask, extra_body=extra)
        assert bad.value.body["param"] == field, (extra, bad.value.body)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=QWEN, prompt="x", extra_body={"guided_regex": "a+"})
    assert bad.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_other_bad_formats_are_refused(mesh: Mesh) -> None:
    # (the ollama client itself refuses other strings)
    reply = httpx.post(
        f"{http_url(mesh)}/api/generate", json={"model": QWEN, "prompt": "x", "format": "yaml"}
    )
    assert reply.status_code == 400
    assert reply.json()["error"].startswith('format: must be "json" or a JSON Schema')
    oa = openai_client(mesh)
    xml: Any = {"type": "xml"}
    with pytest.raises(openai.BadRequestError, match=r"response_format\.type: must be"):
        oa.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": "x"}],
            response_format=xml,
        )
    with pytest.raises(openai.BadRequestError, match="ignore_eos: cannot be combined"):
        oa.chat.completions.create(
            model=QWEN,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
            extra_body={"ignore_eos": True},
        )


async def test_grpc_response_format_and_its_errors(
    mesh: Mesh, router: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    def asking(fmt: types_pb2.ResponseFormat) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(
            model=QWEN,
            messages=[types_pb2.ChatMessage(role="user", content=QUESTION)],
            sampling=types_pb2.SamplingParams(max_tokens=400, temperature=0.0, response_format=fmt),
        )

    schema = types_pb2.ResponseFormat(
        type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema=json.dumps(SCHEMA)
    )
    got = await collect(router.Generate(asking(schema)))
    Grade.model_validate_json(got.text)
    assert got.summary.finish_reason == types_pb2.FINISH_REASON_STOP
    for fmt, says in [
        (
            types_pb2.ResponseFormat(
                type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema="{nope"
            ),
            "sampling.response_format.json_schema: is not valid JSON",
        ),
        (
            types_pb2.ResponseFormat(json_schema="{}"),
            "sampling.response_format.type: is unset, but json_schema is given",
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(router.Generate(asking(fmt)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith(says)


def test_client_and_cli_format(mesh: Mesh) -> None:
    with MeshClient(mesh.router_address) as client:
        result = client.generate(
            GenerateCall(
                model=QWEN,
                messages=[{"role": "user", "content": QUESTION}],
                temperature=0,
                max_tokens=400,
                format=SCHEMA,
            )
        )
    Grade.model_validate_json(result.text)
    cli = ["-m", "disagg_mesh.cli", "--router", mesh.router_address, "generate"]
    args = ["--model", QWEN, "--chat", "--temperature", "0", "--max-tokens", "400"]
    out = python(*cli, *args, "--format", json.dumps(SCHEMA), QUESTION)
    assert out.stdout.strip() == result.text.strip()


def python(*args: str) -> subprocess.CompletedProcess[str]:
    """This Python running args in the repository; it must exit 0."""
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=180, check=False
    )
    assert out.returncode == 0, out.stderr
    return out


def test_the_structured_grader_example_prints_a_table(mesh: Mesh) -> None:
    out = python(str(ROOT / "examples/structured_grader.py"), "--host", http_url(mesh))
    header, *rows = out.stdout.splitlines()
    assert header.split()[:3] == ["model", "criterion", "score"]
    models = {row.split()[0] for row in rows}
    assert models == {"qwen3-coder:30b", "gpt-oss:120b"}, out.stdout
