"""Tool calls through the session's mesh of real nodes (SmolLM2, whose chat template has no
tools: the generic format, tools in a system message and the answer held to a JSON grammar),
with the real `openai` and `ollama` clients, the gRPC client and the CLI: named and required
calls validate against their function's schema, greedy and seeded, disaggregated and
decode_only; streamed pieces put together equal the whole answer; a full loop (call, tool
result, answer); bad inputs get a 400 naming the field. Then Qwen2.5's and Qwen3-Coder's
real templates on Qwen's real vocabulary (tiny random qwen3moe files): the prompt as the
reference renders it, and calls held to each format. (The parsers: test_tool_parsers.py.)"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from disagg_mesh.client import MeshClient
from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.engines.llama_cpp.model import LlamaModel
from disagg_mesh.server.common.runtime.processes import free_port
from disagg_mesh.server.common.tools.calls import ToolCall
from disagg_mesh.server.common.tools.formats import ToolFormat, tool_format, turns
from disagg_mesh.server.common.tools.requests import read_tools
from disagg_mesh.server.common.types import ChatTurn, Prompt
from tests.conftest import ROOT, Mesh, engine_node, route, router_node, running_mesh
from tests.streams import collect, streamed_calls
from tests.test_http_api import http_url
from tests.tiny_models import (
    QWEN_TOOL_CALL,
    QWEN_TOOL_RESPONSE,
    llama_cpp_template,
    render_as_transformers,
    write_qwen3moe,
)

QWEN = "qwen3-coder:30b"
GPT_OSS = "gpt-oss:120b"  # the session's mesh serves it with SmolLM2 too: the generic format
DECODE_ONLY = "test/decode-only"

RUN_TESTS = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the student's unit tests on their code and report the results.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "maxLength": 80},
                "timeout_s": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["code", "timeout_s"],
        },
    },
}
RUBRIC = {
    "type": "function",
    "function": {
        "name": "look_up_rubric",
        "description": "The grading rubric of an assignment.",
        "parameters": {
            "type": "object",
            "properties": {"assignment": {"type": "string", "enum": ["hw1", "hw2", "hw3"]}},
            "required": ["assignment"],
        },
    },
}
TOOLS: list[Any] = [RUN_TESTS, RUBRIC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = "Grade this homework (hw2):\ndef add(a, b):\n    return a - b\n"
MESSAGES: list[Any] = [{"role": "user", "content": QUESTION}]


def openai_client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="x", max_retries=0)


def function_calls(message: Any) -> list[ChatCompletionMessageFunctionToolCall]:
    calls = list(message.tool_calls or [])
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls), calls
    return calls


def valid_call(name: str, arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return dict(value)


@pytest.mark.parametrize("model", [QWEN, GPT_OSS, DECODE_ONLY])
def test_a_named_function_is_called_with_arguments_its_schema_accepts(
    mesh: Mesh, model: str
) -> None:
    client = openai_client(mesh)
    for seed in (None, 7):
        answer = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "run_tests"}},
            temperature=0.0 if seed is None else 0.9,
            seed=seed,
            max_tokens=200,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = function_calls(choice.message)
        assert [c.function.name for c in calls] == ["run_tests"] * len(calls) and calls
        for call in calls:
            assert call.id.startswith("call_") and call.type == "function"
            valid_call(call.function.name, call.function.arguments)
        assert choice.message.content is None
        method = (answer.model_extra or {})["disagg"]["method"]
        assert method == ("decode_only" if model == DECODE_ONLY else "disaggregated")


def test_required_calls_one_of_the_tools_and_none_leaves_text(mesh: Mesh) -> None:
    client = openai_client(mesh)
    answer = client.chat.completions.create(
        model=QWEN,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.0,
        max_tokens=200,
    )
    calls = function_calls(answer.choices[0].message)
    assert calls and answer.choices[0].finish_reason == "tool_calls"
    for call in calls:
        valid_call(call.function.name, call.function.arguments)
    free = client.chat.completions.create(
        model=QWEN,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        temperature=0.0,
        max_tokens=24,
    )
    assert free.choices[0].message.tool_calls is None
    assert free.choices[0].message.content


# Greedy, with a call of one of the tools required.
REQUIRED_CALL: dict[str, Any] = {
    "model": QWEN,
    "messages": MESSAGES,
    "tools": TOOLS,
    "tool_choice": "required",
    "temperature": 0.0,
    "max_tokens": 200,
}


def test_log_probabilities_with_tools_cover_every_token_a_calls_too(mesh: Mesh) -> None:
    """With tools, every generated token has its log probability, a call's too (as vLLM and
    llama-server return them): whole and streamed, one per completion token, the call
    parsed as without them."""
    client: Any = openai_client(mesh)
    request: dict[str, Any] = {**REQUIRED_CALL, "logprobs": True, "top_logprobs": 1}
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    calls = function_calls(choice.message)
    assert calls and choice.finish_reason == "tool_calls"
    entries = choice.logprobs.content
    assert len(entries) == whole.usage.completion_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 1 for e in entries)
    assert calls[0].function.name in "".join(e.token for e in entries)  # as the model wrote it
    unscored = function_calls(client.chat.completions.create(**REQUIRED_CALL).choices[0].message)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in unscored
    ]
    streamed = 0
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += len(chunk.choices[0].logprobs.content)
    assert streamed == len(entries)


def test_streamed_call_pieces_put_together_are_the_whole_answer(mesh: Mesh) -> None:
    client: Any = openai_client(mesh)
    request = REQUIRED_CALL
    whole = client.chat.completions.create(**request)
    calls, finish = streamed_calls(client.chat.completions.create(**request, stream=True))
    expected = [
        (c.function.name, c.function.arguments) for c in function_calls(whole.choices[0].message)
    ]
    assert [(c.name, c.arguments) for c in calls] == expected and expected
    assert finish == "tool_calls"


def test_a_whole_tool_loop_call_result_answer(mesh: Mesh) -> None:
    """The model calls run_tests, the caller runs them and sends the result back with the
    assistant's call, and the model writes its answer (auto: a call or text, either
    parsed; none: text)."""
    client = openai_client(mesh)
    first = client.chat.completions.create(
        model=QWEN,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "run_tests"}},
        temperature=0.0,
        max_tokens=200,
    )
    call = function_calls(first.choices[0].message)[0]
    valid_call(call.function.name, call.function.arguments)
    history: list[Any] = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "1 passed, 2 failed: add(1, 2) == -1"},
    ]
    for choice in ("auto", "none"):
        final = client.chat.completions.create(
            model=QWEN,
            messages=history,
            tools=TOOLS,
            tool_choice=choice,
            temperature=0.0,
            max_tokens=120,
        )
        message = final.choices[0].message
        if message.tool_calls:
            assert choice == "auto" and final.choices[0].finish_reason == "tool_calls"
            for c in function_calls(message):
                valid_call(c.function.name, c.function.arguments)
        else:
            assert message.content, final
            assert final.choices[0].finish_reason in ("stop", "length")


def test_ollama_chat_tools_answer_as_ollama_does(mesh: Mesh) -> None:
    """Ollama's `tools` on /api/chat: a reply whose calls carry their arguments as an object
    (or text), streamed as Ollama streams them (each call whole); the same greedy answer
    both ways; a tool message answers the call by name."""
    client = ollama.Client(host=http_url(mesh))
    options = {"temperature": 0, "num_predict": 160}
    whole = client.chat(model=QWEN, messages=MESSAGES, tools=TOOLS, options=options)
    streamed_calls: list[Any] = []
    text = ""
    last = None
    for part in client.chat(
        model=QWEN, messages=MESSAGES, tools=TOOLS, options=options, stream=True
    ):
        streamed_calls += part.message.tool_calls or []
        text += part.message.content or ""
        last = part
    assert last is not None and last.done and last.done_reason in ("stop", "length")
    calls = whole.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        (c.function.name, dict(c.function.arguments)) for c in streamed_calls
    ]
    assert text == (whole.message.content or "")
    for c in calls:
        jsonschema.validate(dict(c.function.arguments), SCHEMAS[c.function.name])
    # The loop, Ollama's way: the assistant's calls, then a tool message naming the tool.
    answered = client.chat(
        model=QWEN,
        messages=[
            *MESSAGES,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "look_up_rubric", "arguments": {"assignment": "hw2"}}}
                ],
            },
            {"role": "tool", "tool_name": "look_up_rubric", "content": "correctness 0-4"},
        ],
        options={"temperature": 0, "num_predict": 24},
    )
    assert answered.message.content


def test_the_grpc_client_and_the_cli_take_tools_and_give_calls(mesh: Mesh, tmp_path: Any) -> None:
    with MeshClient(mesh.router_address, timeout=120) as client:
        result = client.generate(
            QWEN,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="look_up_rubric",
            max_tokens=120,
            temperature=0.0,
        )
    assert result.metrics.finish_reason == "tool_calls"
    assert [c.name for c in result.tool_calls] == ["look_up_rubric"] * len(result.tool_calls)
    for call in result.tool_calls:
        valid_call(call.name, call.arguments)
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS))
    out = subprocess.run(
        [sys.executable, "-m", "disagg_mesh.cli", "--router", mesh.router_address, "generate",
         "--model", QWEN, "--tools", str(tools_file), "--tool-choice", "look_up_rubric",
         "--temperature", "0", "--max-tokens", "120", "--json", QUESTION],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert [c["name"] for c in printed["tool_calls"]] == [c.name for c in result.tool_calls]
    assert [c["arguments"] for c in printed["tool_calls"]] == [
        c.parsed_arguments() for c in result.tool_calls
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0]"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "grade",
                            "parameters": {
                                "type": "object",
                                "properties": {"marks": {"type": "array", "minItems": 5000}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "call_x", "content": "3 passed"},
                ]
            },
            "messages[1]",
        ),
    ],
)
def test_bad_tool_inputs_are_400_naming_the_field(
    mesh: Mesh, body: dict[str, Any], field: str
) -> None:
    request = {"model": QWEN, "messages": MESSAGES, "max_tokens": 8, **body}
    reply = httpx.post(f"{http_url(mesh)}/v1/chat/completions", json=request, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"] or "").startswith(field), error
    assert error["type"] == "invalid_request_error"
    ollama_body = {"model": QWEN, "messages": MESSAGES, "stream": False, **body}
    ollama_body.pop("tool_choice", None)
    if ollama_body.get("tools") == TOOLS or set(body) == {"tool_choice"}:
        return  # Ollama names no function to call
    if "messages" in body:  # Ollama's tool messages name the tool, not a call id
        ollama_body["messages"] = [body["messages"][0], {"role": "tool", "content": "3"}]
    reply = httpx.post(f"{http_url(mesh)}/api/chat", json=ollama_body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert field.split(".")[0].split("[")[0] in reply.json()["error"]


def test_the_format_follows_the_template_and_generic_turns_carry_the_calls() -> None:
    assert tool_format("{{ '<tool_call>' }}", harmony=False) is ToolFormat.HERMES
    assert tool_format("<function=x><parameter=y>", harmony=False) is ToolFormat.QWEN3_CODER
    assert tool_format("anything", harmony=True) is ToolFormat.HARMONY
    assert tool_format("<|im_start|>", harmony=False) is ToolFormat.GENERIC
    tools = read_tools(TOOLS, "required")
    assert tools is not None
    rendered = turns(
        (
            ChatTurn("user", "grade"),
            ChatTurn("assistant", "", (ToolCall("call_1", "run_tests", '{"code": "x"}'),)),
            ChatTurn("tool", "ok", tool_call_id="call_1"),
        ),
        ToolFormat.GENERIC,
        tools,
    )
    assert rendered[0]["role"] == "system" and "run_tests" in rendered[0]["content"]
    assert json.loads(rendered[2]["content"]) == {
        "tool_call": {"name": "run_tests", "arguments": {"code": "x"}}
    }
    assert rendered[3]["role"] == "user"
    assert json.loads(rendered[3]["content"])["tool_response"]["tool_call_id"] == "call_1"


def test_the_tool_grader_example_calls_runs_the_tests_and_grades(mesh: Mesh) -> None:
    """examples/tool_grader.py: a forced run_tests call, the tests run, the grade written."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples/tool_grader.py"), "--host", http_url(mesh)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith('call: run_tests({"code": '), out.stdout
    assert "grade: " in out.stdout
    spec = importlib.util.spec_from_file_location("tool_grader", ROOT / "examples/tool_grader.py")
    assert spec is not None and spec.loader is not None
    example: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.run_tests(example.SAMPLE)
    assert result.startswith("3 of 4 passed") and "FAIL average([]) ZeroDivisionError" in result


