"""A generation that another node takes over mid-answer: the engine's continuation (prompt,
then the generated tokens replayed one step at a time, never sent again), and the router
migrating a stream whose decode node was killed or hung."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import ollama
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc, router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.engines.base import Generation, PrefillOutput
from disagg_mesh.server.common.engines.llama_cpp import LlamaCppEngine
from disagg_mesh.server.common.errors import FailedPrecondition, InvalidArgument
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from disagg_mesh.server.common.types import (
    Continuation,
    GenerationEnd,
    Prompt,
    Sampling,
    TextChunk,
)
from tests.conftest import engine_node, route, router_node, running_mesh
from tests.fake_ollama import FakeOllama, WordModel
from tests.streams import late_word
from tests.test_engine import drain, open_engine, source_of

PROMPT = "Count from one to fifty in words, separated by commas: one, two,"
LONG = 200
# The same nodes; a migration's prompt and delivered tokens are evaluated by the prefill
# node, or by the decode node taking over ("m" weighs both: migrate_via = "auto").
VIA_PREFILL = "m-via-prefill"
VIA_DECODE = "m-via-decode"
DECODE_NODES = ("decode-a", "decode-b", "decode-c")
# Repetition penalties count the prompt's last tokens and every token of the answer, the
# delivered ones a continuation replays included.
PENALIZED = Sampling(
    max_tokens=48,
    temperature=0.0,
    ignore_eos=True,
    repeat_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=0.4,
)


async def run(
    engine: LlamaCppEngine,
    sampling: Sampling,
    continuation: Continuation | None = None,
) -> tuple[list[TextChunk], GenerationEnd]:
    chunks: list[TextChunk] = []
    end = None
    async for item in engine.generate(Prompt(text=PROMPT), sampling, continuation):
        if isinstance(item, TextChunk):
            chunks.append(item)
        else:
            end = item
    assert end is not None
    return chunks, end


def split_after(chunks: list[TextChunk], n_chunks: int) -> tuple[list[int], str, str]:
    """Token ids and text of the first n chunks (what a caller had received), and the
    rest of the text."""
    ids = [t for c in chunks[:n_chunks] for t in c.token_ids]
    return (
        ids,
        "".join(c.text for c in chunks[:n_chunks]),
        "".join(c.text for c in chunks[n_chunks:]),
    )


def tokenized_as_made(engine: LlamaCppEngine, ids: list[int], text: str) -> bool:
    return engine._model.tokenize_text(text) == ids


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[LlamaCppEngine]:
    engine = await open_engine(n_ctx=1024)
    yield engine
    await engine.close()


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(max_tokens=48, temperature=0.0, ignore_eos=True),
        Sampling(max_tokens=48, temperature=0.9, seed=7, ignore_eos=True),
        PENALIZED,
    ],
    ids=["greedy", "seeded", "penalized"],
)
async def test_a_continuation_gives_the_rest_of_the_same_answer(
    engine: LlamaCppEngine, sampling: Sampling
) -> None:
    whole, end = await run(engine, sampling)
    assert end.completion_tokens == 48
    for cut in (1, 7, 20):
        ids, delivered, rest = split_after(whole, cut)
        chunks, resumed = await run(
            engine, sampling, Continuation(tuple(ids), delivered, first_token_from_prefill=False)
        )
        # Nothing sent twice, nothing skipped; max_tokens counts the whole answer.
        assert "".join(c.text for c in chunks) == rest
        assert resumed.completion_tokens == 48


async def test_a_continuation_keeps_stop_strings_across_the_boundary(
    engine: LlamaCppEngine,
) -> None:
    free = Sampling(max_tokens=60, temperature=0.0, ignore_eos=True)
    stop = late_word([c.text for c in (await run(engine, free))[0]], 30)
    sampling = dataclasses.replace(free, stop=(stop,))
    whole, end = await run(engine, sampling)
    text = "".join(c.text for c in whole)
    assert stop not in text and end.finish_reason.value == "stop"
    ids, delivered, rest = split_after(whole, len(whole) // 2)
    chunks, resumed = await run(engine, sampling, Continuation(tuple(ids), delivered))
    assert "".join(c.text for c in chunks) == rest
    assert (
        resumed.finish_reason.value == "stop" and resumed.completion_tokens == end.completion_tokens
    )


async def test_a_continuation_from_text_alone_is_tokenized_and_goes_on(
    engine: LlamaCppEngine,
) -> None:
    """An Ollama node streams text without token ids: the node taking over tokenizes it."""
    sampling = Sampling(max_tokens=48, temperature=0.0, ignore_eos=True)
    whole, _ = await run(engine, sampling)
    # The node taking over tokenizes the delivered text again: cut where that gives the ids
    # as they were made (greedy text differs between CPUs, and with it which cuts do).
    cut = next(
        n for n in range(9, len(whole)) if tokenized_as_made(engine, *split_after(whole, n)[:2])
    )
    ids, delivered, rest = split_after(whole, cut)
    chunks, resumed = await run(
        engine, sampling, Continuation((), delivered, generated_tokens=len(ids))
    )
    assert "".join(c.text for c in chunks) == rest  # this text tokenizes as it was made
    assert resumed.completion_tokens == 48


async def test_a_continuation_with_bad_ids_is_refused(engine: LlamaCppEngine) -> None:
    with pytest.raises(InvalidArgument, match=r"continuation\.generated_token_ids"):
        await run(engine, Sampling(max_tokens=4), Continuation((10**7,), "x"))


# -- a prefill node serves the continuation -----------------------------------------------


async def disaggregated(
    engine: LlamaCppEngine, sampling: Sampling, continuation: Continuation | None = None
) -> tuple[list[TextChunk], GenerationEnd, PrefillOutput]:
    """The prompt prefilled (with a continuation: and its tokens but the last, replayed),
    its state loaded into another slot of the same engine and continued there."""
    out = await engine.prefill(Prompt(text=PROMPT), sampling, (), continuation)
    chunks: list[TextChunk] = []
    end = None
    generation = engine.continue_from_state(
        out.kv_state, source_of(engine, out), sampling, continuation
    )
    async for item in generation:
        if isinstance(item, TextChunk):
            chunks.append(item)
        else:
            end = item
    assert end is not None
    return chunks, end, out


@pytest.mark.parametrize("original", ["decode_only", "disaggregated"])
@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(max_tokens=48, temperature=0.0, ignore_eos=True),
        Sampling(max_tokens=48, temperature=0.9, seed=7, ignore_eos=True),
        PENALIZED,
    ],
    ids=["greedy", "seeded", "penalized"],
)
async def test_a_prefill_node_replays_the_delivered_tokens_and_the_decode_node_goes_on(
    engine: LlamaCppEngine, sampling: Sampling, original: str
) -> None:
    """PrefillRequest.continuation: the state of the prompt and the tokens delivered but
    the last; the decode node takes them in without sending them and generates the rest
    of the same answer (a seeded sampler skipping the draws that made them)."""
    from_prefill = original == "disaggregated"
    if from_prefill:
        whole, end, _ = await disaggregated(engine, sampling)
    else:
        whole, end = await run(engine, sampling)
    assert end.completion_tokens == 48
    for cut in (1, 7, 20):
        ids, delivered, rest = split_after(whole, cut)
        continuation = Continuation(tuple(ids), delivered, first_token_from_prefill=from_prefill)
        chunks, resumed, out = await disaggregated(engine, sampling, continuation)
        assert out.first_token_id == ids[-1] and out.replayed_tokens == len(ids) - 1
        assert out.prompt_tokens == resumed.prompt_tokens
        assert "".join(c.text for c in chunks) == rest
        assert resumed.completion_tokens == 48


async def test_a_continuation_with_a_state_is_checked(engine: LlamaCppEngine) -> None:
    """The state must hold the prompt and the tokens but the last, and kv.first_token_id
    must be the last; a prefill continuation needs token ids. Refused before any text."""
    sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
    whole, _ = await run(engine, sampling)
    ids, delivered, _ = split_after(whole, 5)
    assert len(ids) > 2
    continuation = Continuation(tuple(ids), delivered)
    out = await engine.prefill(Prompt(text=PROMPT), sampling)  # the prompt's state only
    source = dataclasses.replace(source_of(engine, out), first_token_id=ids[-1])
    with pytest.raises(FailedPrecondition, match=r"positions 0\.\.") as refused:
        await drain(engine.continue_from_state(out.kv_state, source, sampling, continuation))
    assert f"{len(ids) - 1} generated tokens" in str(refused.value)
    out = await engine.prefill(Prompt(text=PROMPT), sampling)
    wrong = dataclasses.replace(source_of(engine, out), first_token_id=ids[0])
    with pytest.raises(InvalidArgument, match=r"kv\.first_token_id"):
        await drain(engine.continue_from_state(out.kv_state, wrong, sampling, continuation))
    with pytest.raises(InvalidArgument, match=r"continuation\.generated_token_ids"):
        await engine.prefill(Prompt(text=PROMPT), sampling, (), Continuation((), delivered))
    # The engine serves on.
    assert (await run(engine, sampling))[0] == whole


# -- the router migrates ---------------------------------------------------------------------


@dataclass
class MigrationMesh:
    processes: MeshProcesses

    @property
    def router(self) -> str:
        return self.processes.topology.router.address

    def pid(self, node: str) -> int:
        return self.processes.procs[node].pid

    async def restart(self, *nodes: str) -> None:
        for name in nodes:
            proc = self.processes.procs[name]
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
            await self.processes.restart_node(name)


@pytest.fixture(scope="module")
def migration_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationMesh]:
    folder = tmp_path_factory.mktemp("migration")
    parts = [
        "[mesh]\ncooldown_s = 0.5\nhealth_check_every_s = 0.5\n",
        router_node(http_port=free_port()),
        engine_node("prefill-m", "prefill", 1, slots=2),
        engine_node("decode-a", "decode", 1, slots=2),
        engine_node("decode-b", "decode", 1, slots=2),
        engine_node("decode-c", "decode", 1, slots=2),
        route(
            "m",
            ["prefill-m"],
            list(DECODE_NODES),
            chain=["disaggregated", "decode_only"],
            decode_deadline_s=8.0,
        ),
        route(
            VIA_PREFILL,
            ["prefill-m"],
            list(DECODE_NODES),
            chain=["disaggregated", "decode_only"],
            migrate_via="prefill",
        ),
        route(
            VIA_DECODE,
            ["prefill-m"],
            list(DECODE_NODES),
            chain=["disaggregated", "decode_only"],
            migrate_via="decode",
        ),
    ]
    with running_mesh(folder, parts) as processes:
        yield MigrationMesh(processes)


@dataclass
class Streamed:
    deltas: list[str]
    summary: router_pb2.GenerateSummary | None
    error: grpc.aio.AioRpcError | None
    # With logprobs: each token's (id, log probability).
    logprobs: list[tuple[int, float]] = field(default_factory=list)


async def stream(
    router: str,
    max_tokens: int,
    at: frozenset[int] = frozenset(),
    action: Callable[[], Awaitable[None]] | None = None,
    stop: tuple[str, ...] = (),
    model: str = "m",
    seed: int | None = None,
    ignore_eos: bool = True,
    fmt: types_pb2.ResponseFormat | None = None,
    logprobs: int | None = None,
) -> Streamed:
    """A generation through the router, greedy (or, with a seed, at temperature 0.9);
    action() runs once the caller has received each number of deltas in `at`. ignore_eos
    (the default): the answer runs on past the kills, on any CPU."""
    deltas: list[str] = []
    scores: list[tuple[int, float]] = []
    summary = None
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(
            model=model,
            prompt=PROMPT,
            sampling=types_pb2.SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0 if seed is None else 0.9,
                seed=seed,
                stop=list(stop),
                ignore_eos=ignore_eos and fmt is None,
                response_format=fmt,
                logprobs=logprobs,
            ),
        )
        try:
            async for reply in stub.Generate(request, timeout=120):
                if reply.HasField("delta"):
                    deltas.append(reply.delta.text)
                    scores += [
                        (lp.chosen.token_id, lp.chosen.logprob) for lp in reply.delta.logprobs
                    ]
                    if len(deltas) in at and action is not None:
                        await action()
                else:
                    summary = reply.summary
        except grpc.aio.AioRpcError as exc:
            return Streamed(deltas, summary, exc, scores)
    return Streamed(deltas, summary, None, scores)


async def serving_decode_node(mesh: MigrationMesh, names: tuple[str, ...] = DECODE_NODES) -> str:
    """The decode node of these generating now (the router picks by health and load, so
    the test asks the nodes instead of assuming)."""
    for name in names:
        if mesh.processes.procs[name].poll() is not None:
            continue
        address = mesh.processes.topology.node(name).address
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = node_pb2_grpc.NodeServiceStub(channel)
                info = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            continue  # stopped
        if info.slots_busy:
            return name
    raise AssertionError("no decode node is generating")


def kill_serving(
    mesh: MigrationMesh,
    how: signal.Signals,
    killed: list[str],
    also: tuple[str, ...] = (),
    names: tuple[str, ...] = DECODE_NODES,
) -> Callable[[], Awaitable[None]]:
    async def action() -> None:
        name = await serving_decode_node(mesh, names)
        for victim in (name, *also):
            os.kill(mesh.pid(victim), how)
            killed.append(victim)

    return action


@asynccontextmanager
async def interrupted(
    mesh: MigrationMesh,
    how: signal.Signals,
    at: frozenset[int],
    max_tokens: int = LONG,
    stop: tuple[str, ...] = (),
    model: str = "m",
    seed: int | None = None,
    also: tuple[str, ...] = (),
    fmt: types_pb2.ResponseFormat | None = None,
    logprobs: int | None = None,
) -> AsyncIterator[tuple[Streamed, Streamed, list[str]]]:
    """The same request uninterrupted, then with the generating decode node (and the nodes
    in `also`) killed or stopped after each number of deltas in `at`; the nodes are
    restarted afterwards."""
    args: dict[str, Any] = {"stop": stop, "model": model, "seed": seed, "fmt": fmt}
    args["logprobs"] = logprobs
    alone = await stream(mesh.router, max_tokens, **args)
    assert alone.error is None and alone.summary is not None and not alone.summary.migrations
    killed: list[str] = []
    try:
        action = kill_serving(mesh, how, killed, also)
        got = await stream(mesh.router, max_tokens, at, action, **args)
        yield alone, got, killed
    finally:
        await mesh.restart(*killed)


def same_answer(alone: Streamed, got: Streamed) -> router_pb2.GenerateSummary:
    assert got.error is None, got.error
    assert "".join(got.deltas) == "".join(alone.deltas)  # nothing repeated, nothing skipped
    assert got.summary is not None and alone.summary is not None
    assert got.summary.completion_tokens == alone.summary.completion_tokens
    assert got.summary.finish_reason == alone.summary.finish_reason
    return got.summary


@pytest.mark.parametrize("model", ["m", VIA_DECODE])
async def test_a_killed_decode_node_is_replaced_mid_answer_with_the_same_text(
    migration_mesh: MigrationMesh, model: str
) -> None:
    at = frozenset({5})
    async with interrupted(migration_mesh, signal.SIGKILL, at, model=model) as (alone, got, killed):
        (m,) = same_answer(alone, got).migrations
    assert m.failed_node == killed[0] and m.resumed_on not in ("", killed[0])
    assert m.code == "UNAVAILABLE" and m.tokens_delivered >= 5
    assert m.resume_duration.ToNanoseconds() > 0
    if model == VIA_DECODE:  # the node taking over evaluated prompt and tokens itself
        assert m.via_prefill_node == "" and m.reason == "migrate_via = decode"
    else:  # the estimate chose, and says how
        assert m.reason.startswith("auto: ") and "delivered tokens" in m.reason


async def test_logprobs_go_on_across_a_migration(migration_mesh: MigrationMesh) -> None:
    """Each token's log probability arrives once, across a decode node's death: those of
    the tokens delivered before it are not sent again, the new node's follow."""
    at = frozenset({5})
    async with interrupted(migration_mesh, signal.SIGKILL, at, logprobs=1) as (alone, got, _):
        same_answer(alone, got)
    assert got.summary is not None and len(got.logprobs) == got.summary.completion_tokens
    assert [t for t, _ in got.logprobs] == [t for t, _ in alone.logprobs]
    assert [v for _, v in got.logprobs] == pytest.approx([v for _, v in alone.logprobs], abs=1e-3)


