"""Killed and hung nodes are routed around, within the user's 5 s failover target, and a
dead node costs at most one failed attempt. Real llama.cpp nodes; the tests run in order."""

from __future__ import annotations

import asyncio
import re
import signal
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from tests.conftest import ROOT, engine_node, route, router_node, router_stub, running_mesh
from tests.streams import Collected, collect, request

MODEL = "qwen3-coder:30b"
FAILOVER_TARGET_S = 5.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    folder: Path = tmp_path_factory.mktemp("failover")
    parts = [
        "[mesh]\ncooldown_s = 30\nhealth_check_every_s = 0.5\n",
        router_node(),
        engine_node("prefill-a", "prefill"),
        engine_node("decode-a", "decode"),
        engine_node("decode-b", "decode"),
        engine_node("decode-c", "decode"),
        route(
            MODEL,
            ["prefill-a"],
            ["decode-a", "decode-b", "decode-c"],
            chain=["disaggregated", "decode_only"],
            decode_deadline_s=3,
        ),
    ]
    with running_mesh(folder, parts) as processes:
        yield processes


@pytest_asyncio.fixture
async def router(mesh: MeshProcesses) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


async def timed(router: router_pb2_grpc.RouterServiceAsyncStub) -> tuple[float, Collected]:
    started = time.perf_counter()
    got = await collect(
        router.Generate(request(MODEL, "def add(a, b):", 8, ignore_eos=True), timeout=60)
    )
    return time.perf_counter() - started, got


async def timed_while_hung(
    router: router_pb2_grpc.RouterServiceAsyncStub, node: subprocess.Popen[bytes]
) -> tuple[float, Collected]:
    """One request while node is stopped (SIGSTOP): it accepts connections, answers nothing."""
    node.send_signal(signal.SIGSTOP)
    try:
        return await timed(router)
    finally:
        node.send_signal(signal.SIGCONT)


async def baseline(router: router_pb2_grpc.RouterServiceAsyncStub) -> float:
    times = [(await timed(router))[0] for _ in range(3)]
    return statistics.median(times)


