"""Bad input, bad KV handles, corrupted KV bytes and deadlines: a clear gRPC status each
time, and the node serves the next request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
import pytest_asyncio

from disagg_mesh.proto.v1 import (
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    types_pb2,
)
from tests import streams
from tests.conftest import Mesh
from tests.streams import collect, greedy, request

PROMPT = "def add(a, b):"
COUNTING = "Count to one thousand: " + ", ".join(str(i) for i in range(1, 40)) + ","


async def expect_error(call: Any, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call
        if hasattr(result, "__aiter__"):
            await collect(result)
        else:
            await result
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    for fragment in fragments:
        assert fragment in details, details
    return details


async def still_serves(
    router: router_pb2_grpc.RouterServiceAsyncStub, model: str = "qwen3-coder:30b"
) -> None:
    got = await collect(router.Generate(request(model, PROMPT, 4, ignore_eos=True)))
    assert got.summary.completion_tokens == 4


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (
            router_pb2.GenerateRequest(model="qwen3-coder:30b", prompt="", sampling=greedy(8)),
            "prompt",
        ),
        (request("qwen3-coder:30b", PROMPT, 0), "sampling.max_tokens"),
        (request("qwen3-coder:30b", PROMPT, -3), "sampling.max_tokens"),
        (request("qwen3-coder:30b", PROMPT, 4097), "sampling.max_tokens"),
        (
            request("qwen3-coder:30b", PROMPT, 8, stream_interval_tokens=-2),
            "sampling.stream_interval_tokens",
        ),
        (
            router_pb2.GenerateRequest(
                model="qwen3-coder:30b",
                prompt=PROMPT,
                sampling=types_pb2.SamplingParams(max_tokens=8, temperature=-0.5),
            ),
            "sampling.temperature",
        ),
        (
            router_pb2.GenerateRequest(
                model="qwen3-coder:30b",
                prompt=PROMPT,
                messages=[types_pb2.ChatMessage(role="user", content="hi")],
                sampling=greedy(8),
            ),
            "prompt",
        ),
        (
            router_pb2.GenerateRequest(
                model="qwen3-coder:30b",
                messages=[types_pb2.ChatMessage(role="robot", content="hi")],
                sampling=greedy(8),
            ),
            "messages[0].role",
        ),
    ],
)
async def test_invalid_arguments_name_the_field(
    router: router_pb2_grpc.RouterServiceAsyncStub, req: router_pb2.GenerateRequest, field: str
) -> None:
    details = await expect_error(router.Generate(req), grpc.StatusCode.INVALID_ARGUMENT)
    assert details.startswith(f"{field}:"), details


async def test_prompt_longer_than_the_context(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    prompt = "word " * 5000
    await expect_error(
        router.Generate(request("qwen3-coder:30b", prompt, 8)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt:",
        "4096",
    )
    await still_serves(router)


async def test_unknown_model_is_not_found(router: router_pb2_grpc.RouterServiceAsyncStub) -> None:
    await expect_error(
        router.Generate(request("llama-9000", PROMPT)),
        grpc.StatusCode.NOT_FOUND,
        "llama-9000",
        "qwen3-coder:30b",
    )
    # No model named is the caller's mistake, not a model the mesh lacks.
    details = await expect_error(
        router.Generate(request("", PROMPT)), grpc.StatusCode.INVALID_ARGUMENT, "qwen3-coder:30b"
    )
    assert details.startswith("model: is required"), details


def kv_request(mesh: Mesh, reply: prefill_pb2.PrefillResponse, **overrides: Any) -> Any:
    address = overrides.pop("prefill_address", mesh.address("prefill-qwen"))
    return streams.kv_request("qwen3-coder:30b", address, reply, **overrides)


async def prefill(
    stub: prefill_pb2_grpc.PrefillServiceAsyncStub, model: str = "qwen3-coder:30b"
) -> Any:
    return await stub.Prefill(
        prefill_pb2.PrefillRequest(model=model, prompt=PROMPT, sampling=greedy(4, ignore_eos=True))
    )


async def test_unknown_kv_handle_is_not_found(
    mesh: Mesh,
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
) -> None:
    reply = await prefill(prefill_qwen)
    await expect_error(
        decode_qwen.Generate(kv_request(mesh, reply, kv_handle="no-such-handle")),
        grpc.StatusCode.NOT_FOUND,
        "no-such-handle",
        "unknown",
    )
    # The real handle still works, and the decode node keeps serving.
    got = await collect(decode_qwen.Generate(kv_request(mesh, reply)))
    assert got.summary.completion_tokens == 4


async def test_reused_kv_handle_is_not_found(
    mesh: Mesh,
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
) -> None:
    reply = await prefill(prefill_qwen)
    await collect(decode_qwen.Generate(kv_request(mesh, reply)))
    await expect_error(
        decode_qwen.Generate(kv_request(mesh, reply)), grpc.StatusCode.NOT_FOUND, "already fetched"
    )


async def test_expired_kv_handle_is_not_found_and_its_bytes_are_freed(
    mesh: Mesh,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    async with grpc.aio.insecure_channel(mesh.address("prefill-short-ttl")) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        reply = await prefill(stub, "test/short-ttl")
        await asyncio.sleep(2.5)  # the node's kv_ttl_s is 1
        await expect_error(
            decode_qwen.Generate(
                kv_request(mesh, reply, prefill_address=mesh.address("prefill-short-ttl"))
            ),
            grpc.StatusCode.NOT_FOUND,
            "expired",
        )
    await still_serves(router, "test/short-ttl")


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("n_ctx_tokens", 2048, "n_ctx is 2048 where the state was made, 4096 on this node"),
        ("type_v", "q8_0", "type_v is 'q8_0' where the state was made, 'f16' on this node"),
        ("flash_attn", False, "flash_attn is off where the state was made, on on this node"),
        ("kv_unified", False, "kv_unified is off where the state was made, on on this node"),
        ("swa_full", False, "swa_full is off where the state was made, on on this node"),
        ("engine_version", "llama-cpp-python/0.3.1", "engine_version is 'llama-cpp-python/0.3.1'"),
    ],
)
async def test_fingerprint_mismatch_is_refused_before_any_transfer(
    mesh: Mesh,
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
    setting: str,
    value: object,
    said: str,
) -> None:
    reply = await prefill(prefill_qwen)
    other = types_pb2.KvFingerprint()
    other.CopyFrom(reply.fingerprint)
    setattr(other, setting, value)
    await expect_error(
        decode_qwen.Generate(kv_request(mesh, reply, fingerprint=other)),
        grpc.StatusCode.FAILED_PRECONDITION,
        said,
    )
    # Nothing was fetched: the handle is still there for a correct request.
    got = await collect(decode_qwen.Generate(kv_request(mesh, reply)))
    assert got.summary.completion_tokens == 4


async def test_wrong_size_is_data_loss(
    mesh: Mesh,
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
) -> None:
    reply = await prefill(prefill_qwen)
    await expect_error(
        decode_qwen.Generate(kv_request(mesh, reply, kv_size_bytes=reply.kv_size_bytes + 1)),
        grpc.StatusCode.DATA_LOSS,
    )


def flip_a_byte(chunks: list[Any]) -> list[Any]:
    data = bytearray(chunks[1].data)
    data[len(data) // 2] ^= 0xFF
    chunks[1].data = bytes(data)
    return chunks


MANGLES: dict[str, Callable[[list[Any]], list[Any]]] = {
    "flipped byte": flip_a_byte,
    "chunk missing": lambda c: [c[0], *c[2:]],
    "chunk duplicated": lambda c: [c[0], c[1], c[1], *c[2:]],
    "chunks reordered": lambda c: [c[0], c[2], c[1], *c[3:]],
    "stream truncated": lambda c: c[:-1],
}


class ManglingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Relays FetchKv from the real prefill node, damaged on the way: garbage on the wire."""

    def __init__(self, upstream: prefill_pb2_grpc.PrefillServiceAsyncStub) -> None:
        self.upstream = upstream
        self.mangle: Callable[[list[Any]], list[Any]] = lambda c: c

    async def Prefill(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "only FetchKv is relayed")

    async def FetchKv(self, request: Any, context: Any) -> AsyncIterator[Any]:
        chunks = [chunk async for chunk in self.upstream.FetchKv(request)]
        assert len(chunks) >= 4, "the test needs a state of several chunks"
        for chunk in self.mangle(chunks):
            yield chunk


