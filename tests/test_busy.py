"""A mesh with no room answers busy at once (a route that waits at most 0.2 s for a slot;
or a queue that would outlast the budget), says when to try again, and the clients do:
RESOURCE_EXHAUSTED with the trailing metadata retry-after-ms on gRPC, 429 (OpenAI) and 503
(Ollama) with Retry-After on HTTP; MeshClient and the openai client try again as told and
finish, nothing lost."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest

from disagg_mesh.client import AsyncMeshClient
from disagg_mesh.proto.v1 import router_pb2_grpc
from disagg_mesh.server.common.engines.sim.engine import prompt_tokens
from disagg_mesh.server.common.engines.sim.profile import load_profile
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from disagg_mesh.server.common.types import Prompt
from tests.conftest import engine_node, node_entry, route, router_node, running_mesh
from tests.streams import collect, request

MODEL = "m"
LONG = 400  # tokens: the one slot stays busy for a few seconds


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    parts = [
        router_node(http_port=free_port()),
        engine_node("p", "prefill", slots=1, max_queue=0),
        engine_node("d", "decode", slots=1, max_queue=0),
        route(MODEL, ["p"], ["d"], chain=["disaggregated"], queue_budget_s=0.2),
    ]
    with running_mesh(tmp_path_factory.mktemp("busy"), parts) as processes:
        yield processes


def http_base(mesh: MeshProcesses) -> str:
    return f"http://127.0.0.1:{mesh.topology.router.http_port}"


async def busy_for_a_while(stub: Any) -> asyncio.Task[Any]:
    """A long generation holding the decode node's one slot (started, first text in)."""
    task = asyncio.create_task(
        collect(stub.Generate(request(MODEL, "Count:", LONG, ignore_eos=True)))
    )
    await asyncio.sleep(1.0)
    return task


async def test_a_full_mesh_answers_busy_at_once_and_says_when_on_grpc_and_http(
    mesh: MeshProcesses,
) -> None:
    async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        holder = await busy_for_a_while(stub)
        call = stub.Generate(request(MODEL, "Hello", 4))
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await collect(call)
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(busy.value.trailing_metadata() or ())["retry-after-ms"] == "1000"
        async with httpx.AsyncClient(base_url=http_base(mesh), timeout=30) as http:
            openai_door = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
            )
            ollama_door = await http.post(
                "/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False}
            )
        assert openai_door.status_code == 429, (openai_door.status_code, openai_door.text)
        assert (openai_door.status_code, openai_door.headers["Retry-After"]) == (429, "1")
        assert (ollama_door.status_code, ollama_door.headers["Retry-After"]) == (503, "1")
        assert (await holder).summary.completion_tokens == LONG


async def test_the_clients_try_again_when_told_and_finish(mesh: MeshProcesses) -> None:
    async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        holder = await busy_for_a_while(stub)
        async with AsyncMeshClient(mesh.topology.router.address, timeout=120) as client:
            calls = [
                client.generate(MODEL, f"Say {i}.", max_tokens=4, ignore_eos=True) for i in "abc"
            ]
            results = await asyncio.gather(*calls)
        assert [r.metrics.completion_tokens for r in results] == [4, 4, 4]
        await holder
        holder = await busy_for_a_while(stub)
        door = openai.AsyncOpenAI(base_url=f"{http_base(mesh)}/v1", api_key="x", max_retries=8)
        answer = await door.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert answer.choices[0].message.content is not None
        await holder


WORDS = "rubric essay student answer function test grade style clear loop value list".split()
PREFILL_LIMIT_S = 1.5
PROBE_WORDS = 100


@pytest.fixture(scope="module")
def one_prefill_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    """One prefill slot, a 1.5 s prefill stage limit: five prompts at once take longer
    than that to evaluate in all, each alone well under it."""
    parts = [
        "[mesh]\ncooldown_s = 30\n",
        router_node(),
        engine_node("p", "prefill", slots=1),
        engine_node("d", "decode"),
        route(MODEL, ["p"], ["d"], prefill_deadline_s=PREFILL_LIMIT_S),
    ]
    with running_mesh(tmp_path_factory.mktemp("one-slot"), parts) as processes:
        yield processes