# -- real Qwen templates on the real Qwen vocabulary -------------------------------------------

# The templates of the real models, as llama.cpp keeps them (models/templates/): Qwen2.5's
# writes its calls Hermes' way (<tool_call>{"name", "arguments"}</tool_call>), Qwen3-Coder's
# in its XML. The tiny random qwen3moe files carry them and Qwen3's vocabulary, in which
# <tool_call>, </tool_call> and <tool_response> are tokens of their own.
HERMES_TEMPLATE = "Qwen-Qwen2.5-7B-Instruct"
XML_TEMPLATE = "Qwen3-Coder"
HERMES = "test/hermes"
HERMES_ALONE = "test/hermes-decode-only"


def template_mesh(
    factory: pytest.TempPathFactory, template: str, split: str, alone: str
) -> Iterator[tuple[str, str]]:
    """A tiny random qwen3moe with this real template and Qwen's vocabulary behind a prefill
    and a decode node: the routes `split` (disaggregated) and `alone` (decode_only); the
    HTTP door's URL and the model's path."""
    folder = factory.mktemp("template")
    chat_template = llama_cpp_template(template)
    path = str(write_qwen3moe(folder / "tiny.gguf", chat_template, vocabulary="qwen"))
    parts = [
        router_node(http_port=free_port()),
        engine_node("prefill", "prefill", 1, model=path),
        engine_node("decode", "decode", 1, model=path),
        route(split, ["prefill"], ["decode"], chain=["disaggregated"]),
        route(alone, [], ["decode"], chain=["decode_only"]),
    ]
    with running_mesh(folder, parts) as processes:
        router = processes.topology.router
        yield f"http://{router.host}:{router.http_port}", path


