"""The router prefers a node with a free slot: a request does not queue behind another on
the first node of the list while the next one idles."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from tests.conftest import engine_node, route, router_node, running_mesh


@pytest.fixture(scope="module")
def router_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    parts = [
        "[mesh]\nhealth_check_every_s = 0.3\n",
        router_node(),
        engine_node("decode-a", "decode", 1, slots=1),
        engine_node("decode-b", "decode", 1, slots=1),
        route("m", [], ["decode-a", "decode-b"], chain=["decode_only"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("load"), parts) as processes:
        yield processes.topology.router.address


async def generate(
    stub: router_pb2_grpc.RouterServiceAsyncStub, max_tokens: int, started: asyncio.Event
) -> router_pb2.GenerateSummary:
    request = router_pb2.GenerateRequest(
        model="m",
        prompt="Count from one to one hundred: one, two, three,",
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    async for reply in stub.Generate(request, timeout=120):
        if reply.HasField("delta"):
            started.set()
        else:
            return reply.summary
    raise AssertionError("no summary")


async def test_a_request_goes_to_the_node_with_a_free_slot(router_address: str) -> None:
    await asyncio.sleep(1.0)  # the router has learned each node's slots
    async with grpc.aio.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        long_started, short_started = asyncio.Event(), asyncio.Event()
        long = asyncio.create_task(generate(stub, 300, long_started))
        await long_started.wait()
        short = await generate(stub, 8, short_started)
        assert not long.done()  # it was served beside the long one, not after it
        first = await long
    assert first.decode_node == "decode-a"
    assert short.decode_node == "decode-b"
    # Idle again: the order of preference holds.
    async with grpc.aio.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        again = await generate(stub, 4, asyncio.Event())
    assert again.decode_node == "decode-a"