async def test_a_stage_deadline_counts_the_nodes_work_not_the_wait_for_a_slot(
    one_prefill_slot: MeshProcesses,
) -> None:
    """The router sends a prompt to a node only once it has a free slot: the prefill
    stage's 1.5 s limit then covers the node's work alone, so five prompts at once all go
    disaggregated, none killed by the deadline while it waited, no node cooled down."""

    def words(seed: int, k: int) -> str:
        return " ".join(random.Random(seed).choices(WORDS, k=k))

    async with grpc.aio.insecure_channel(one_prefill_slot.topology.router.address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        # Prompts of 0.3 of the limit each on this machine, as a probe of 100 words says
        # (at most 380 words, ~0.3 s on a 2-core EPYC that evaluates ~400 prompt tokens a
        # second; fewer on a slower one, where 380 words alone outlast the limit).
        probe = await collect(stub.Generate(request(MODEL, words(100, PROBE_WORDS), 2)))
        probe_s = probe.summary.prefill_duration.ToTimedelta().total_seconds()
        k = max(40, min(380, int(PROBE_WORDS * 0.3 * PREFILL_LIMIT_S / probe_s)))
        prompts = [words(i, k) for i in range(5)]
        alone = await collect(stub.Generate(request(MODEL, prompts[0], 2)))
        assert alone.summary.prefill_duration.ToTimedelta().total_seconds() < 1.0
        assert alone.summary.failed_attempts == []
        started = time.perf_counter()
        got = await asyncio.gather(*(collect(stub.Generate(request(MODEL, p, 2))) for p in prompts))
        took = time.perf_counter() - started
    assert took > PREFILL_LIMIT_S  # in all, longer than one stage's limit
    assert [g.summary.failed_attempts for g in got] == [[]] * 5
    assert {g.summary.prefill_node for g in got} == {"p"}
    assert "node cooling down" not in one_prefill_slot.log_tail("router", 10_000)


OVERFULL = "overfull"
BUDGET_S = 4.2
PROBE_TOKENS = 200
# A generation lasts budget/2.5: of a burst, the callers whose turn comes after one or two
# generations are served (the second waits 0.8 of the budget: 25 % to spare for a slower
# generation), the third would wait 1.2 budgets and is refused (20 % to spare for a drain
# rate measured low).
GENERATIONS_IN_BUDGET = 2.5


@pytest.fixture(scope="module")
def overfull(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    """One decode slot serving prompts itself, a 4.2 s queue budget."""
    parts = [
        router_node(http_port=free_port()),
        engine_node("d", "decode", slots=1),
        route(OVERFULL, [], ["d"], chain=["decode_only"], queue_budget_s=BUDGET_S),
    ]
    with running_mesh(tmp_path_factory.mktemp("overfull"), parts) as processes:
        yield processes


async def timed_call(
    stub: Any, prompt: str, tokens: int
) -> tuple[float, grpc.StatusCode, dict[str, str]]:
    """Seconds until the call ended, its code, its trailing metadata."""
    began = time.perf_counter()
    try:
        await collect(stub.Generate(request(OVERFULL, prompt, tokens, ignore_eos=True)))
    except grpc.aio.AioRpcError as exc:
        return time.perf_counter() - began, exc.code(), dict(exc.trailing_metadata() or ())
    return time.perf_counter() - began, grpc.StatusCode.OK, {}


async def test_an_over_full_node_refuses_at_once_what_it_would_serve_too_late(
    overfull: MeshProcesses,
) -> None:
    """A lone call first sets the generation length so that one lasts about 1/2.5 of the
    4.2 s queue budget on this machine (CI's machines differ in speed). Two requests at once
    on one slot: the router learns how fast the slot frees (about one generation). Then
    twelve more at once: those whose wait would pass the budget at that rate are refused at
    once, RESOURCE_EXHAUSTED with a retry-after past 1 s, on gRPC and on both doors; the
    others are served, none refused after waiting. Then the clients' own retries
    (MeshClient, openai) finish every request."""
    address = overfull.topology.router.address
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = router_pb2_grpc.RouterServiceStub(channel)
        alone_s, code, _ = await timed_call(stub, "Count:", PROBE_TOKENS)
        assert code == grpc.StatusCode.OK
        tokens = max(16, round(PROBE_TOKENS * BUDGET_S / GENERATIONS_IN_BUDGET / alone_s))
        first = [asyncio.create_task(timed_call(stub, f"Count {i}:", tokens)) for i in range(2)]
        one_s, code, _ = await first[0]
        assert code == grpc.StatusCode.OK
        calls = [asyncio.create_task(timed_call(stub, f"List {i}:", tokens)) for i in range(12)]
        await asyncio.sleep(0.05)  # queued or refused: the doors meet the same queue
        # Two calls a door: the first to arrive may still find a spot (the burst's last
        # refused call missed one by less than the moments since, on a slow machine), the
        # others come after it and cannot.
        async with httpx.AsyncClient(base_url=http_base(overfull), timeout=60) as http:
            doors = await asyncio.gather(
                *(
                    http.post(
                        "/v1/chat/completions",
                        json={
                            "model": OVERFULL,
                            "max_tokens": 4,
                            "messages": [{"role": "user", "content": "Hi"}],
                        },
                    )
                    for _ in range(2)
                ),
                *(
                    http.post(
                        "/api/generate",
                        json={
                            "model": OVERFULL,
                            "prompt": "Hi",
                            "stream": False,
                            "options": {"num_predict": 4},
                        },
                    )
                    for _ in range(2)
                ),
            )
        burst = await asyncio.gather(*calls)
        rest = await asyncio.gather(*first[1:])  # waited one generation
    assert [code for _, code, _ in rest] == [grpc.StatusCode.OK]
    refused = [(s, meta) for s, code, meta in burst if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [s for s, code, _ in burst if code == grpc.StatusCode.OK]
    assert len(refused) + len(served) == len(burst), burst
    assert len(refused) >= 4 and len(served) >= 1, (one_s, burst)
    assert max(s for s, _ in refused) < 0.5  # at once, not after waiting
    assert min(int(meta["retry-after-ms"]) for _, meta in refused) >= 1000
    openai_codes = [r.status_code for r in doors[:2]]
    ollama_codes = [r.status_code for r in doors[2:]]
    assert sorted(openai_codes + ollama_codes).count(200) <= 1, doors
    assert 429 in openai_codes and set(openai_codes) <= {200, 429}, openai_codes
    assert 503 in ollama_codes and set(ollama_codes) <= {200, 503}, ollama_codes
    for refused_door in doors:
        if refused_door.status_code != 200:
            assert int(refused_door.headers["Retry-After"]) >= 1
    # Of a door's two calls, at most one took the queue's last spot (and may still miss it on
    # a slow machine: refused after waiting its budget); the other was refused at once.
    openai_why = [r.json()["error"]["message"] for r in doors[:2] if r.status_code == 429]
    ollama_why = [r.json()["error"] for r in doors[2:] if r.status_code == 503]
    for why in openai_why + ollama_why:
        assert "node d" in why and ("over-full" in why or "slots busy" in why), why
    assert any("over-full" in why for why in openai_why), openai_why
    assert any("over-full" in why for why in ollama_why), ollama_why
    assert "node cooling down" not in overfull.log_tail("router", 100_000)
    # The clients wait as told and finish.
    async with AsyncMeshClient(address, timeout=300) as client:
        retried = [
            client.generate(OVERFULL, f"Say {i}.", max_tokens=tokens, ignore_eos=True)
            for i in range(12)
        ]
        results = await asyncio.gather(*retried)
    assert [r.metrics.completion_tokens for r in results] == [tokens] * 12


SIM_MODEL = "qwen3-coder:30b"
ROUTERS = 4
PROMPT_S = 0.4  # real seconds a prompt takes on the simulated prefill node
SIM_STAGE_S = 2.5 * PROMPT_S
SLOWER = 0.1  # sim_speedup: ten times slower than the DGX Spark it simulates


def sim_prompt(i: int) -> str:
    """A prompt of its own (nothing cached from another) that the simulated prefill node
    evaluates in about PROMPT_S."""
    speed = load_profile("dgx-spark").model(SIM_MODEL)
    words = f"Submission {i}: def add(a, b): return a - b. "
    tokens = prompt_tokens(Prompt(text=words))
    per_copy_s = speed.prefill_seconds(tokens) / SLOWER
    return words * max(1, round(PROMPT_S / per_copy_s))


ONE_SLOT = "sim/one-slot"


def sim_generation_tokens() -> int:
    """Tokens the simulated decode node generates alone in about PROMPT_S."""
    speed = load_profile("m3-ultra").model(SIM_MODEL)
    return max(2, round(PROMPT_S / (speed.decode_step_seconds(1, 64) / SLOWER)))


@pytest.fixture(scope="module")
def shared_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    """Four routers sharing one simulated prefill node, and one decode node of one slot
    (decode_only), each stage deadline 2.5 prompts (or generations)."""
    routers = [
        router_node().replace('name = "router"', f'name = "router-{i}"') for i in range(ROUTERS)
    ]
    parts = [
        f"[mesh]\nsim_speedup = {SLOWER}\ncooldown_s = 30\n",
        *routers,
        node_entry("spark", "prefill", "sim", SIM_MODEL, hardware="dgx-spark"),
        node_entry("mac", "decode", "sim", SIM_MODEL, hardware="m3-ultra", slots=16),
        node_entry("mac-1", "decode", "sim", SIM_MODEL, hardware="m3-ultra", slots=1),
        route(SIM_MODEL, ["spark"], ["mac"], prefill_deadline_s=SIM_STAGE_S),
        route(ONE_SLOT, [], ["mac-1"], chain=["decode_only"], decode_deadline_s=SIM_STAGE_S),
    ]
    with running_mesh(tmp_path_factory.mktemp("shared-prefill"), parts) as processes:
        yield processes


async def served_without_a_failure(mesh: MeshProcesses, calls: list[Any]) -> list[Any]:
    """The calls sent at once, spread over the routers in turn: every one served, in all
    longer than one stage deadline, with no failed attempt and no node cooled down."""

    async def one(address: str, call: Any) -> Any:
        async with grpc.aio.insecure_channel(address) as channel:
            stub: Any = router_pb2_grpc.RouterServiceStub(channel)
            return await collect(stub.Generate(call))

    addresses = [r.address for r in mesh.topology.routers]
    started = time.perf_counter()
    got = await asyncio.gather(*(one(addresses[i % ROUTERS], c) for i, c in enumerate(calls)))
    assert time.perf_counter() - started > SIM_STAGE_S  # the node was busy longer than that
    assert [g.summary.failed_attempts for g in got] == [[]] * len(calls)
    for i in range(ROUTERS):
        assert "node cooling down" not in mesh.log_tail(f"router-{i}", 10_000)
    return got


async def test_a_stage_deadline_counts_only_the_nodes_work_whoever_else_sends_it_prompts(
    shared_prefill: MeshProcesses,
) -> None:
    """Each of four routers sends the shared prefill node one prompt at a time (all it
    knows of the node is its own calls), so the node holds up to four prompts and evaluates
    them in turn: the last waits about three prompts before its turn, longer in all than the
    stage deadline of 2.5 prompts. The node counts the stage deadline from the prompt's turn
    (the router tells it the wait and the work apart): all twelve requests are served
    disaggregated, no attempt failed, no node cooled down."""
    calls = [request(SIM_MODEL, sim_prompt(i), 2) for i in range(3 * ROUTERS)]
    got = await served_without_a_failure(shared_prefill, calls)
    assert {g.summary.prefill_node for g in got} == {"spark"}


async def test_a_decode_stage_deadline_counts_only_the_nodes_work_whoever_else_sends_it_streams(
    shared_prefill: MeshProcesses,
) -> None:
    """The same with a decode node of one slot: each router sends it one stream at a time
    (it sees the slot free of its own calls), so the node holds up to four and serves them
    in turn; the last waits about three generations, longer in all than the decode stage
    deadline of 2.5. The node counts it from the stream's turn: all eight are served, no
    attempt failed, no node cooled down."""
    tokens = sim_generation_tokens()
    calls = [request(ONE_SLOT, f"Stream {i}:", tokens, ignore_eos=True) for i in range(8)]
    got = await served_without_a_failure(shared_prefill, calls)
    assert [g.summary.completion_tokens for g in got] == [tokens] * len(calls)
