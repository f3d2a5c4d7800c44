"""Only the uncached delta moves: a decode node that holds a prompt's first blocks gets only
the rest of its KV state; the prefill node sends requests sharing a prefix to the decode
node that holds it, unless it is busy or unhealthy; a node that lost its cache gets the
whole state instead."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import llama_cpp
import pytest
import pytest_asyncio

from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc, router_pb2, router_pb2_grpc
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses
from tests.conftest import MODEL as MODEL_FILE
from tests.conftest import (
    N_CTX,
    ROOT,
    engine_node,
    route,
    router_node,
    router_stub,
    running_mesh,
)
from tests.streams import collect, request
from tests.test_prefix_cache import RUBRIC, SUBMISSIONS, SamePieces

MODEL = "m"
DECODE_ONLY = "m-decode-only"


@pytest.fixture(scope="module")
def delta_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    folder: Path = tmp_path_factory.mktemp("kv-delta")
    parts = [
        "[mesh]\ncooldown_s = 0.5\nhealth_check_every_s = 0.5\n",
        router_node(),
        engine_node("prefill-d", "prefill", 1, slots=2),
        engine_node("decode-d1", "decode", 1, slots=1),
        engine_node("decode-d2", "decode", 1, slots=1),
        route(MODEL, ["prefill-d"], ["decode-d1", "decode-d2"], chain=["disaggregated"]),
        route(DECODE_ONLY, [], ["decode-d1", "decode-d2"], chain=["decode_only"]),
    ]
    with running_mesh(folder, parts) as processes:
        yield processes


@pytest_asyncio.fixture
async def router(
    delta_mesh: MeshProcesses,
) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    async with router_stub(delta_mesh) as stub:
        yield stub


async def wait_busy(mesh: MeshProcesses, node: str) -> None:
    """Until the node reports a slot in use."""
    async with grpc.aio.insecure_channel(mesh.topology.node(node).address) as channel:
        stub = node_pb2_grpc.NodeServiceStub(channel)
        info = node_pb2.GetNodeInfoRequest()
        while not (await stub.GetNodeInfo(info)).slots_busy:  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.05)


async def grade(
    router: router_pb2_grpc.RouterServiceAsyncStub, submission: str
) -> tuple[str, router_pb2.GenerateSummary]:
    got = await collect(router.Generate(request(MODEL, RUBRIC + submission, 16)))
    assert got.summary is not None
    return got.text, got.summary


@pytest.fixture(scope="module")
def one_thread_llm() -> llama_cpp.Llama:
    """Single-process llama-cpp-python as the nodes run it: one thread (a single row's
    attention over more than 256 cells splits the cells between threads, and so rounds
    otherwise with two)."""
    return llama_cpp.Llama(
        model_path=str(resolve_model_path(MODEL_FILE, ROOT)),
        n_ctx=N_CTX,
        n_threads=1,
        n_batch=512,
        flash_attn=True,
        verbose=False,
    )


# Twenty ~1,100-token prompts and their references: ~3 minutes here, over 5 on a CPU without
# AVX2 (a build without -march=native).
@pytest.mark.timeout(900)
async def test_twenty_requests_move_only_the_delta_and_keep_their_texts(
    router: router_pb2_grpc.RouterServiceAsyncStub, one_thread_llm: llama_cpp.Llama
) -> None:
    reference_llm = one_thread_llm

    def tokenize(text: str) -> list[int]:
        return reference_llm.tokenize(text.encode(), add_bos=True, special=True)

    reference = SamePieces(reference_llm, tokenize(RUBRIC + SUBMISSIONS[0]))
    first: router_pb2.GenerateSummary | None = None
    for i, submission in enumerate(SUBMISSIONS):
        text, s = await grade(router, submission)
        assert s.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
        if first is None:
            first = s  # the whole state moves, and both nodes keep the rubric
            assert s.cached_prompt_tokens == s.decode_cached_prompt_tokens == 0
            assert s.kv_transfer_bytes == s.kv_state_bytes > 0
        else:
            # The prefill node evaluated only the suffix, and sent only the cells the decode
            # node does not hold, to the decode node that holds the rubric.
            assert s.decode_node == first.decode_node
            assert s.cached_prompt_tokens >= 960 and s.decode_cached_prompt_tokens >= 960
            assert s.kv_transfer_bytes <= 0.2 * s.kv_state_bytes, (i, s.kv_transfer_bytes)
        # The same text as one process evaluating the prompt in the same pieces: the cached
        # positions as the first prompt did, then the rest.
        assert text == reference.text(tokenize(RUBRIC + submission), s.cached_prompt_tokens), i


async def test_the_node_holding_the_prefix_is_passed_over_while_busy(
    router: router_pb2_grpc.RouterServiceAsyncStub, delta_mesh: MeshProcesses
) -> None:
    _, s = await grade(router, SUBMISSIONS[1])
    holder = s.decode_node
    # One slot each: a long answer sharing the rubric goes to the holder and keeps it busy.
    long = asyncio.create_task(
        collect(router.Generate(request(MODEL, RUBRIC + SUBMISSIONS[1], 400, ignore_eos=True)))
    )
    try:
        await wait_busy(delta_mesh, holder)
        _, s = await grade(router, SUBMISSIONS[2])
    finally:
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
    assert s.decode_node != holder
    assert s.kv_transfer_bytes == s.kv_state_bytes  # the other node held nothing


async def test_the_node_holding_the_prefix_is_passed_over_while_unhealthy(
    router: router_pb2_grpc.RouterServiceAsyncStub, delta_mesh: MeshProcesses
) -> None:
    _, s = await grade(router, SUBMISSIONS[5])
    holder = s.decode_node
    other = "decode-d2" if holder == "decode-d1" else "decode-d1"
    proc = delta_mesh.procs[holder]
    os.kill(proc.pid, signal.SIGSTOP)  # hung: its health checks time out
    try:
        await asyncio.sleep(3.0)
        _, s = await grade(router, SUBMISSIONS[6])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert s.decode_node == other and not s.failed_attempts
    await asyncio.sleep(3.0)  # the router sees it serving again


async def test_a_decode_node_that_lost_its_cache_gets_the_whole_state(
    router: router_pb2_grpc.RouterServiceAsyncStub, delta_mesh: MeshProcesses
) -> None:
    # Both decode nodes hold the rubric now (the test before); restart the preferred one:
    # the router still believes it holds it.
    name = "decode-d1"
    proc = delta_mesh.procs[name]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    await delta_mesh.restart_node(name)
    _, s = await grade(router, SUBMISSIONS[3])
    # The router still believed the restarted node held the rubric, so the prefill node sent
    # it only the delta; it said it no longer holds the prefix (ABORTED), the router forgot
    # what it believed of it and prefilled again: the other holder got the delta.
    (aborted,) = s.failed_attempts
    assert (aborted.code, aborted.node) == ("ABORTED", name)
    assert "no longer holds the prompt's first 1024 tokens" in aborted.message
    assert s.decode_node == "decode-d2" and s.kv_transfer_bytes < 0.2 * s.kv_state_bytes
    # And the restarted node holds the rubric again after its next full state.
    _, again = await grade(router, SUBMISSIONS[4])
    assert not again.failed_attempts


async def test_decode_only_requests_go_to_the_node_that_served_their_prefix(
    router: router_pb2_grpc.RouterServiceAsyncStub, delta_mesh: MeshProcesses
) -> None:
    rubric = RUBRIC.replace("Python", "Rust").replace("PEP 8", "rustfmt")  # cached nowhere
    # The preferred node busy with a long answer: the rubric's first request goes to the
    # other one.
    long = asyncio.create_task(
        collect(router.Generate(request(DECODE_ONLY, "Count:", 400, ignore_eos=True)))
    )
    try:
        await wait_busy(delta_mesh, "decode-d1")
        first = await collect(router.Generate(request(DECODE_ONLY, rubric + SUBMISSIONS[0], 4)))
    finally:
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
    assert first.summary is not None and first.summary.decode_node == "decode-d2"
    assert first.summary.cached_prompt_tokens == 0
    # Both free now: the next one sharing the rubric goes where the rubric is, not to the
    # preferred node, and evaluates only what follows it.
    got = await collect(router.Generate(request(DECODE_ONLY, rubric + SUBMISSIONS[1], 4)))
    assert got.summary is not None and got.summary.decode_node == "decode-d2"
    assert got.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    assert got.summary.cached_prompt_tokens >= 960