async def test_a_hung_decode_node_is_replaced_after_its_stage_deadline(
    migration_mesh: MigrationMesh,
) -> None:
    async with interrupted(migration_mesh, signal.SIGSTOP, frozenset({5})) as (alone, got, killed):
        (m,) = same_answer(alone, got).migrations
    assert m.failed_node == killed[0] and m.code == "DEADLINE_EXCEEDED"


async def test_two_failures_then_success_and_a_third_exhausts_the_migrations(
    migration_mesh: MigrationMesh,
) -> None:
    async with interrupted(migration_mesh, signal.SIGKILL, frozenset({5, 15})) as (a, got, killed):
        assert [m.failed_node for m in same_answer(a, got).migrations] == killed
    assert len(killed) == 2
    at = frozenset({5, 15, 25})
    async with interrupted(migration_mesh, signal.SIGKILL, at) as (alone, got, killed):
        assert got.error is not None and got.error.code() == grpc.StatusCode.UNAVAILABLE
    details = got.error.details() or ""
    assert "after 2 migrations" in details and "text deltas were delivered" in details
    assert len(got.deltas) >= 25 and len(killed) == 3
    assert "".join(alone.deltas).startswith("".join(got.deltas))


async def test_max_tokens_and_stop_strings_hold_across_a_migration(
    migration_mesh: MigrationMesh,
) -> None:
    stop = (late_word((await stream(migration_mesh.router, 60)).deltas, 12),)
    async with interrupted(
        migration_mesh, signal.SIGKILL, frozenset({4}), max_tokens=60, stop=stop
    ) as (alone, got, _):
        summary = same_answer(alone, got)
    assert stop[0] not in "".join(got.deltas) and summary.completion_tokens <= 60
    assert summary.finish_reason == types_pb2.FINISH_REASON_STOP
    assert len(summary.migrations) == 1