async def test_killed_decode_node_is_routed_around_within_5_s(
    mesh: MeshProcesses, router: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    usual = await baseline(router)
    mesh.procs["decode-a"].kill()
    mesh.procs["decode-a"].wait()
    took, got = await timed(router)
    assert got.summary.completion_tokens == 8
    assert took - usual < FAILOVER_TARGET_S, (took, usual)
    failed_nodes = [f.node for f in got.summary.failed_attempts]
    assert failed_nodes in ([], ["decode-a"]), failed_nodes
    # The dead node costs at most that one attempt: later requests skip it.
    for _ in range(3):
        _, later = await timed(router)
        assert not later.summary.failed_attempts
        assert later.summary.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
        assert later.summary.decode_node == "decode-b"


async def test_hung_decode_node_is_routed_around_within_5_s(
    mesh: MeshProcesses, router: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    usual = await baseline(router)
    took, got = await timed_while_hung(router, mesh.procs["decode-b"])
    assert got.summary.completion_tokens == 8
    assert got.summary.decode_node == "decode-c"
    assert took - usual < FAILOVER_TARGET_S, (took, usual)
    for failure in got.summary.failed_attempts:
        assert failure.node == "decode-b" and failure.code == "DEADLINE_EXCEEDED"


async def test_killed_prefill_node_falls_back_to_whole_generation(
    mesh: MeshProcesses, router: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    usual = await baseline(router)
    mesh.procs["prefill-a"].kill()
    mesh.procs["prefill-a"].wait()
    took, got = await timed(router)
    assert got.summary.completion_tokens == 8
    assert got.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    assert took - usual < FAILOVER_TARGET_S, (took, usual)


# -- the prefill stage's retries: a second mesh with two prefill nodes ----------------------


@pytest.fixture(scope="module")
def two_prefill_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    folder: Path = tmp_path_factory.mktemp("failover-prefill")
    parts = [
        "[mesh]\ncooldown_s = 2\nhealth_check_every_s = 5\n",
        router_node(),
        engine_node("prefill-a", "prefill"),
        engine_node("prefill-b", "prefill"),
        engine_node("decode-a", "decode"),
        route(
            MODEL,
            ["prefill-a", "prefill-b"],
            ["decode-a"],
            chain=["disaggregated", "decode_only"],
            prefill_deadline_s=3,
        ),
    ]
    with running_mesh(folder, parts) as processes:
        # The router checks health every 5 s here: let it see every node loaded once, so
        # that the first test's request is routed as the topology says.
        time.sleep(5.5)
        yield processes


@pytest_asyncio.fixture
async def router2(
    two_prefill_mesh: MeshProcesses,
) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    async with router_stub(two_prefill_mesh) as stub:
        yield stub


def failures(got: Collected) -> list[tuple[str, str]]:
    return [(f.node, f.code) for f in got.summary.failed_attempts]


async def test_hung_prefill_node_times_out_and_is_retried_on_the_other(
    two_prefill_mesh: MeshProcesses, router2: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    usual = await baseline(router2)
    took, got = await timed_while_hung(router2, two_prefill_mesh.procs["prefill-a"])
    assert got.summary.completion_tokens == 8
    # Still disaggregated: the stage's own DEADLINE_EXCEEDED is retried on the next node.
    assert got.summary.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert got.summary.prefill_node == "prefill-b"
    assert failures(got) == [("prefill-a", "DEADLINE_EXCEEDED")]
    assert 2.5 < got.summary.failed_attempts[0].duration.ToTimedelta().total_seconds() < 4
    assert took - usual < FAILOVER_TARGET_S, (took, usual)


async def test_killed_prefill_node_is_retried_on_the_other(
    two_prefill_mesh: MeshProcesses, router2: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    await asyncio.sleep(2.5)  # prefill-a's cool-down from the test before ends
    usual = await baseline(router2)
    two_prefill_mesh.procs["prefill-a"].kill()
    two_prefill_mesh.procs["prefill-a"].wait()
    took, got = await timed(router2)
    assert got.summary.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert got.summary.prefill_node == "prefill-b"
    assert failures(got) in ([], [("prefill-a", "UNAVAILABLE")]), failures(got)
    assert took - usual < FAILOVER_TARGET_S, (took, usual)


async def test_hung_last_prefill_node_is_not_retried(
    two_prefill_mesh: MeshProcesses, router2: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    """A hung node would hang again: with no other prefill node, the chain moves on."""
    usual = await baseline(router2)
    took, got = await timed_while_hung(router2, two_prefill_mesh.procs["prefill-b"])
    assert got.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    assert ("prefill-b", "DEADLINE_EXCEEDED") in failures(got)
    assert failures(got).count(("prefill-b", "DEADLINE_EXCEEDED")) == 1
    assert took - usual < FAILOVER_TARGET_S, (took, usual)


# -- topology/local.toml, as `make run` starts it: any one engine node may die --------------


@pytest.fixture(scope="module")
def local_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    """topology/local.toml itself, moved to free ports."""
    text = (ROOT / "topology/local.toml").read_text()
    text = re.sub(
        r"^(port|metrics_port) = \d+", lambda m: f"{m[1]} = {free_port()}", text, flags=re.M
    )
    with running_mesh(tmp_path_factory.mktemp("failover-local"), [text]) as processes:
        yield processes


@pytest.mark.parametrize(
    "victim", ["prefill-qwen", "decode-qwen", "prefill-gpt-oss", "decode-gpt-oss"]
)
async def test_local_topology_serves_both_models_with_any_one_node_killed(
    local_mesh: MeshProcesses, victim: str
) -> None:
    local_mesh.procs[victim].kill()
    local_mesh.procs[victim].wait()
    try:
        async with grpc.aio.insecure_channel(local_mesh.topology.router.address) as channel:
            router = router_pb2_grpc.RouterServiceStub(channel)
            for model in ("qwen3-coder:30b", "gpt-oss:120b"):
                got = await collect(
                    router.Generate(
                        request(model, "def add(a, b):", 6, ignore_eos=True), timeout=60
                    )
                )
                assert got.summary.completion_tokens == 6, (victim, model)
                assert victim not in (got.summary.prefill_node, got.summary.decode_node)
    finally:
        local_mesh.start_node(local_mesh.topology.node(victim))
        await local_mesh.wait_serving(timeout_s=120, names=[victim])