@pytest_asyncio.fixture
async def mangling_proxy(mesh: Mesh) -> AsyncIterator[tuple[str, ManglingPrefill]]:
    async with grpc.aio.insecure_channel(mesh.address("prefill-qwen")) as channel:
        server = grpc.aio.server()
        proxy = ManglingPrefill(prefill_pb2_grpc.PrefillServiceStub(channel))
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(proxy, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        yield f"127.0.0.1:{port}", proxy
        await server.stop(None)


@pytest.mark.parametrize("damage", list(MANGLES))
async def test_a_damaged_kv_stream_is_data_loss_and_the_node_keeps_serving(
    mesh: Mesh,
    mangling_proxy: tuple[str, ManglingPrefill],
    prefill_qwen: prefill_pb2_grpc.PrefillServiceAsyncStub,
    decode_qwen: decode_pb2_grpc.DecodeServiceAsyncStub,
    router: router_pb2_grpc.RouterServiceAsyncStub,
    damage: str,
) -> None:
    address, proxy = mangling_proxy
    proxy.mangle = MANGLES[damage]
    # ~250 tokens: a state of 5 chunks of 1 MiB.
    reply = await prefill_qwen.Prefill(
        prefill_pb2.PrefillRequest(
            model="qwen3-coder:30b", prompt=COUNTING * 3, sampling=greedy(4, ignore_eos=True)
        )
    )
    await expect_error(
        decode_qwen.Generate(kv_request(mesh, reply, prefill_address=address)),
        grpc.StatusCode.DATA_LOSS,
    )
    await still_serves(router)


async def test_prefill_stage_deadline(router: router_pb2_grpc.RouterServiceAsyncStub) -> None:
    await expect_error(
        router.Generate(request("test/tight-prefill", PROMPT, 4)),
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "prefill stage",
        "0.001 s stage deadline",
    )
    await still_serves(router)


async def test_decode_stage_deadline(router: router_pb2_grpc.RouterServiceAsyncStub) -> None:
    await expect_error(
        router.Generate(request("test/tight-decode", COUNTING, 2000, ignore_eos=True)),
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "decode stage",
    )
    await still_serves(router)


async def test_callers_deadline(router: router_pb2_grpc.RouterServiceAsyncStub) -> None:
    await expect_error(
        router.Generate(request("qwen3-coder:30b", COUNTING, 2000, ignore_eos=True), timeout=0.3),
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    await still_serves(router)


async def test_caller_cancellation_frees_the_engine(
    router: router_pb2_grpc.RouterServiceAsyncStub,
) -> None:
    """Cancel a long stream after its first delta: the decode engine stops at its next token,
    so the next request on the same nodes is served at once, not after 2,000 tokens."""
    call = router.Generate(request("qwen3-coder:30b", COUNTING, 2000, ignore_eos=True))
    async for reply in call:
        assert reply.HasField("delta")
        break
    call.cancel()
    got = await asyncio.wait_for(
        collect(router.Generate(request("qwen3-coder:30b", PROMPT, 4, ignore_eos=True))), 10
    )
    assert got.summary.completion_tokens == 4