# Twelve number words at most: the JSON closes well within LONG tokens.
NUMBERS = types_pb2.ResponseFormat(
    type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
    json_schema=json.dumps(
        {
            "type": "object",
            "properties": {
                "numbers": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 10},
                    "minItems": 6,
                    "maxItems": 12,
                }
            },
            "required": ["numbers"],
        }
    ),
)


@pytest.mark.parametrize(("model", "seed"), [("m", None), (VIA_DECODE, None), ("m", 11)])
async def test_a_constrained_answer_stays_constrained_across_a_migration(
    migration_mesh: MigrationMesh, model: str, seed: int | None
) -> None:
    """The node taking over rebuilds the grammar's state from the delivered tokens (the
    prefill node's first token, the replayed ones): the same JSON as uninterrupted."""
    async with interrupted(
        migration_mesh, signal.SIGKILL, frozenset({5}), model=model, seed=seed, fmt=NUMBERS
    ) as (alone, got, _):
        summary = same_answer(alone, got)
    assert len(summary.migrations) == 1
    assert summary.finish_reason == types_pb2.FINISH_REASON_STOP
    numbers = json.loads("".join(got.deltas))["numbers"]
    assert 6 <= len(numbers) <= 12 and all(len(n) <= 10 for n in numbers)


RUN_TESTS = types_pb2.ToolDefinition(
    name="run_tests",
    description="Run the student's tests on their code.",
    parameters_json_schema=json.dumps(
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "maxLength": 120},
                "names": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
            },
            "required": ["code", "names"],
        }
    ),
)


