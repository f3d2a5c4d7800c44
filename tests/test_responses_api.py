"""OpenAI's Responses API on the router's door (POST /v1/responses, without state, as
Ollama serves it), through the real `openai` client against the session's mesh of real
nodes: the same answer as /v1/chat/completions, whole and streamed (the SDK's own stream
helper checks the events' order and identities), structured output parsed into a pydantic
model, function calls and a full tool loop, and bad requests answered 400 naming the
field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.conftest import Mesh
from tests.test_http_api import QWEN, http_url, openai_client
from tests.test_tools import DECODE_ONLY, QUESTION, RUN_TESTS, SCHEMAS

SYSTEM = "You answer in one sentence."
ASK = "What is a list in Python?"
# The API's flat function: chat's nested one, unnested.
FUNCTION: Any = RUN_TESTS["function"]
RUN_TESTS_FLAT: Any = {"type": "function", **FUNCTION}


class Grade(BaseModel):
    points: int
    passed: bool


@pytest.mark.parametrize("model", [QWEN, DECODE_ONLY])
def test_a_response_is_the_chat_completions_answer_whole_and_streamed(
    mesh: Mesh, model: str
) -> None:
    client = openai_client(mesh)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
        max_tokens=20,
        temperature=0,
    )
    text = chat.choices[0].message.content or ""
    cut = chat.choices[0].finish_reason == "length"
    whole = client.responses.create(
        model=model, instructions=SYSTEM, input=ASK, max_output_tokens=20, temperature=0
    )
    assert whole.output_text == text and text
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == ("incomplete" if cut else "completed")
    if cut:
        assert whole.incomplete_details is not None
        assert whole.incomplete_details.reason == "max_output_tokens"
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == whole.status  # the item cut by max_output_tokens, or not
    assert chat.usage is not None and whole.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == chat.usage.total_tokens
    assert whole.instructions == SYSTEM and whole.max_output_tokens == 20
    method = (whole.model_extra or {})["disagg"]["method"]
    assert method == ("decode_only" if model == DECODE_ONLY else "disaggregated")
    # The SDK's stream helper puts the events together, and refuses any out of order (its
    # final response is a completed one's; an incomplete one is the last event's).
    with client.responses.stream(
        model=model, instructions=SYSTEM, input=ASK, max_output_tokens=20, temperature=0
    ) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    final = last.response
    assert final.output_text == text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if cut else "response.completed",
    ]
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens


def test_a_conversation_given_as_items_is_the_chats_answer(mesh: Mesh) -> None:
    """Input items (messages as text parts, an assistant's earlier answer) render as the
    same chat messages do."""
    client = openai_client(mesh)
    messages: Any = [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": ASK},
    ]
    chat = client.chat.completions.create(
        model=QWEN, messages=messages, max_tokens=12, temperature=0
    )
    items: Any = [
        {"type": "message", "role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello! How can I help?"}],
        },
        {"role": "user", "content": ASK},
    ]
    got = client.responses.create(model=QWEN, input=items, max_output_tokens=12, temperature=0)
    assert got.output_text == chat.choices[0].message.content
    assert got.usage is not None and chat.usage is not None
    assert got.usage.input_tokens == chat.usage.prompt_tokens


def test_structured_output_parses_into_a_pydantic_model(mesh: Mesh) -> None:
    client = openai_client(mesh)
    parsed = client.responses.parse(
        model=QWEN,
        input=f"Grade this homework out of 10:\n{QUESTION}",
        text_format=Grade,
        max_output_tokens=60,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, Grade), parsed.output_text
    json_object = client.responses.create(
        model=QWEN,
        input="Give the grade as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


def test_function_calls_and_a_whole_tool_loop(mesh: Mesh) -> None:
    client = openai_client(mesh)
    args: Any = {
        "model": QWEN,
        "input": QUESTION,
        "tools": [RUN_TESTS_FLAT],
        "tool_choice": {"type": "function", "name": "run_tests"},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    asked = client.responses.create(**args)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert calls and all(c.name == "run_tests" for c in calls), asked.output
    for call in calls:
        assert call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS["run_tests"])
    assert asked.tools[0].type == "function" and asked.tools[0].name == "run_tests"
    # Streamed: the same calls, their arguments in pieces.
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == "".join(c.arguments for c in calls)
    # The calls and their outputs go back as items; the model answers in text.
    loop: Any = [
        {"role": "user", "content": QUESTION},
        *[
            {
                "type": "function_call",
                "call_id": c.call_id,
                "name": c.name,
                "arguments": c.arguments,
            }
            for c in calls
        ],
        *[
            {"type": "function_call_output", "call_id": c.call_id, "output": "2 of 3 passed"}
            for c in calls
        ],
    ]
    answered = client.responses.create(
        model=QWEN,
        input=loop,
        tools=[RUN_TESTS_FLAT],
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert answered.output_text and answered.output[0].type == "message"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": 1}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(
    mesh: Mesh, change: dict[str, Any], param: str
) -> None:
    body = {"model": QWEN, "input": "hi", "max_output_tokens": 4, **change}
    reply = httpx.post(f"{http_url(mesh)}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{param}: "), error


def test_unknown_models_and_long_inputs_as_openai_answers_them(mesh: Mesh) -> None:
    client = openai_client(mesh)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="gpt-9", input="hi")
    assert "gpt-9" in missing.value.message
    long = "word " * 5_000
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=QWEN, input=long, max_output_tokens=4)
    body: Any = refused.value.body
    assert body["param"] == "input" and body["code"] == "context_length_exceeded", body
    # truncation "auto": the oldest items dropped until it fits, the last one kept.
    turns: Any = [{"role": "user", "content": long}, {"role": "user", "content": ASK}]
    fitted = client.responses.create(
        model=QWEN, input=turns, truncation="auto", max_output_tokens=4, temperature=0
    )
    assert fitted.output_text and fitted.truncation == "auto"
    assert fitted.usage is not None and fitted.usage.input_tokens < 100