def named_call(url: str, args: dict[str, Any]) -> tuple[str, str]:
    """The one call a named function's request gets (name, arguments), checked equal to
    the pieces of the same request streamed."""
    client: Any = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
    (call,) = function_calls(whole.choices[0].message)
    (streamed,), _ = streamed_calls(client.chat.completions.create(**args, stream=True))
    assert (streamed.name, streamed.arguments) == (call.function.name, call.function.arguments)
    return call.function.name, call.function.arguments


@pytest.fixture(scope="module")
def hermes_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Qwen2.5's template, which writes <tool_call>: the Hermes format."""
    yield from template_mesh(tmp_path_factory, HERMES_TEMPLATE, HERMES, HERMES_ALONE)


@pytest.mark.parametrize("model", [HERMES, HERMES_ALONE])
def test_a_hermes_template_renders_the_tools_and_a_named_call_is_held_to_its_format(
    hermes_mesh: tuple[str, str], model: str
) -> None:
    """The tools go to the template (its `tools`), a named function's call is
    `<tool_call>{"name", "arguments"}</tool_call>` held by a grammar (a random model writes
    it), parsed into tool_calls, streamed pieces = whole; auto leaves the random model free
    (its answer is text, or calls that parse)."""
    args: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "look_up_rubric"}},
        "temperature": 0,
        "max_tokens": 120,
    }
    name, arguments = named_call(hermes_mesh[0], args)
    assert name == "look_up_rubric" and valid_call(name, arguments)["assignment"]
    client: Any = openai.OpenAI(base_url=f"{hermes_mesh[0]}/v1", api_key="x", max_retries=0)
    free = client.chat.completions.create(**{**args, "tool_choice": "auto", "max_tokens": 24})
    for c in function_calls(free.choices[0].message):
        assert c.function.name in SCHEMAS
    assert free.choices[0].message.content is not None or free.choices[0].message.tool_calls