async def tool_call_stream(
    router: str,
    action: Callable[[], Awaitable[None]] | None = None,
    seed: int | None = None,
    model: str = "m",
    max_tokens: int = LONG,
) -> tuple[list[types_pb2.ToolCallDelta], router_pb2.GenerateSummary, int]:
    """A named call of run_tests through the router: its call pieces, the summary and the
    deltas seen; action() runs after the 5th delta."""
    request = router_pb2.GenerateRequest(
        model=model,
        messages=[
            types_pb2.ChatMessage(
                role="user", content="Run the tests of: def add(a, b): return a - b"
            )
        ],
        sampling=types_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if seed is None else 0.9,
            seed=seed,
            tools=types_pb2.ToolSet(
                definitions=[RUN_TESTS],
                choice=types_pb2.TOOL_CHOICE_FUNCTION,
                function_name="run_tests",
            ),
        ),
    )
    pieces: list[types_pb2.ToolCallDelta] = []
    summary = None
    deltas = 0
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        async for reply in stub.Generate(request, timeout=120):
            if reply.HasField("summary"):
                summary = reply.summary
                continue
            deltas += 1
            pieces += reply.delta.tool_calls
            if deltas == 5 and action is not None:
                await action()
    assert summary is not None
    return pieces, summary, deltas


