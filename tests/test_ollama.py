"""Ollama as an engine for prefill and decode nodes, direct Ollama from the router, and the
fallback chain, against an Ollama HTTP API server inside the tests (tests/fake_ollama.py)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import ollama
import openai
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg_mesh.proto.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    types_pb2,
)
from disagg_mesh.server.common.config.topology import Topology
from disagg_mesh.server.common.engines.ollama_engine import OllamaEngine
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from tests import conftest
from tests.conftest import route, router_node, running_mesh
from tests.fake_ollama import FakeOllama, WordModel, word_logprobs
from tests.streams import Collected, collect, streamed_calls

MODEL = "qwen3-coder:30b"
PROMPT = "def add(a, b):"


def ollama_node(name: str, role: str, url: str) -> str:
    return conftest.ollama_node(name, role, url, MODEL, n_ctx=8192)


@dataclass
class OllamaMesh:
    topology: Topology
    processes: MeshProcesses
    nodes_ollama: FakeOllama  # the Ollama server behind the prefill and decode nodes
    direct_ollama: FakeOllama  # the one the router calls itself (direct_ollama)
    no_tools_ollama: FakeOllama  # one whose model's template takes no tools, nor a suffix


@pytest.fixture(scope="module")
def ollama_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OllamaMesh]:
    folder: Path = tmp_path_factory.mktemp("ollama-mesh")
    nodes_ollama, direct_ollama = FakeOllama().start(), FakeOllama().start()
    no_tools_ollama = FakeOllama(takes_tools=False)
    no_tools_ollama.model.fim_template = ""  # nor a fill-in-the-middle branch
    no_tools_ollama.start()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    parts = [
        "[mesh]\ncooldown_s = 0.5\nhealth_check_every_s = 0.5\n",
        router_node(http_port=free_port()),
        ollama_node("prefill-ollama", "prefill", nodes_ollama.url),
        ollama_node("decode-ollama", "decode", nodes_ollama.url),
        ollama_node("prefill-dead", "prefill", dead),
        ollama_node("decode-dead", "decode", dead),
        ollama_node("decode-no-tools", "decode", no_tools_ollama.url),
        route(
            MODEL,
            ["prefill-ollama"],
            ["decode-ollama"],
            chain=["disaggregated", "decode_only", "direct_ollama"],
            ollama_url=direct_ollama.url,
        ),
        route("ollama/decode-only", [], ["decode-ollama"], chain=["decode_only"]),
        route("ollama/no-tools", [], ["decode-no-tools"], chain=["decode_only"]),
        route(
            "ollama/direct",
            [],
            [],
            chain=["direct_ollama"],
            ollama_url=direct_ollama.url,
            ollama_model=MODEL,
        ),
        route(
            "ollama/direct-unknown-model",
            [],
            [],
            chain=["direct_ollama"],
            ollama_url=direct_ollama.url,
            ollama_model="llama-9000",
        ),
        route(
            "ollama/dead-nodes",
            ["prefill-dead"],
            ["decode-dead"],
            chain=["disaggregated", "decode_only", "direct_ollama"],
            ollama_url=direct_ollama.url,
            ollama_model=MODEL,
        ),
    ]
    try:
        # The "-dead" ones never serve.
        wait_for = ["router", "prefill-ollama", "decode-ollama", "decode-no-tools"]
        with running_mesh(folder, parts, wait_for) as processes:
            yield OllamaMesh(
                processes.topology, processes, nodes_ollama, direct_ollama, no_tools_ollama
            )
    finally:
        nodes_ollama.stop()
        direct_ollama.stop()
        no_tools_ollama.stop()


@pytest_asyncio.fixture
async def router(ollama_mesh: OllamaMesh) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    ollama_mesh.nodes_ollama.reset()
    ollama_mesh.direct_ollama.reset()
    ollama_mesh.no_tools_ollama.reset()
    async with grpc.aio.insecure_channel(ollama_mesh.topology.router.address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


def ollama_request(
    model: str, max_tokens: int = 8, **sampling: object
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        model=model,
        prompt=PROMPT,
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),  # type: ignore[arg-type]
    )


async def test_disaggregated_over_ollama_moves_token_ids_and_says_so(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    asked = ollama_request(
        MODEL,
        8,
        top_p=0.5,
        top_k=7,
        min_p=0.25,
        seed=7,
        stop=["zzz"],
        repeat_penalty=1.25,
        frequency_penalty=0.25,
        presence_penalty=0.5,
        repeat_last_n=32,
    )
    got = await collect(router.Generate(asked))
    s = got.summary
    assert s.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert s.kv_transfer == types_pb2.KV_TRANSFER_TOKEN_IDS
    assert s.prefill_node == "prefill-ollama" and s.decode_node == "decode-ollama"
    # Honest metrics: the decode machine evaluated the prompt again.
    assert s.decode_prompt_eval_duration.ToNanoseconds() > 0
    assert s.completion_tokens == 8 and not s.failed_attempts
    # The same text as whole generation on the decode node.
    whole = await collect(router.Generate(ollama_request("ollama/decode-only", 8)))
    assert got.text == whole.text and whole.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    # Our options reached Ollama with its names and units.
    fake = ollama_mesh.nodes_ollama
    prefill = next(b for p, b in fake.requests if p == "/api/generate" and b.get("stream") is False)
    assert prefill["options"]["num_predict"] == 1 and prefill["prompt"] == PROMPT
    decode = next(b for p, b in fake.requests if p == "/api/generate" and "context" in b)
    assert decode["options"] == {
        "num_predict": 7,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 7,
        "min_p": 0.25,
        "seed": 7,
        "stop": ["zzz"],
        "num_ctx": 8192,
        "repeat_penalty": 1.25,
        "frequency_penalty": 0.25,
        "presence_penalty": 0.5,
        "repeat_last_n": 32,
    }
    assert decode["keep_alive"] == "30m" and decode["template"] == "{{ .Prompt }}"


async def test_chat_messages_fall_through_to_decode_only(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    req = router_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content="Grade this.")],
        sampling=types_pb2.SamplingParams(max_tokens=4, temperature=0.0),
    )
    got = await collect(router.Generate(req))
    assert got.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    [failure] = got.summary.failed_attempts
    assert failure.code == "FAILED_PRECONDITION" and "chat" in failure.message
    assert any(p == "/api/chat" for p, _ in ollama_mesh.nodes_ollama.requests)


async def test_direct_ollama_streams_and_unknown_model_is_not_found(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    got = await collect(router.Generate(ollama_request("ollama/direct", 6)))
    assert got.summary.method == router_pb2.ROUTE_METHOD_DIRECT_OLLAMA
    assert got.summary.decode_address == ollama_mesh.direct_ollama.url
    assert got.deltas >= 6 and got.summary.completion_tokens == 6
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(router.Generate(ollama_request("ollama/direct-unknown-model")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'llama-9000' not found" in (info.value.details() or "")


@pytest.mark.parametrize(
    ("field", "setting"),
    [
        ("sampling.ignore_eos", {"ignore_eos": True}),
        ("sampling.logit_bias", {"logit_bias": {5: 1.0}}),
        ("truncate_prompt_tokens", {}),
    ],
)
async def test_what_ollama_lacks_is_refused_naming_the_field(
    router: router_pb2_grpc.RouterServiceAsyncStub, field: str, setting: dict[str, object]
) -> None:
    """Ollama has no such option: the node says so instead of ending answers early,
    leaving the biases out or evaluating the whole prompt."""
    for model in ("ollama/decode-only", "ollama/direct"):
        request = ollama_request(model, 8, **setting)
        request.truncate_prompt_tokens = 4 if field == "truncate_prompt_tokens" else 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(router.Generate(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, model
        assert f"{field}: is not supported" in (info.value.details() or ""), info.value.details()


async def test_a_suffix_reaches_ollama_which_fills_in_the_middle(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    """GenerateRequest.suffix becomes Ollama's own `suffix` on every route (its template's
    fill-in-the-middle branch frames it): the answer is Ollama's to the same request, and
    over two Ollama nodes the prefill node's context carries the framing to the decode
    node. With an empty prompt, which Ollama answers by loading the model, and on a model
    whose template has no such branch, the request is refused naming the field."""
    suffix = "\n    return total\n"
    direct = await asyncio.to_thread(
        ollama.Client(host=ollama_mesh.direct_ollama.url).generate,
        model=MODEL,
        prompt=PROMPT,
        suffix=suffix,
        options={"temperature": 0.0, "num_predict": 8},
    )
    plain = await collect(router.Generate(ollama_request("ollama/direct", 8)))
    assert direct.response != plain.text  # the suffix changes the answer
    fakes = [ollama_mesh.nodes_ollama, ollama_mesh.direct_ollama]
    for model in (MODEL, "ollama/decode-only", "ollama/direct"):
        for fake in fakes:
            fake.requests.clear()
        request = ollama_request(model, 8)
        request.suffix = suffix
        got = await collect(router.Generate(request))
        assert got.text == direct.response and not got.summary.failed_attempts, model
        sent = [b for fake in fakes for p, b in fake.requests if p == "/api/generate"]
        assert sent and all(b.get("suffix") == suffix for b in sent if "context" not in b)
    empty = ollama_request("ollama/decode-only", 8)
    empty.prompt, empty.suffix = "", suffix
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(router.Generate(empty))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt: must hold the text before the gap" in (info.value.details() or "")
    # A model whose Ollama template has no .Suffix: Ollama's own 400, naming the field.
    fake = ollama_mesh.direct_ollama
    fake.model.fim_template = ""
    try:
        request = ollama_request("ollama/direct", 8)
        request.suffix = suffix
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(router.Generate(request))
    finally:
        fake.model.fim_template = WordModel.fim_template
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "suffix: Ollama at" in (info.value.details() or ""), info.value.details()
    assert "does not support insert" in (info.value.details() or "")


@pytest.mark.parametrize("model", [MODEL, "ollama/decode-only", "ollama/direct"])
async def test_log_probabilities_come_from_ollama(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh, model: str
) -> None:
    """SamplingParams.logprobs becomes Ollama's logprobs and top_logprobs; each token's
    entry comes back as Ollama gave it (its text, no token id: -1), on every route: over
    two Ollama nodes the first token's from the prefill node's reply."""
    got = await collect(router.Generate(ollama_request(model, 6, logprobs=2)))
    assert not got.summary.failed_attempts
    pieces = [lp.chosen.piece.decode() for lp in got.logprobs]
    assert "".join(pieces) == got.text and len(pieces) == 6
    for lp, piece in zip(got.logprobs, pieces, strict=True):
        expected = word_logprobs(piece, 2)
        assert lp.chosen.token_id == -1
        assert lp.chosen.logprob == pytest.approx(expected["logprob"])
        assert [(c.piece.decode(), c.token_id) for c in lp.top] == [
            (t["token"], -1) for t in expected["top_logprobs"]
        ]
    fakes = [ollama_mesh.nodes_ollama, ollama_mesh.direct_ollama]
    sent = [b for fake in fakes for p, b in fake.requests if p == "/api/generate"]
    assert sent and all((b["logprobs"], b["top_logprobs"]) == (True, 2) for b in sent)
    for fake in fakes:
        fake.requests.clear()
    plain = await collect(router.Generate(ollama_request(model, 4)))
    assert not plain.logprobs
    sent = [b for fake in fakes for p, b in fake.requests if p == "/api/generate"]
    assert sent and not any("logprobs" in b for b in sent)


async def test_log_probabilities_from_an_older_ollama_are_refused_not_left_out(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    """An Ollama older than 0.12.11 ignores logprobs: the answer is refused, saying why,
    not sent without them."""
    ollama_mesh.direct_ollama.old = True
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(router.Generate(ollama_request("ollama/direct", 4, logprobs=0)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "0.12.11" in (info.value.details() or "")


def test_log_probabilities_over_ollama_nodes_reach_both_doors(ollama_mesh: OllamaMesh) -> None:
    """The `ollama` client's logprobs/top_logprobs and the `openai` client's, through the
    mesh's doors to Ollama nodes and back."""
    router = ollama_mesh.topology.router
    url = f"http://{router.host}:{router.http_port}"
    answer = ollama.Client(host=url).generate(
        model="ollama/decode-only",
        prompt=PROMPT,
        options={"num_predict": 4, "temperature": 0},
        logprobs=True,
        top_logprobs=3,
    )
    entries = answer.logprobs or []
    assert "".join(e.token for e in entries) == answer.response and len(entries) == 4
    assert [len(e.top_logprobs or ()) for e in entries] == [3] * 4
    client: Any = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="ollama/decode-only",
        messages=[{"role": "user", "content": "Grade this."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.logprob == pytest.approx(math.log(0.5)) for c in content)


async def test_response_format_reaches_ollama_as_its_format(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    """Ollama's own `format` ("json" or the schema); a constrained generation is never
    split over Ollama nodes (Ollama would start its grammar again at the decode node)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    formats = [
        (types_pb2.ResponseFormat(type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT), "json"),
        (
            types_pb2.ResponseFormat(
                type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema=json.dumps(schema)
            ),
            schema,
        ),
    ]
    for fmt, sent in formats:
        got = await collect(router.Generate(ollama_request(MODEL, 4, response_format=fmt)))
        assert got.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
        [failure] = got.summary.failed_attempts
        assert failure.code == "FAILED_PRECONDITION" and "grammar" in failure.message
        assert ollama_mesh.nodes_ollama.last("/api/generate")["format"] == sent
        await collect(router.Generate(ollama_request("ollama/direct", 4, response_format=fmt)))
        assert ollama_mesh.direct_ollama.last("/api/generate")["format"] == sent


async def test_ollama_500_on_the_nodes_falls_back_to_direct_ollama(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    ollama_mesh.nodes_ollama.status = 500
    try:
        got = await collect(router.Generate(ollama_request(MODEL, 5)))
    finally:
        ollama_mesh.nodes_ollama.status = 0
    s = got.summary
    assert s.method == router_pb2.ROUTE_METHOD_DIRECT_OLLAMA and s.completion_tokens == 5
    # tenacity retried the prefill call on UNAVAILABLE: each of the 3 calls is listed.
    assert [(f.method, f.code) for f in s.failed_attempts] == [
        *[(router_pb2.ROUTE_METHOD_DISAGGREGATED, "UNAVAILABLE")] * 3,
        (router_pb2.ROUTE_METHOD_DECODE_ONLY, "UNAVAILABLE"),
    ]
    assert all("fake failure 500" in f.message for f in s.failed_attempts)
    prefills = [
        b
        for p, b in ollama_mesh.nodes_ollama.requests
        if p == "/api/generate" and b.get("stream") is False
    ]
    assert len(prefills) == 3


async def test_unreachable_ollama_behind_the_nodes_falls_back_to_direct_ollama(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    got = await collect(router.Generate(ollama_request("ollama/dead-nodes", 4)))
    assert got.summary.method == router_pb2.ROUTE_METHOD_DIRECT_OLLAMA
    assert {f.code for f in got.summary.failed_attempts} <= {"UNAVAILABLE"}


async def test_a_node_with_its_ollama_down_is_not_serving(ollama_mesh: OllamaMesh) -> None:
    """Health follows Ollama (checked every 2 s): wait up to 6 s for the expected status."""
    for name, expected in (("decode-dead", "NOT_SERVING"), ("decode-ollama", "SERVING")):
        async with grpc.aio.insecure_channel(ollama_mesh.topology.node(name).address) as channel:
            stub: object = health_pb2_grpc.HealthStub(channel)
            for _ in range(30):
                reply = await stub.Check(health_pb2.HealthCheckRequest())  # type: ignore[attr-defined]
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if status == expected:
                    break
                await asyncio.sleep(0.2)
            assert status == expected, name


async def test_an_ollama_node_failing_mid_answer_hands_over_to_direct_ollama(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    alone = await collect(router.Generate(ollama_request(MODEL, 10)))
    ollama_mesh.nodes_ollama.drop_after = 3
    try:
        got = await collect(router.Generate(ollama_request(MODEL, 10)))
    finally:
        ollama_mesh.nodes_ollama.drop_after = -1
    # The first token (from the prefill node) and 3 streamed words came from the nodes'
    # Ollama, the rest from the router's own: the same answer, nothing twice.
    assert got.text == alone.text and got.summary.completion_tokens == 10
    (migration,) = got.summary.migrations
    assert migration.failed_node == "decode-ollama" and migration.code == "UNAVAILABLE"
    assert migration.tokens_delivered == 4
    assert migration.resumed_on == ollama_mesh.direct_ollama.url
    # Ollama rendered the prompt with its template: the continuation is a chat whose last
    # assistant turn holds the text delivered, which Ollama leaves open and continues.
    chat = ollama_mesh.direct_ollama.last("/api/chat")
    user, assistant = chat["messages"]
    assert user == {"role": "user", "content": PROMPT}
    assert assistant["role"] == "assistant" and assistant["content"]
    assert alone.text.startswith(assistant["content"]) and alone.text != assistant["content"]
    assert chat["options"]["num_predict"] == 6


async def _continued_on_the_ollama_node(
    ollama_mesh: OllamaMesh, raw_prompt: bool = False, **prompt: Any
) -> Collected:
    """The Ollama decode node going on with a generation made elsewhere, 3 tokens
    ("\\n    return") in, of the prompt or messages given."""
    ollama_mesh.nodes_ollama.reset()
    address = ollama_mesh.topology.node("decode-ollama").address
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        request = decode_pb2.DecodeServiceGenerateRequest(
            model=MODEL,
            sampling=types_pb2.SamplingParams(max_tokens=9, temperature=0.0),
            continuation=types_pb2.Continuation(
                generated_text="\n    return", raw_prompt=raw_prompt, generated_tokens=3
            ),
            **prompt,
        )
        return await collect(stub.Generate(request))


@pytest.mark.parametrize("raw_prompt", [True, False], ids=["raw-text", "templated"])
async def test_an_ollama_decode_node_continues_another_nodes_generation(
    ollama_mesh: OllamaMesh, raw_prompt: bool
) -> None:
    fake = ollama_mesh.nodes_ollama
    got = await _continued_on_the_ollama_node(ollama_mesh, raw_prompt, prompt=PROMPT)
    # max_tokens counts the tokens made elsewhere; none of their text comes again.
    assert got.summary.completion_tokens == 3 + got.deltas
    assert got.text and not got.text.startswith("\n    return")
    if raw_prompt:  # the prompt had no template: raw /api/generate, text appended
        body = fake.last("/api/generate")
        assert body["raw"] is True and body["prompt"] == PROMPT + "\n    return"
    else:  # Ollama's template: an open assistant turn
        body = fake.last("/api/chat")
        assert body["messages"][-1] == {"role": "assistant", "content": "\n    return"}
    assert body["options"]["num_predict"] == 6


async def test_an_ollama_decode_node_goes_on_with_a_continued_assistant_message(
    ollama_mesh: OllamaMesh,
) -> None:
    """A chat asking for its last assistant message to be continued, taken over after 3
    tokens: that message holds its own text and then the text delivered, still open."""
    messages = [
        types_pb2.ChatMessage(role="user", content=PROMPT),
        types_pb2.ChatMessage(role="assistant", content="def f():"),
    ]
    await _continued_on_the_ollama_node(ollama_mesh, messages=messages)
    sent = ollama_mesh.nodes_ollama.last("/api/chat")["messages"]
    assert sent == [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "def f():\n    return"},
    ]


async def test_failure_after_text_with_no_node_left_says_how_much_arrived(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    ollama_mesh.nodes_ollama.drop_after = 3
    received: list[str] = []
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for reply in router.Generate(ollama_request("ollama/decode-only", 10)):
                received.append(reply.delta.text)
    finally:
        ollama_mesh.nodes_ollama.drop_after = -1
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # 3 streamed words, nothing twice; no other node could take over.
    assert len(received) == 3
    assert "after 3 text deltas were delivered" in (info.value.details() or "")
    assert not ollama_mesh.direct_ollama.requests


async def test_caller_cancellation_stops_the_ollama_stream(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    fake = ollama_mesh.nodes_ollama
    fake.delay_s = 0.2
    before = fake.disconnects
    try:
        call = router.Generate(ollama_request("ollama/decode-only", 100))
        async for _ in call:
            break
        call.cancel()
        await asyncio.to_thread(fake.disconnected.wait, 5)
    finally:
        fake.delay_s = 0.0
    assert fake.disconnects == before + 1


async def test_node_info_says_whether_ollama_holds_the_model_in_memory(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    await collect(router.Generate(ollama_request("ollama/decode-only", 2)))
    for name, ready, loaded in (("decode-ollama", True, True), ("decode-dead", False, False)):
        address = ollama_mesh.topology.node(name).address
        async with grpc.aio.insecure_channel(address) as channel:
            info = await node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(
                node_pb2.GetNodeInfoRequest()
            )
        assert (info.ready, info.model_loaded_in_memory) == (ready, loaded), name
        assert info.kv_transfer == types_pb2.KV_TRANSFER_TOKEN_IDS
        # What the Ollama server's /api/tags and /api/show say of the model (the
        # stand-in's qwen3moe, whose template takes tools and fills in the middle).
        facts = info.model_facts
        want: tuple[object, ...] = ("qwen3moe", "30.5B", "Q4_K_M") if ready else ("", "", "")
        assert (facts.architecture, facts.parameter_size, facts.quantization) == want, name
        want = (30_532_122_624, 262_144, 2_048) if ready else (0, 0, 0)
        sizes = (facts.parameter_count, facts.trained_context_tokens, facts.embedding_length)
        assert sizes == want, name
        want = ("completion", "tools", "insert") if ready else ()
        assert tuple(facts.capabilities) == want, name
        assert facts.template == (ollama_mesh.nodes_ollama.shown_template if ready else "")
    assert "unreachable" in info.problem


async def test_an_older_ollama_that_does_not_say_what_its_model_can_do_leaves_it_unknown() -> None:
    """Ollama before 0.6.4 has no `capabilities` in /api/show: the node says nothing of
    them (the router then gives the model the benefit of the doubt, and Ollama refuses what
    it cannot do) and still tells the sizes; /api/show is asked once per model digest."""
    fake = FakeOllama(says_capabilities=False).start()
    engine = OllamaEngine(fake.url, MODEL, n_ctx=8192, max_in_flight=1)
    try:
        assert await engine.problem() is None
        assert await engine.problem() is None
        facts = engine.model_facts
        assert facts.capabilities == () and facts.reasons is None and facts.takes_tools is None
        assert (facts.architecture, facts.parameter_count) == ("qwen3moe", 30_532_122_624)
        assert [p for p, _ in fake.requests].count("/api/show") == 1
    finally:
        await engine.close()
        fake.stop()


GRADE = types_pb2.ToolDefinition(name="record_grade", parameters_json_schema="{}")


def tools_request(model: str) -> router_pb2.GenerateRequest:
    """A chat that offers a tool (record_grade)."""
    return router_pb2.GenerateRequest(
        model=model,
        messages=[types_pb2.ChatMessage(role="user", content="Grade it.")],
        sampling=types_pb2.SamplingParams(
            max_tokens=4, temperature=0.0, tools=types_pb2.ToolSet(definitions=[GRADE])
        ),
    )


async def test_what_an_ollama_model_cannot_do_is_refused_before_a_node_is_asked(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    """Each Ollama node tells the router what Ollama's /api/show says its model can do. As
    Ollama refuses them, the router refuses tools for a model whose template takes none,
    a suffix for one without a fill-in-the-middle branch and think for one that does not
    reason, naming the field, on gRPC and both doors, without asking a node; the same
    request without them is served. Asked directly, the node names the field of Ollama's
    own refusal."""
    fake = ollama_mesh.no_tools_ollama
    request = tools_request("ollama/no-tools")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(router.Generate(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = info.value.details() or ""
    assert said.startswith("tools: 'ollama/no-tools' does not support tools"), said
    router_node = ollama_mesh.topology.router
    url = f"http://{router_node.host}:{router_node.http_port}"
    messages = [{"role": "user", "content": "Grade it."}]
    tools: list[Any] = [{"type": "function", "function": {"name": "record_grade"}}]
    client: Any = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(
            client.chat.completions.create,
            model="ollama/no-tools",
            messages=messages,
            tools=tools,
            max_tokens=4,
        )
    assert refused.value.body["param"] == "tools", refused.value.body  # type: ignore[index]
    with pytest.raises(ollama.ResponseError) as bad:
        await asyncio.to_thread(
            ollama.Client(host=url).chat, model="ollama/no-tools", messages=messages, tools=tools
        )
    assert bad.value.status_code == 400
    assert bad.value.error.startswith("tools: 'ollama/no-tools' does not support tools")
    # qwen3-coder (the stand-in's) does not reason apart from its answer: Ollama's 400.
    with pytest.raises(ollama.ResponseError) as bad:
        await asyncio.to_thread(
            ollama.Client(host=url).chat, model=MODEL, messages=messages, think=True
        )
    assert bad.value.error.startswith(f"think: {MODEL!r} does not support thinking"), bad.value
    # Nor a suffix, for a model whose Ollama template has no fill-in-the-middle branch.
    fim = router_pb2.GenerateRequest(model="ollama/no-tools", prompt=PROMPT, suffix="\n")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(router.Generate(fim))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = info.value.details() or ""
    assert said.startswith("suffix: 'ollama/no-tools' does not support insert: its Ollama"), said
    assert not [p for p, _ in fake.requests if p in ("/api/chat", "/api/generate")]
    assert not [p for p, _ in ollama_mesh.nodes_ollama.requests if p == "/api/chat"]
    request.sampling.ClearField("tools")
    got = await collect(router.Generate(request))
    assert got.text and not got.summary.failed_attempts
    # The node alone passes the tools on to Ollama, whose 400 comes back naming the field.
    address = ollama_mesh.topology.node("decode-no-tools").address
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(
                decode_pb2_grpc.DecodeServiceStub(channel).Generate(
                    decode_pb2.DecodeServiceGenerateRequest(
                        model="ollama/no-tools",
                        messages=request.messages,
                        sampling=types_pb2.SamplingParams(
                            max_tokens=4, tools=types_pb2.ToolSet(definitions=[GRADE])
                        ),
                    )
                )
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = info.value.details() or ""
    assert said.startswith(f"tools: Ollama at {fake.url}:"), said
    assert said.endswith("does not support tools"), said


async def test_a_model_pulled_again_is_read_again_by_the_router(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    """The router reads what a node says of its model when the node turns serving. An
    Ollama node whose model is pulled again (another digest; here a template that takes
    tools) says SERVING once more on its health's Watch stream, and the router reads it
    again: the tools it refused are served, and refused again once the old model is back,
    with nothing restarted. A plain grpc.health.v1 watcher sees SERVING twice."""
    fake = ollama_mesh.no_tools_ollama
    request = tools_request("ollama/no-tools")

    async def refused() -> bool:
        try:
            await collect(router.Generate(request))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            return True
        return False

    async def until(want_refused: bool) -> None:
        for _ in range(60):  # the node asks its Ollama every 2 s
            if await refused() == want_refused:
                return
            await asyncio.sleep(0.25)
        raise AssertionError(f"tools still {'served' if want_refused else 'refused'}")

    address = ollama_mesh.topology.node("decode-no-tools").address
    async with grpc.aio.insecure_channel(address) as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        assert await refused()
        fake.takes_tools, fake.digest = True, "sha256:" + "5eed" * 16
        try:
            await until(want_refused=False)
            said = await asyncio.wait_for(watch.read(), 5)
            assert said.status == health_pb2.HealthCheckResponse.SERVING
            assert [p for p, body in fake.requests if p == "/api/chat" and body.get("tools")]
        finally:
            fake.reset()
        await until(want_refused=True)
        watch.cancel()


async def test_tools_reach_ollama_and_its_calls_come_back_as_calls(
    router: router_pb2_grpc.RouterServiceAsyncStub, ollama_mesh: OllamaMesh
) -> None:
    """Tools go to Ollama's /api/chat as its `tools`, an earlier call and its result in
    Ollama's shape (arguments an object, the result naming its tool); Ollama's call (sent
    whole) comes back as a call, finish tool_calls. Ollama has no tool_choice: a forced
    one is refused by its nodes, naming the field."""
    grade = types_pb2.ToolDefinition(
        name="record_grade",
        parameters_json_schema=json.dumps(
            {
                "type": "object",
                "properties": {"points": {"type": "integer"}, "note": {"type": "string"}},
                "required": ["points"],
            }
        ),
    )
    messages = [
        types_pb2.ChatMessage(role="user", content="Grade it."),
        types_pb2.ChatMessage(
            role="assistant",
            tool_calls=[
                types_pb2.ToolCall(id="call_1", name="record_grade", arguments_json='{"points": 3}')
            ],
        ),
        types_pb2.ChatMessage(role="tool", content="recorded", tool_call_id="call_1"),
    ]

    def request(choice: types_pb2.ToolChoice) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(
            model="ollama/decode-only",
            messages=messages,
            sampling=types_pb2.SamplingParams(
                max_tokens=16,
                temperature=0.0,
                tools=types_pb2.ToolSet(
                    definitions=[grade], choice=choice, function_name="record_grade"
                ),
            ),
        )

    got = await collect(router.Generate(request(types_pb2.TOOL_CHOICE_AUTO)))
    calls = got.tool_calls
    assert [(c.index, c.name) for c in calls if c.name] == [(0, "record_grade")]
    assert json.loads("".join(c.arguments_json for c in calls)) == {"points": 1}
    assert got.summary.finish_reason == types_pb2.FINISH_REASON_TOOL_CALLS
    sent = ollama_mesh.nodes_ollama.last("/api/chat")
    assert sent["tools"][0]["function"]["name"] == "record_grade"
    assert sent["messages"][1]["tool_calls"] == [
        {"function": {"name": "record_grade", "arguments": {"points": 3}}}
    ]
    assert (sent["messages"][2]["role"], sent["messages"][2]["tool_name"]) == (
        "tool",
        "record_grade",
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await collect(router.Generate(request(types_pb2.TOOL_CHOICE_FUNCTION)))
    assert "tool_choice" in (refused.value.details() or "")


def test_parallel_calls_come_back_to_both_doors_each_with_its_index_and_id(
    ollama_mesh: OllamaMesh,
) -> None:
    """A model that calls two tools at once (Ollama sends both in one message): the
    `openai` client gets two calls, indices 0 and 1, each its own id, finish tool_calls,
    and the streamed pieces put together are the same calls; the `ollama` client gets both
    with arguments objects; /v1/responses gives two function_call items."""
    router = ollama_mesh.topology.router
    url = f"http://{router.host}:{router.http_port}"
    tools: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {field: {"type": kind}},
                    "required": [field],
                },
            },
        }
        for name, field, kind in (
            ("run_tests", "code", "string"),
            ("record_grade", "points", "integer"),
        )
    ]
    args: dict[str, Any] = {
        "model": "ollama/decode-only",
        "messages": [{"role": "user", "content": "Test it and grade it."}],
        "tools": tools,
        "parallel_tool_calls": True,
        "max_tokens": 16,
    }
    client: Any = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = whole.choices[0].message.tool_calls
    expected = [("run_tests", {"code": "x"}), ("record_grade", {"points": 1})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == 2
    streamed, finish = streamed_calls(client.chat.completions.create(**args, stream=True))
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == expected
    assert streamed[0].id != streamed[1].id and finish == "tool_calls"
    answer = ollama.Client(host=url).chat(
        model="ollama/decode-only", messages=args["messages"], tools=tools
    )
    got = answer.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in got] == expected
    # The Responses API: two function_call items, in order, each its own call id; the
    # SDK's stream helper puts the streamed ones together the same.
    flat = [{"type": "function", **t["function"]} for t in tools]
    response = client.responses.create(
        model="ollama/decode-only", input="Test it and grade it.", tools=flat, max_output_tokens=16
    )
    items = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in items] == expected
    assert len({c.call_id for c in items}) == 2
    with client.responses.stream(
        model="ollama/decode-only", input="Test it and grade it.", tools=flat, max_output_tokens=16
    ) as stream:
        final = stream.get_final_response()
    items = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in items] == expected
