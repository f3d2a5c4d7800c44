"""Ollama's semantics with real prompt evaluation: the Ollama API server of the tests with a
real GGUF behind it (tests/fake_ollama.py's LlamaModel), one per "machine", under Ollama
prefill and decode nodes. The token-id handoff must continue the prefill node's text exactly
(the decode node renders nothing around the context), and the summary must say what it
cost: the decode machine evaluated the prompt again."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses
from tests import conftest
from tests.conftest import MODEL as GGUF
from tests.conftest import route, router_node, running_mesh
from tests.fake_ollama import FakeOllama, LlamaModel
from tests.streams import collect, request

TAG = "smollm2:135m"
PROMPT = "Explain in two sentences what a unit test is."


def ollama_node(name: str, role: str, url: str) -> str:
    return conftest.ollama_node(name, role, url, TAG, n_ctx=2048)


@pytest.fixture(scope="module")
def machines() -> Iterator[tuple[FakeOllama, FakeOllama]]:
    gguf = str(resolve_model_path(GGUF, Path(".")))
    servers = [
        FakeOllama(models=(TAG,), model=LlamaModel(gguf, n_ctx=2048, n_threads=2)).start()
        for _ in range(2)
    ]
    yield servers[0], servers[1]
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def mesh(
    machines: tuple[FakeOllama, FakeOllama], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MeshProcesses]:
    prefill_machine, decode_machine = machines
    parts = [
        router_node(),
        ollama_node("prefill-ollama", "prefill", prefill_machine.url),
        ollama_node("decode-ollama", "decode", decode_machine.url),
        route(TAG, ["prefill-ollama"], ["decode-ollama"], chain=["disaggregated"]),
        route("decode-only", [], ["decode-ollama"], chain=["decode_only"]),
    ]
    with running_mesh(tmp_path_factory.mktemp("ollama-real"), parts) as processes:
        yield processes


@pytest_asyncio.fixture
async def router(mesh: MeshProcesses) -> AsyncIterator[router_pb2_grpc.RouterServiceAsyncStub]:
    async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


async def test_token_id_handoff_continues_the_text_and_reports_the_second_prefill(
    router: router_pb2_grpc.RouterServiceAsyncStub, machines: tuple[FakeOllama, FakeOllama]
) -> None:
    prefill_machine, decode_machine = machines
    disaggregated = await collect(router.Generate(request(TAG, PROMPT, 12), timeout=120))
    s = disaggregated.summary
    assert s.method == router_pb2.ROUTE_METHOD_DISAGGREGATED
    assert s.kv_transfer == types_pb2.KV_TRANSFER_TOKEN_IDS
    assert s.prompt_tokens > 10 and 0 < s.completion_tokens <= 12
    # The decode machine got the prompt's token ids plus the first token, and evaluated them.
    context = decode_machine.last("/api/generate")["context"]
    assert len(context) == s.prompt_tokens + 1
    assert s.decode_prompt_eval_duration.ToNanoseconds() > 0
    assert prefill_machine.last("/api/generate")["options"]["num_predict"] == 1

    whole = await collect(router.Generate(request("decode-only", PROMPT, 12), timeout=120))
    assert whole.summary.method == router_pb2.ROUTE_METHOD_DECODE_ONLY
    assert whole.summary.kv_transfer == types_pb2.KV_TRANSFER_NONE
    # Greedy: the same text either way, ended the same way (greedy text differs between
    # CPUs, so how long it runs is compared, not assumed).
    assert disaggregated.text == whole.text
    assert s.completion_tokens == whole.summary.completion_tokens
    assert (
        s.finish_reason
        == whole.summary.finish_reason
        == (
            types_pb2.FINISH_REASON_LENGTH
            if s.completion_tokens == 12
            else types_pb2.FINISH_REASON_STOP
        )
    )
