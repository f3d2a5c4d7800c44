"""Continuous batching through real nodes: many streams share one decode node's context, each
gives the text it gives alone, and a bad request in one slot leaves the others untouched.

The mesh here runs its engines on one thread each (two busy nodes then share this machine's
two cores without starving each other); llama.cpp's CPU attention then computes every row on
its own whatever else is in the batch, so batched text is exactly the text alone (see
engines/llama_cpp/context.py and docs/batching.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from disagg_mesh.proto.v1 import (
    decode_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    types_pb2,
)
from tests.conftest import Mesh, engine_node, route, router_node, running_mesh
from tests.streams import Collected, collect, greedy, request
from tests.test_errors import (
    COUNTING,
    MANGLES,
    ManglingPrefill,
    expect_error,
    kv_request,
    prefill,
)

MODEL = "qwen3-coder:30b"
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Count from one to ten:",
    "Write a haiku about rain.",
    "Explain recursion briefly.",
    "import numpy as np\narr =",
    "Name three prime numbers:",
    "SELECT name FROM users WHERE",
]
MAX_TOKENS = 32
# Every stream here sets ignore_eos: streams that must run long never end at an end token
# (greedy continuations of a tiny model differ between CPUs: on one, "Write a haiku about
# rain." ends at once).


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """This module's own mesh, named like the shared one so its fixtures (router,
    prefill_qwen, decode_qwen) and helpers serve it."""
    parts = [
        router_node(),
        engine_node("prefill-qwen", "prefill", n_threads=1),  # 4 slots, the default
        engine_node("decode-qwen", "decode", n_threads=1),  # 8 slots
        route(MODEL, ["prefill-qwen"], ["decode-qwen"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("batching"), parts) as processes:
        yield Mesh(processes.topology, processes)


async def node_info(mesh: Mesh, node: str) -> node_pb2.GetNodeInfoResponse:
    async with grpc.aio.insecure_channel(mesh.address(node)) as channel:
        return await node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(
            node_pb2.GetNodeInfoRequest()
        )


class BusyWatcher:
    """Polls a node's GetNodeInfo while a test runs; keeps the most slots seen busy."""

    def __init__(self, mesh: Mesh, node: str) -> None:
        self.mesh, self.node = mesh, node
        self.most_busy = 0
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        while True:
            info = await node_info(self.mesh, self.node)
            self.most_busy = max(self.most_busy, info.slots_busy)
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> BusyWatcher:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def all_at_once(
    router: router_pb2_grpc.RouterServiceAsyncStub, requests: list[router_pb2.GenerateRequest]
) -> list[Collected]:
    return list(await asyncio.gather(*(collect(router.Generate(r)) for r in requests)))


async def wait_idle(mesh: Mesh, node: str) -> node_pb2.GetNodeInfoResponse:
    """The node's info once its slots are free again (a stream's slot is freed right after
    its last message, so give it a moment)."""
    deadline = time.monotonic() + 5
    while True:
        info = await node_info(mesh, node)
        idle = (info.slots_busy, info.queue_depth, info.kv_cache_used_bytes) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.05)


async def test_node_info_reports_slots_and_kv_memory(mesh: Mesh) -> None:
    decode = await wait_idle(mesh, "decode-qwen")
    prefill_node = await wait_idle(mesh, "prefill-qwen")
    assert (decode.slots, decode.slots_busy, decode.queue_depth) == (8, 0, 0)
    assert (prefill_node.slots, prefill_node.max_queue) == (4, 16)
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) dims x 2 bytes = 23,040 bytes a token.
    # Every slot's n_ctx, and as much again for the prefix cache (its default).
    assert decode.kv_cache_bytes == (8 + 1) * 4096 * 23_040
    assert prefill_node.kv_cache_bytes == (4 + 1) * 4096 * 23_040
    assert decode.prefix_cache_max_tokens == prefill_node.prefix_cache_max_tokens == 4096