@pytest.mark.parametrize("seed", [None, 5])
async def test_a_tool_call_goes_on_across_a_migration(
    migration_mesh: MigrationMesh, seed: int | None
) -> None:
    """The node taking over feeds the delivered tokens' text to its call parser (and the
    grammar): the same call as uninterrupted, once."""
    alone, alone_summary, deltas = await tool_call_stream(migration_mesh.router, seed=seed)
    assert deltas > 5 and not alone_summary.migrations
    killed: list[str] = []
    try:
        kill = kill_serving(migration_mesh, signal.SIGKILL, killed)
        got, summary, _ = await tool_call_stream(migration_mesh.router, kill, seed)
    finally:
        await migration_mesh.restart(*killed)
    assert killed and len(summary.migrations) == 1
    assert summary.finish_reason == types_pb2.FINISH_REASON_TOOL_CALLS
    assert [(p.index, p.name, p.arguments_json) for p in got] == [
        (p.index, p.name, p.arguments_json) for p in alone
    ]
    assert [p.name for p in got if p.name] == ["run_tests"]
    arguments = json.loads("".join(p.arguments_json for p in got))
    assert set(arguments) == {"code", "names"}


class Verdict(BaseModel):
    verdict: Literal["correct", "wrong"]
    reasons: list[str] = Field(min_length=2, max_length=3)


