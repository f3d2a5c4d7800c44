"""No single point of failure at the router: a topology with two routers, a client given
both, and the router serving six streams killed (SIGKILL) or frozen (SIGSTOP) mid-answer.
Every answer completes through the other router, token for token the uninterrupted one.
A batch goes on through the other router's HTTP door."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from disagg_mesh import AsyncMeshClient, GenerateCall, Metrics, Unavailable
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port
from tests.conftest import engine_node, route, router_node, running_mesh

MODEL = "grader"
STREAMS = 6
TOKENS = 96


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    folder = tmp_path_factory.mktemp("two-routers")
    parts = [
        router_node(http_port=free_port()).replace('name = "router"', 'name = "router-a"'),
        router_node(http_port=free_port()).replace('name = "router"', 'name = "router-b"'),
        engine_node("prefill", "prefill", slots=STREAMS),
        engine_node("decode", "decode", slots=STREAMS + 2),
        route(MODEL, ["prefill"], ["decode"]),
    ]
    with running_mesh(folder, parts) as processes:
        yield processes


def calls(streams: int, seeded: bool) -> list[GenerateCall]:
    """Greedy, or seeded and sampled, answers of a fixed length."""
    return [
        GenerateCall(
            MODEL,
            prompt=f"Write a short story about robot number {i}:",
            max_tokens=TOKENS,
            temperature=0.8 if seeded else 0.0,
            seed=100 + i,
            ignore_eos=True,
        )
        for i in range(streams)
    ]


def addresses(mesh: MeshProcesses) -> list[str]:
    return [node.address for node in mesh.topology.routers]


async def stream_all(
    client: AsyncMeshClient,
    requests: list[GenerateCall],
    after_deltas: int = 0,
    action: object = None,
) -> list[tuple[str, Metrics]]:
    """Every call at once; `action()` runs once each stream has that many deltas."""
    started = [asyncio.Event() for _ in requests]

    async def one(i: int, call: GenerateCall) -> tuple[str, Metrics]:
        text, metrics, deltas = "", None, 0
        async for item in client.stream(call):
            if isinstance(item, Metrics):
                metrics = item
            elif isinstance(item, str):
                text += item
                deltas += 1
                if deltas == after_deltas:
                    started[i].set()
        assert metrics is not None
        return text, metrics

    async def trigger() -> None:
        await asyncio.gather(*(e.wait() for e in started))
        assert callable(action)
        action()

    tasks = [one(i, c) for i, c in enumerate(requests)]
    if action is not None:
        got = await asyncio.gather(trigger(), *tasks)
        return list(got[1:])  # type: ignore[arg-type]
    return list(await asyncio.gather(*tasks))


async def restart(mesh: MeshProcesses, name: str) -> None:
    mesh.start_node(mesh.topology.node(name))
    await mesh.wait_serving(timeout_s=120, names=[name])


@pytest.mark.parametrize(
    ("sig", "streams", "seeded"),
    [
        (signal.SIGKILL, STREAMS, False),
        (signal.SIGSTOP, STREAMS, False),
        (signal.SIGKILL, STREAMS, True),
    ],
    ids=["killed", "frozen", "killed-seeded"],
)
async def test_a_router_lost_mid_answer_costs_no_answer(
    mesh: MeshProcesses, sig: signal.Signals, streams: int, seeded: bool
) -> None:
    """Six greedy streams at once, and six seeded ones (sampled: the first to show a
    difference in numbers, such as a lone row's attention split between threads)."""
    first, second = addresses(mesh)
    requests = calls(streams, seeded)
    async with AsyncMeshClient(second) as alone:
        want = [text for text, _ in await stream_all(alone, requests)]
    # router-a serves first; a frozen one is left after 10 s without a message (a loaded
    # CPU node can pause a stream for seconds while it evaluates six prompts again).
    async with AsyncMeshClient([first, second], idle_timeout=10.0) as client:
        pid = mesh.procs["router-a"].pid
        kill = lambda: os.kill(pid, sig)  # noqa: E731
        got = await stream_all(client, requests, after_deltas=3, action=kill)
    try:
        for i, (text, metrics) in enumerate(got):
            assert text == want[i], i
            assert metrics.completion_tokens == TOKENS
            (failover,) = [m for m in metrics.migrations if m.failed_node.startswith("router")]
            assert failover.failed_node == f"router {first}"
            assert failover.resumed_on == "decode" and failover.tokens_delivered >= 3
            assert 0 < failover.resume_time < 30
    finally:
        mesh.stop_node("router-a", signal.SIGKILL)
        await restart(mesh, "router-a")


async def test_a_call_goes_to_the_next_router_and_the_failed_one_waits(
    mesh: MeshProcesses,
) -> None:
    first, second = addresses(mesh)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    async with AsyncMeshClient(f"{dead},{first}", cooldown=60) as client:
        result = await client.generate(MODEL, "Hello", max_tokens=4, temperature=0)
        assert result.metrics.completion_tokens == 4
        assert client._routers.order() == [first, dead]  # set aside for 60 s
        assert [m.model for m in await client.list_models()] == [MODEL]
    async with AsyncMeshClient(dead, timeout=5) as lone:
        with pytest.raises(Unavailable):  # one router: nothing to fail over to
            await lone.generate(MODEL, "Hello", max_tokens=4)
    del second


async def test_a_batch_goes_on_through_the_other_router(mesh: MeshProcesses) -> None:
    """Router-a's HTTP door serves the batch until it is SIGKILLed: the requests it had in
    flight and every later one are sent whole through router-b; each custom_id gets one
    result, and every result is a success."""
    lines = [
        {
            "custom_id": f"r{i}",
            "url": "/v1/completions",
            "body": {
                "model": MODEL,
                "prompt": f"Robot {i}:",
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(12)
    ]
    got = []
    try:
        async with AsyncMeshClient(addresses(mesh)) as client:
            async for result in client.batch(lines, concurrency=3):
                got.append(result)
                if len(got) == 3:
                    os.kill(mesh.procs["router-a"].pid, signal.SIGKILL)
        assert sorted(r.custom_id for r in got) == [f"r{i}" for i in sorted(range(12), key=str)]
        assert all(r.ok and r.completion_tokens == 24 for r in got), [r.message for r in got]
    finally:
        mesh.stop_node("router-a", signal.SIGKILL)
        await restart(mesh, "router-a")