def test_parallel_calls_held_by_the_hermes_grammar_each_validate_and_stream_whole(
    hermes_mesh: tuple[str, str],
) -> None:
    """`required` with parallel_tool_calls: the grammar allows several <tool_call> blocks,
    each of one of the tools with arguments its schema accepts; each call streams under its
    own index and id, its pieces put together equal to the whole answer's."""
    client: Any = openai.OpenAI(base_url=f"{hermes_mesh[0]}/v1", api_key="x", max_retries=0)
    args: dict[str, Any] = {
        "model": HERMES,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": True,
        "temperature": 0,
        "max_tokens": 160,
    }
    whole = client.chat.completions.create(**args)
    calls = function_calls(whole.choices[0].message)
    assert calls and whole.choices[0].finish_reason in ("tool_calls", "length")
    for call in calls:
        valid_call(call.function.name, call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)
    streamed, _ = streamed_calls(client.chat.completions.create(**args, stream=True))
    assert [(c.name, c.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert len({c.id for c in streamed}) == len(streamed)


# A tool loop in OpenAI's shape; the call's code has characters JSON and XML escape.
LOOP_CALL = {"code": "x = '<b>' if 1 < 2 else \"é\"", "timeout_s": 5}
LOOP: list[Any] = [
    {"role": "system", "content": "You grade Python homework."},
    {"role": "user", "content": QUESTION},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "run_tests", "arguments": json.dumps(LOOP_CALL)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "3 of 4 passed"},
]


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, "Qwen-Qwen3-0.6B", XML_TEMPLATE])
def test_a_real_qwen_template_gets_the_tools_and_the_loop_as_transformers_renders_them(
    tmp_path: Path, template: str
) -> None:
    """A tool loop's prompt as the mesh tokenizes it = the real template rendered by the
    reference (the calls' arguments objects, the tools in OpenAI's shape), in Qwen's tokens,
    where <tool_call> and <tool_response> are one token each."""
    chat_template = llama_cpp_template(template)
    path = write_qwen3moe(tmp_path / "tiny.gguf", chat_template, vocabulary="qwen")
    model = LlamaModel(path)
    try:
        expected_format = ToolFormat.QWEN3_CODER if template == XML_TEMPLATE else ToolFormat.HERMES
        assert model.tool_format is expected_format
        conversation = tuple(
            ChatTurn(
                m["role"],
                m["content"],
                tuple(
                    ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                    for c in m.get("tool_calls", [])
                ),
                tool_call_id=m.get("tool_call_id", ""),
            )
            for m in LOOP
        )
        tokens = model.tokenize(Prompt(messages=conversation), 4096, read_tools(TOOLS))
        reference = [
            {
                **m,
                "tool_calls": [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": json.loads(c["function"]["arguments"]),
                        },
                    }
                    for c in m["tool_calls"]
                ],
            }
            if "tool_calls" in m
            else m
            for m in LOOP
        ]
        expected = render_as_transformers(chat_template, reference, TOOLS)
        assert tokens == model.tokenize_text(expected)
    finally:
        model.close()
    # The tools' block shows both calls' names; the loop's call and its result.
    assert tokens.count(QWEN_TOOL_CALL) >= 2 and tokens.count(QWEN_TOOL_RESPONSE) == 1
    assert "look_up_rubric" in expected and "3 of 4 passed" in expected