async def test_the_ollama_and_openai_clients_get_valid_json_across_a_migration(
    migration_mesh: MigrationMesh,
) -> None:
    """The grader's own clients, streaming a pydantic-schema'd answer while the decode node
    serving it is killed: the answer goes on elsewhere, the same as uninterrupted."""
    router = migration_mesh.processes.topology.router
    host = f"http://{router.host}:{router.http_port}"
    messages: Any = [{"role": "user", "content": "Is 2 + 2 = 5? Give reasons."}]
    options = {"temperature": 0, "num_predict": 200}
    client = ollama.AsyncClient(host=host)
    schema = Verdict.model_json_schema()
    alone = await client.chat(model="m", messages=messages, format=schema, options=options)
    killed: list[str] = []
    kill = kill_serving(migration_mesh, signal.SIGKILL, killed)
    parts = []
    try:
        stream = await client.chat(
            model="m", messages=messages, format=schema, options=options, stream=True
        )
        async for part in stream:
            parts.append(part.message.content or "")
            if len(parts) == 4:
                await kill()
        assert killed and "".join(parts) == alone.message.content
        Verdict.model_validate_json("".join(parts))

        oa = openai.AsyncOpenAI(base_url=f"{host}/v1", api_key="x", max_retries=0)
        args: Any = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 200}
        whole = await oa.chat.completions.parse(response_format=Verdict, **args)
        await migration_mesh.restart(*killed)
        async with oa.chat.completions.stream(response_format=Verdict, **args) as events:
            seen = 0
            async for event in events:
                if event.type == "content.delta":
                    seen += 1
                    if seen == 4:
                        await kill()
            final = await events.get_final_completion()
        assert len(killed) == 2
        assert final.choices[0].message.parsed == whole.choices[0].message.parsed
        assert isinstance(final.choices[0].message.parsed, Verdict)
    finally:
        await migration_mesh.restart(*killed)


