"""Fuzz the router's public RPCs with generated messages (odd unicode, long strings, negative
and extreme numbers): only well-formed gRPC errors come back, and the mesh keeps serving."""

from __future__ import annotations

import asyncio

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from tests.conftest import Mesh
from tests.streams import collect, request

# What a malformed or unlucky request may get; never UNKNOWN or INTERNAL.
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a valid request cut by the 3 s deadline below
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

text = st.text(alphabet=st.characters(codec="utf-8"), max_size=200) | st.sampled_from(
    ["", "qwen3-coder:30b", "gpt-oss:120b", "\u202e\u0000\U0001f600", "x" * 100_000]
)
numbers = st.floats(allow_nan=True, allow_infinity=True, width=32)
messages = st.lists(
    st.builds(types_pb2.ChatMessage, role=text | st.sampled_from(["user", "system"]), content=text),
    max_size=3,
)
sampling = st.builds(
    types_pb2.SamplingParams,
    max_tokens=st.integers(-(2**31), 2**31 - 1) | st.integers(1, 8),
    temperature=st.none() | numbers,
    top_p=st.none() | numbers,
    seed=st.none() | st.integers(0, 2**32 - 1),
    stop=st.lists(text, max_size=10),
)
requests = st.builds(
    router_pb2.GenerateRequest, model=text, prompt=text, messages=messages, sampling=sampling
)


def run(mesh: Mesh, message: router_pb2.GenerateRequest) -> None:
    async def call() -> None:
        async with grpc.aio.insecure_channel(mesh.router_address) as channel:
            stub: object = router_pb2_grpc.RouterServiceStub(channel)
            try:
                await collect(stub.Generate(message, timeout=3))  # type: ignore[attr-defined]
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in ALLOWED, (exc.code(), exc.details())
                assert exc.details(), "an error without a message"

    asyncio.run(call())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(message=requests)
def test_generate_answers_any_message_with_a_well_formed_status(
    mesh: Mesh, message: router_pb2.GenerateRequest
) -> None:
    run(mesh, message)


def test_the_mesh_still_serves_after_the_fuzzing(mesh: Mesh) -> None:
    async def check() -> None:
        async with grpc.aio.insecure_channel(mesh.router_address) as channel:
            stub: object = router_pb2_grpc.RouterServiceStub(channel)
            four = request("qwen3-coder:30b", "def f():", 4, ignore_eos=True)
            got = await collect(stub.Generate(four))  # type: ignore[attr-defined]
            assert got.summary.completion_tokens == 4
            models = await stub.ListModels(router_pb2.ListModelsRequest())  # type: ignore[attr-defined]
            assert models.models

    asyncio.run(check())
    for name, proc in mesh.processes.procs.items():
        assert proc.poll() is None, f"{name} exited"