# -- Qwen3-Coder's template: XML calls ---------------------------------------------------------

XML = "test/qwen3-coder-xml"
XML_ALONE = "test/qwen3-coder-xml-decode-only"
GRADE: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "record_grade",
        "description": "Record a grade.",
        "parameters": {
            "type": "object",
            "properties": {
                "assignment": {"type": "string", "enum": ["hw1", "hw2"]},
                "points": {"type": "integer", "minimum": 0, "maximum": 9},
                "passed": {"type": "boolean"},
            },
            "required": ["assignment", "points", "passed"],
        },
    },
}


@pytest.fixture(scope="module")
def xml_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    yield from template_mesh(tmp_path_factory, XML_TEMPLATE, XML, XML_ALONE)


@pytest.mark.parametrize("model", [XML, XML_ALONE])
def test_a_qwen3_coder_template_gets_a_named_call_in_its_xml_held_by_a_grammar(
    xml_mesh: tuple[str, str], model: str
) -> None:
    """A named function's call is Qwen3-Coder's XML, held by a grammar (an enum's value one
    of its values, an integer's and a boolean's JSON their schema allows), parsed into
    arguments typed by the schema; streamed pieces = whole."""
    args: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "tools": [GRADE, RUBRIC],
        "tool_choice": {"type": "function", "function": {"name": "record_grade"}},
        "temperature": 0,
        "max_tokens": 120,
    }
    name, arguments = named_call(xml_mesh[0], args)
    assert name == "record_grade"
    jsonschema.validate(json.loads(arguments), GRADE["function"]["parameters"])
    model_file = LlamaModel(Path(xml_mesh[1]))
    try:
        assert model_file.tool_format is ToolFormat.QWEN3_CODER
    finally:
        model_file.close()