@pytest.fixture(scope="module")
def takeover_mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[MigrationMesh, FakeOllama]]:
    """One embedded decode node, then the route's direct_ollama step (an Ollama server in
    the test)."""
    folder = tmp_path_factory.mktemp("takeover")
    ollama = FakeOllama(models=("m",)).start()
    parts = [
        router_node(),
        engine_node("decode-x", "decode", 1, slots=2),
        route("m", [], ["decode-x"], chain=["decode_only", "direct_ollama"], ollama_url=ollama.url),
    ]
    try:
        with running_mesh(folder, parts) as processes:
            yield MigrationMesh(processes), ollama
    finally:
        ollama.stop()


async def test_a_killed_embedded_node_hands_over_to_direct_ollama_with_raw_generate(
    takeover_mesh: tuple[MigrationMesh, FakeOllama],
) -> None:
    mesh, ollama = takeover_mesh

    async def kill() -> None:
        os.kill(mesh.pid("decode-x"), signal.SIGKILL)

    # Ollama has no ignore_eos (a node refuses it): the answer to this prompt runs long.
    for _ in range(3):
        got = await stream(mesh.router, 40, frozenset({5}), kill, ignore_eos=False)
        assert got.error is None and got.summary is not None, got.error
        if got.summary.migrations:
            break
        # The node had sent all 40 tokens before the kill landed (a loaded machine delivers
        # late): the run tells nothing of a takeover; again, with the node back.
        await mesh.restart("decode-x")
    summary = got.summary
    assert summary is not None
    (m,) = summary.migrations
    assert m.failed_node == "decode-x" and m.resumed_on == ollama.url
    # The embedded node evaluated the prompt text as it is (no template), so Ollama gets it
    # raw, with the text delivered appended, and only the tokens still allowed.
    body = ollama.last("/api/generate")
    assert body["raw"] is True and body["prompt"].startswith(PROMPT + "".join(got.deltas[:5]))
    received = body["prompt"][len(PROMPT) :]
    assert "".join(got.deltas).startswith(received)
    assert body["options"]["num_predict"] == 40 - m.tokens_delivered
    # What followed is exactly what Ollama generated from there: nothing twice.
    made = "".join(WordModel().run(body["prompt"], body["options"]).pieces)
    assert "".join(got.deltas) == received + made
    assert summary.completion_tokens == 40


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
async def test_the_prefill_node_evaluates_a_migrated_generation_for_the_new_decode_node(
    migration_mesh: MigrationMesh, seed: int | None
) -> None:
    """migrate_via = "prefill": the prefill node evaluates the prompt and the tokens
    delivered, the decode node taking over loads their KV state and goes on; the caller's
    text is that of an uninterrupted run, greedy or seeded."""
    at = frozenset({5})
    async with interrupted(migration_mesh, signal.SIGKILL, at, model=VIA_PREFILL, seed=seed) as (
        alone,
        got,
        killed,
    ):
        (m,) = same_answer(alone, got).migrations
    assert m.failed_node == killed[0] and m.resumed_on not in ("", killed[0])
    assert m.via_prefill_node == "prefill-m" and m.reason == "migrate_via = prefill"


