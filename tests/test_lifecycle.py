"""SIGTERM drains a node: health goes NOT_SERVING, in-flight streams finish, the process
exits 0, and the router sends new requests elsewhere."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from disagg_mesh.proto.v1 import router_pb2_grpc
from disagg_mesh.server.common.runtime.processes import MeshProcesses
from tests.conftest import engine_node, route, router_node, running_mesh
from tests.streams import collect, request

MODEL = "qwen3-coder:30b"
COUNTING = "Count to one thousand: " + ", ".join(str(i) for i in range(1, 40)) + ","


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    folder: Path = tmp_path_factory.mktemp("lifecycle")
    parts = [
        "[mesh]\nhealth_check_every_s = 0.5\n",
        router_node(),
        engine_node("prefill-a", "prefill"),
        engine_node("decode-a", "decode"),
        engine_node("decode-b", "decode"),
        route(MODEL, ["prefill-a"], ["decode-a", "decode-b"]),
        route("test/decode-a-only", ["prefill-a"], ["decode-a"], chain=["disaggregated"]),
    ]
    with running_mesh(folder, parts) as processes:
        yield processes


async def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0(mesh: MeshProcesses) -> None:
    draining = mesh.procs["decode-a"]
    async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
        router: object = router_pb2_grpc.RouterServiceStub(channel)
        long = request("test/decode-a-only", COUNTING, 120, ignore_eos=True)
        call = router.Generate(long, timeout=60)  # type: ignore[attr-defined]
        first = await call.read()
        assert first.HasField("delta")
        draining.send_signal(signal.SIGTERM)
        summary = None
        while (reply := await call.read()) != grpc.aio.EOF:
            if reply.HasField("summary"):
                summary = reply.summary
        assert summary is not None
        assert summary.completion_tokens == 120  # nothing lost
        assert summary.decode_node == "decode-a"
        code = await asyncio.to_thread(draining.wait, 15)
        assert code == 0
        # New requests go to the other decode node.
        later = await collect(router.Generate(request(MODEL, "def add(a, b):", 4)))  # type: ignore[attr-defined]
        assert later.summary.decode_node == "decode-b"
    log = (mesh.log_dir / "decode-a.log").read_text()
    assert '"shutting down"' in log and '"stopped"' in log
