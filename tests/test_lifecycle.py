"""SIGTERM drains a node: health goes NOT_SERVING, in-flight streams finish, the process
exits 0, and the router sends new requests elsewhere."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from disagg_mesh.proto.v1 import router_pb2_grpc
from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.runtime.grpc_io import OLDER_IO
from disagg_mesh.server.common.runtime.processes import MeshProcesses
from tests.conftest import engine_node, node_entry, route, router_node, running_mesh
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


# What a node's process imports first, recorded by a finder ahead of Python's own.
IMPORT_ORDER = """
import json, sys
order = []
class Recorder:
    def find_spec(self, name, path=None, target=None):
        order.append(name)
        return None
sys.meta_path.insert(0, Recorder())
import runpy
sys.argv = ["node", "--help"]
try:
    runpy.run_module("disagg_mesh.server.node", run_name="__main__")
except SystemExit:
    pass
print(json.dumps(order))
"""


def test_a_nodes_process_loads_llama_cpp_before_grpc_numpy_and_sentencepiece() -> None:
    """A CUDA build of llama.cpp crashed every node at start (SIGSEGV in its tokenizer's
    std::regex) when grpc's libraries were loaded first: found on an H100 machine after
    the package's __init__ began importing the client. `python -m disagg_mesh.server.node`
    must reach llama_cpp before any of them; numpy may follow, as llama_cpp imports it."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ORDER],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    order = json.loads(done.stdout.strip().splitlines()[-1])
    first = order.index("llama_cpp")
    for name in ("grpc", "numpy", "sentencepiece", "google.protobuf"):
        if name in order:
            assert order.index(name) > first, f"{name} is imported before llama_cpp: {order}"


def test_a_llama_cpp_nodes_process_hands_the_interpreter_lock_over_sooner() -> None:
    """The engine thread waits for the interpreter's lock after every llama.cpp call while
    the event loop sends tokens: a llama.cpp node's process shortens Python's 5 ms switch
    interval (services/node.py says what it bought); a router's or simulated nodes' keeps it."""
    from disagg_mesh.server import node

    before = sys.getswitchinterval()
    try:
        node.share_the_interpreter([Node.model_construct(engine="sim")])
        assert sys.getswitchinterval() == before
        node.share_the_interpreter(
            [Node.model_construct(engine="sim"), Node.model_construct(engine="llama_cpp")]
        )
        assert sys.getswitchinterval() == pytest.approx(node.ENGINE_SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)


ENVIRONMENT = (
    "import json, os, sys; sys.argv = ['node', '--topology', 'topology/local.toml', '--node', "
    "{node!r}]; import disagg_mesh.server.node; "
    "print(json.dumps([os.environ.get('GRPC_EXPERIMENTS'), 'grpc' in sys.modules]))"
)


@pytest.mark.parametrize(
    ("node", "own", "expected"),
    [
        ("router", None, OLDER_IO),
        ("router", "-event_engine_client", "-event_engine_client"),
        ("prefill-qwen", None, None),
    ],
)
def test_a_nodes_process_takes_grpcs_older_io_path_unless_it_runs_llama_cpp(
    node: str, own: str | None, expected: str | None
) -> None:
    """gRPC reads GRPC_EXPERIMENTS when it loads: a router's process sets it to the older I/O
    path first (runtime/grpc_io.py says what it saves), an embedded engine's keeps gRPC's
    default, and a setting of the user's own wins."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if own is not None:
        env["GRPC_EXPERIMENTS"] = own
    done = subprocess.run(
        [sys.executable, "-c", ENVIRONMENT.format(node=node)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    setting, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded, "the node's module imports grpc"
    assert setting == expected


def test_a_mesh_stopped_at_once_leaves_no_traceback_in_its_logs(tmp_path: Path) -> None:
    """Every process of a mesh stopped together (make run's Ctrl-C, a test's end): each
    node's health stream to a router that is stopping too cannot be told NOT_SERVING, and
    that is no error: no traceback in any log (there was one in about one stop of four).
    Sim nodes, four rounds."""
    model = "qwen3-coder:30b"
    for round_ in range(4):
        folder = tmp_path / f"round-{round_}"
        folder.mkdir()
        parts = [
            router_node(),
            node_entry("p", "prefill", "sim", model, hardware="dgx-spark"),
            node_entry("d", "decode", "sim", model, hardware="m3-ultra"),
            route(model, ["p"], ["d"]),
        ]
        with running_mesh(folder, parts) as processes:
            processes.wait_routers_see_serving()
        for log in (folder / "logs").glob("*.log"):
            text = log.read_text()
            assert "Traceback" not in text and "never retrieved" not in text, (log.name, text)