async def test_a_failed_prefill_node_leaves_the_decode_node_to_evaluate_it_itself(
    migration_mesh: MigrationMesh,
) -> None:
    """The prefill node dies with the decode node: the node taking over evaluates the prompt
    and the delivered tokens itself, and the summary says why."""
    at = frozenset({5})
    async with interrupted(
        migration_mesh, signal.SIGKILL, at, model=VIA_PREFILL, also=("prefill-m",)
    ) as (alone, got, killed):
        (m,) = same_answer(alone, got).migrations
    assert killed[1] == "prefill-m" and m.via_prefill_node == ""
    # Why, either way the router learnt it: the way through prefill-m failed, or (when a
    # health check, every 0.5 s, found it gone first) no prefill node was left to take.
    failed_way = "prefill-m's way failed (UNAVAILABLE" in m.reason and m.resumed_on in m.reason
    assert failed_way or "has no available llama_cpp prefill node" in m.reason, m.reason


CODE_LINE = (
    "def step_{i}(values, factor={f}):\n    return [v * factor for v in values if v > {t}]\n"
)
# 775 tokens: more than one n_batch piece (512), and 768 of them in whole 64-token blocks.
CODE_PROMPT = "Review this code and list its bugs.\n" + "".join(
    CODE_LINE.format(i=i, f=i % 7, t=i * 3) for i in range(26)
)


async def text_of(generation: Generation) -> list[TextChunk]:
    return [item async for item in generation if isinstance(item, TextChunk)]


async def test_a_continuation_cuts_the_prompt_where_the_original_did() -> None:
    """The original evaluated the prompt in pieces [0, 512) and [512, 775), and its prefix
    cache kept 768 tokens. A continuation taking all 768 from the cache would evaluate
    [768, 775) alone: other numbers. Told where the original's pieces started
    (prompt_cached_tokens), it takes 512 and evaluates [512, 775) again: the very same KV,
    byte for byte; and the rest of the answer, through either node, is the original's."""
    engine = await open_engine(n_ctx=2048, n_threads=2, prefix_cache_tokens=2048)
    try:
        sampling = Sampling(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompt = Prompt(text=CODE_PROMPT)
        original = await engine.prefill(prompt, sampling)
        assert original.prompt_tokens == 775 and original.cached_prompt_tokens == 0
        first = Continuation((original.first_token_id,), "", first_token_from_prefill=True)
        aligned = await engine.prefill(
            prompt, sampling, (), dataclasses.replace(first, prompt_cached_tokens=0)
        )
        assert aligned.cached_prompt_tokens == 512
        assert bytes(aligned.kv_state) == bytes(original.kv_state)
        unaligned = await engine.prefill(prompt, sampling, (), first)
        assert unaligned.cached_prompt_tokens == 768
        assert bytes(unaligned.kv_state) != bytes(original.kv_state)

        whole = await text_of(
            engine.continue_from_state(original.kv_state, source_of(engine, original), sampling)
        )
        ids, delivered, rest = split_after(whole, 10)
        continuation = Continuation(
            tuple(ids), delivered, first_token_from_prefill=True, prompt_cached_tokens=0
        )
        # The node taking over evaluates prompt and tokens itself...
        alone = await text_of(engine.generate(prompt, sampling, continuation))
        assert "".join(c.text for c in alone) == rest
        # ...or a prefill node does.
        out = await engine.prefill(prompt, sampling, (), continuation)
        assert out.cached_prompt_tokens == 512
        via = await text_of(
            engine.continue_from_state(out.kv_state, source_of(engine, out), sampling, continuation)
        )
        assert "".join(c.text for c in via) == rest
        with pytest.raises(InvalidArgument, match=r"continuation\.prompt_cached_tokens"):
            await engine.prefill(
                prompt, sampling, (), dataclasses.replace(continuation, prompt_cached_tokens=775)
            )
    finally:
        await engine.close()