async def test_eight_prompts_at_once_each_give_their_text_alone(
    mesh: Mesh, router: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    requests = [request(MODEL, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    alone = [await collect(router.Generate(r)) for r in requests]
    async with BusyWatcher(mesh, "decode-qwen") as watcher:
        together = await all_at_once(router, requests)
    for prompt, one, many in zip(PROMPTS, alone, together, strict=True):
        assert many.token_ids == one.token_ids, prompt
        assert many.text == one.text
        assert many.summary.decode_node == "decode-qwen"
    # The streams really ran together: several slots busy at once, and every stream had
    # its first text before the first stream finished.
    assert watcher.most_busy >= 4, watcher.most_busy
    assert max(c.first_delta_at for c in together) < min(c.summary_at for c in together)
    assert (await wait_idle(mesh, "decode-qwen")).slots_busy == 0


async def test_constrained_and_free_streams_at_once_each_give_their_text_alone(
    mesh: Mesh, router: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    """Four streams under a JSON grammar and four free ones on one decode node: a slot's
    grammar never touches another slot's tokens."""
    json_object = types_pb2.ResponseFormat(type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT)
    requests = [
        request(MODEL, p, 96, response_format=json_object)
        if i % 2
        else request(MODEL, p, MAX_TOKENS, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    alone = [await collect(router.Generate(r)) for r in requests]
    async with BusyWatcher(mesh, "decode-qwen") as watcher:
        together = await all_at_once(router, requests)
    for i, (one, many) in enumerate(zip(alone, together, strict=True)):
        assert many.token_ids == one.token_ids, PROMPTS[i]
        if i % 2:  # a tiny model's JSON may run long: what closed is an object
            assert many.text.startswith("{")
            if many.summary.finish_reason == types_pb2.FINISH_REASON_STOP:
                assert isinstance(json.loads(many.text), dict)
    assert watcher.most_busy >= 4, watcher.most_busy


async def test_seeded_sampling_gives_the_same_text_alone_and_in_a_batch(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    def seeded(prompt: str) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(
            model=MODEL,
            prompt=prompt,
            sampling=types_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True
            ),
        )

    requests = [seeded(p) for p in PROMPTS[:5]]
    alone = [await collect(router.Generate(r)) for r in requests]
    together = await all_at_once(router, requests)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    # and the seed matters: another seed gives another text for at least one prompt
    other = await collect(
        router.Generate(
            router_pb2.GenerateRequest(
                model=MODEL,
                prompt=PROMPTS[0],
                sampling=types_pb2.SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=0.9, seed=7, ignore_eos=True
                ),
            )
        )
    )
    assert other.token_ids != alone[0].token_ids


@pytest.fixture(scope="module", params=["f16", "q8_0"])
def two_threads(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Mesh]:
    """A pipeline whose engines run two threads each: with an f16 K cache llama.cpp then
    splits a lone row's attention between them once the KV view reaches 512 cells
    (context.py); with a q8_0 K cache (topology/local.toml's) it has no split path, and the
    node runs a lone row on both threads as it is."""
    kv = {"type_k": request.param}
    parts = [
        router_node(),
        engine_node("prefill-wide", "prefill", n_threads=2, **kv),
        engine_node("decode-wide", "decode", n_threads=2, **kv),
        route("wide", ["prefill-wide"], ["decode-wide"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("two-threads"), parts) as processes:
        yield Mesh(processes.topology, processes)


async def test_a_stream_over_a_wide_kv_view_gives_its_text_alone_and_in_company(
    two_threads: Mesh,
) -> None:
    """Prompts of ~450 tokens, so that a stream alone holds cells on both sides of a
    512-cell view: seeded streams one after another (each alone at every step) and all at
    once (together at most steps) give the same tokens."""
    rubric = " ".join(f"Point {i}: the answer names case {i} and tests it." for i in range(36))
    prompts = [f"{rubric}\nSubmission {i}: def f(x): return x * {i}\nFeedback:" for i in range(4)]
    requests = [
        router_pb2.GenerateRequest(
            model="wide",
            prompt=prompt,
            sampling=types_pb2.SamplingParams(
                max_tokens=48, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True
            ),
        )
        for prompt in prompts
    ]
    async with grpc.aio.insecure_channel(two_threads.address("router")) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        alone = [await collect(router.Generate(r)) for r in requests]
        together = await all_at_once(router, requests)
    assert all(c.summary.prompt_tokens > 400 for c in alone), [
        c.summary.prompt_tokens for c in alone
    ]
    for i, (one, many) in enumerate(zip(alone, together, strict=True)):
        assert many.token_ids == one.token_ids, i


async def streams_that_started(
    router: router_pb2_grpc.RouterServiceAsyncStub, prompts: list[str]
) -> tuple[list[asyncio.Task[Collected]], asyncio.Event]:
    """Start one stream per prompt; the event is set once every one has sent text."""
    started = asyncio.Event()
    first: set[int] = set()

    async def one(i: int, prompt: str) -> Collected:
        async def replies() -> AsyncIterator[Any]:
            async for reply in router.Generate(request(MODEL, prompt, 32, ignore_eos=True)):
                if reply.HasField("delta"):
                    first.add(i)
                    if len(first) == len(prompts):
                        started.set()
                yield reply

        return await collect(replies())

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    return tasks, started


@pytest.mark.parametrize(
    "bad", ["corrupt state", "wrong fingerprint", "state of another length", "cancelled caller"]
)
async def test_a_bad_request_in_one_slot_leaves_the_other_streams_alone(
    mesh: Mesh,
    router: router_pb2_grpc.RouterServiceAsyncStub,
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
    bad: str,
) -> None:
    prompts = PROMPTS[:4]
    expected = [
        await collect(router.Generate(request(MODEL, p, 32, ignore_eos=True))) for p in prompts
    ]
    reply = await prefill(prefill_qwen)
    tasks, started = await streams_that_started(router, prompts)
    await asyncio.wait_for(started.wait(), 30)

    if bad == "corrupt state":  # damaged on the wire: refused before the engine sees it
        async with grpc.aio.insecure_channel(mesh.address("prefill-qwen")) as channel:
            server = grpc.aio.server()
            proxy = ManglingPrefill(prefill_pb2_grpc.PrefillServiceStub(channel))
            proxy.mangle = MANGLES["flipped byte"]
            prefill_pb2_grpc.add_PrefillServiceServicer_to_server(proxy, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            big = await prefill_qwen.Prefill(  # 5 chunks of 1 MiB, so one can be damaged
                prefill_pb2.PrefillRequest(model=MODEL, prompt=COUNTING * 3, sampling=greedy(4))
            )
            await expect_error(
                decode_qwen.Generate(kv_request(mesh, big, prefill_address=f"127.0.0.1:{port}")),
                grpc.StatusCode.DATA_LOSS,
            )
            await server.stop(None)
    elif bad == "wrong fingerprint":
        other = types_pb2.KvFingerprint()
        other.CopyFrom(reply.fingerprint)
        other.model_sha256 = "0" * 64
        await expect_error(
            decode_qwen.Generate(kv_request(mesh, reply, fingerprint=other)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "model_sha256 is 000000000000… where the state was made",
        )
    elif bad == "state of another length":  # intact bytes, loaded into a slot, then refused
        await expect_error(
            decode_qwen.Generate(kv_request(mesh, reply, prompt_tokens=reply.prompt_tokens + 3)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "holds",
            "kv.prompt_tokens",
        )
    else:
        call = router.Generate(request(MODEL, "Tell me a long story:", 500, ignore_eos=True))
        async for message in call:
            assert message.HasField("delta")
            break
        call.cancel()

    got = await asyncio.gather(*tasks)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    # The node serves the next request, and every slot is free again.
    assert (await collect(router.Generate(request(MODEL, PROMPTS[5], 4)))).summary
    info = await wait_idle(mesh, "decode-qwen")
    assert (info.slots_busy, info.queue_depth, info.kv_cache_used_bytes) == (0, 0, 0)