async def test_calls_held_by_a_grammar_beside_free_streams_in_one_batch_are_as_alone(
    mesh: Mesh,
) -> None:
    """Two named calls and two free answers at once on one decode node (decode_only): each
    the same as alone (a slot's grammar is its own; batched greedy = alone)."""
    client = openai.AsyncOpenAI(base_url=f"{http_url(mesh)}/v1", api_key="x", max_retries=0)
    named: dict[str, Any] = {
        "model": DECODE_ONLY,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "run_tests"}},
        "temperature": 0,
        "max_tokens": 120,
    }
    free: dict[str, Any] = {"model": DECODE_ONLY, "temperature": 0, "max_tokens": 40}
    questions = [
        [{"role": "user", "content": f"Grade submission {i}: def f(x): return x * {i}"}]
        for i in range(2)
    ]

    async def answer(kwargs: dict[str, Any], messages: Any) -> tuple[str, list[Any]]:
        got = await client.chat.completions.create(messages=messages, **kwargs)
        message = got.choices[0].message
        return message.content or "", [
            (c.function.name, c.function.arguments) for c in function_calls(message)
        ]

    jobs = [(named, q) for q in questions] + [(free, q) for q in questions]
    alone = [await answer(kwargs, q) for kwargs, q in jobs]
    together = await asyncio.gather(*(answer(kwargs, q) for kwargs, q in jobs))
    assert list(together) == alone
    assert all(calls for _, calls in alone[:2]) and all(text for text, _ in alone[2:])


async def test_grpc_names_the_toolsets_own_fields(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    def call(tools: types_pb2.ToolSet) -> Any:
        return router.Generate(
            router_pb2.GenerateRequest(
                model=QWEN,
                messages=[types_pb2.ChatMessage(role="user", content="hi")],
                sampling=types_pb2.SamplingParams(max_tokens=4, tools=tools),
            )
        )

    good = types_pb2.ToolDefinition(name="run_tests")
    for tools, field in (
        (
            types_pb2.ToolSet(
                definitions=[good], choice=types_pb2.TOOL_CHOICE_FUNCTION, function_name="x"
            ),
            "sampling.tools.function_name: 'x' is not one of the tools",
        ),
        (
            types_pb2.ToolSet(definitions=[types_pb2.ToolDefinition(name="has space")]),
            "sampling.tools.definitions[0].name:",
        ),
        (
            types_pb2.ToolSet(
                definitions=[types_pb2.ToolDefinition(name="f", parameters_json_schema="{")]
            ),
            "sampling.tools.definitions[0].parameters_json_schema: is not JSON",
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(call(tools))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith(field), refused.value.details()
