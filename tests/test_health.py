"""Health and reflection on every node (probed with the real grpcurl), and ListModels."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc, router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.config.topology import Node
from tests.conftest import Mesh
from tests.grpcurl import grpcurl
from tests.streams import collect, request

SERVICE_OF_ROLE = {
    "router": "disagg.v1.RouterService",
    "prefill": "disagg.v1.PrefillService",
    "decode": "disagg.v1.DecodeService",
}


async def test_every_node_reports_serving_per_service(mesh: Mesh) -> None:
    for node in mesh.topology.nodes:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub: object = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_OF_ROLE[node.role]):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))  # type: ignore[attr-defined]
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (node.name, service)


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_reflection_lists_our_services(mesh: Mesh, role: str) -> None:
    node = next(n for n in mesh.topology.nodes if n.role == role)
    listed = grpcurl("-plaintext", node.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == {
        SERVICE_OF_ROLE[role],
        "disagg.v1.NodeService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    described = grpcurl("-plaintext", node.address, "describe", SERVICE_OF_ROLE[role])
    assert described.returncode == 0 and "rpc " in described.stdout, described.stderr


def test_grpcurl_health_check(mesh: Mesh) -> None:
    out = grpcurl("-plaintext", mesh.router_address, "grpc.health.v1.Health/Check")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"status": "SERVING"}


def test_grpcurl_streams_a_generation_from_json(mesh: Mesh) -> None:
    body = {
        "model": "qwen3-coder:30b",
        "prompt": "def add(a, b):",
        "sampling": {"max_tokens": 8, "temperature": 0},
    }
    out = grpcurl(
        "-plaintext",
        "-d",
        json.dumps(body),
        mesh.router_address,
        "disagg.v1.RouterService/Generate",
    )
    assert out.returncode == 0, out.stderr
    messages = [json.loads(m) for m in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert all("delta" in m for m in messages[:-1]) and len(messages) > 2
    summary = messages[-1]["summary"]
    assert summary["completion_tokens"] == 8
    assert summary["method"] == "ROUTE_METHOD_DISAGGREGATED"


async def test_list_models_is_the_topology(
    mesh: Mesh, router: router_pb2_grpc.RouterServiceAsyncStub
) -> None:
    reply = await router.ListModels(router_pb2.ListModelsRequest())
    by_name = {m.model: m for m in reply.models}
    assert set(by_name) == {m.name for m in mesh.topology.models}
    qwen = by_name["qwen3-coder:30b"]
    assert [n.name for n in qwen.prefill_nodes] == ["prefill-qwen"]
    assert [n.name for n in qwen.decode_nodes] == ["decode-qwen"]
    assert qwen.decode_nodes[0].address == mesh.address("decode-qwen")
    assert qwen.prefill_deadline.seconds == 60 and qwen.decode_deadline.seconds == 180


async def test_node_info_of_the_router(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        info = await node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(
            node_pb2.GetNodeInfoRequest()
        )
    assert (info.role, info.engine, info.ready, info.restarts) == ("router", "", True, 0)
    assert {"qwen3-coder:30b", "gpt-oss:120b"} <= set(info.models)


async def test_node_info_of_a_prefill_node(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.address("prefill-qwen")) as channel:
        info = await node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(
            node_pb2.GetNodeInfoRequest()
        )
    assert (info.name, info.role, info.engine) == ("prefill-qwen", "prefill", "llama_cpp")
    assert info.ready and not info.problem and info.model_loaded_in_memory
    assert info.kv_transfer == types_pb2.KV_TRANSFER_STATE
    assert len(info.fingerprint.model_sha256) == 64 and info.fingerprint.n_ctx_tokens == 4096
    assert "qwen3-coder:30b" in info.models
    assert info.kv_store_bytes >= 0 and info.kv_store_handles >= 0


async def test_the_callers_request_id_is_logged_on_every_hop(mesh: Mesh) -> None:
    request_id = "grader-7f3a-request"
    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        stub: object = router_pb2_grpc.RouterServiceStub(channel)
        call = stub.Generate(  # type: ignore[attr-defined]
            request("qwen3-coder:30b", "def add(a, b):", 2, ignore_eos=True),
            metadata=(("x-request-id", request_id),),
        )
        async for _ in call:
            pass
        returned = dict(await call.initial_metadata())
    assert returned["x-request-id"] == request_id
    await asyncio.sleep(0.5)  # log lines are flushed as written; give the nodes a moment
    for node in ("router", "prefill-qwen", "decode-qwen"):
        lines = [
            json.loads(line)
            for line in (mesh.processes.log_dir / f"{node}.log").read_text().splitlines()
            if request_id in line
        ]
        summaries = [entry for entry in lines if entry["event"] == "rpc done"]
        assert summaries, f"{node} logged no summary line for the request"
        assert all(entry["request_id"] == request_id and entry["node"] == node for entry in lines)
        assert all(entry["code"] == "OK" and entry["duration_ms"] > 0 for entry in summaries)


async def test_prometheus_metrics(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.router_address) as channel:
        stub: object = router_pb2_grpc.RouterServiceStub(channel)
        three = request("qwen3-coder:30b", "def add(a, b):", 3, ignore_eos=True)
        await collect(stub.Generate(three))  # type: ignore[attr-defined]
    router = await asyncio.to_thread(scrape, mesh.topology.router)
    assert (
        'disagg_requests_total{code="OK",method="disaggregated",model="qwen3-coder:30b"}' in router
    )
    assert 'disagg_request_stage_seconds_count{model="qwen3-coder:30b",stage="ttft"}' in router
    assert 'disagg_rpcs_total{code="OK",method="/disagg.v1.RouterService/Generate"}' in router
    assert 'disagg_tokens_total{kind="completion",model="qwen3-coder:30b"}' in router
    prefill = await asyncio.to_thread(scrape, mesh.topology.node("prefill-qwen"))
    assert "disagg_kv_store_bytes " in prefill and "disagg_kv_store_handles " in prefill
    assert 'disagg_rpcs_total{code="OK",method="/disagg.v1.PrefillService/FetchKv"}' in prefill
    # The engine: its slots, queue, tokens and steps.
    assert "disagg_engine_slots 4.0" in prefill and "disagg_engine_slots_busy " in prefill
    assert "disagg_engine_queue_depth 0.0" in prefill
    assert 'disagg_engine_tokens_total{kind="prompt"}' in prefill
    assert 'disagg_engine_tokens_per_second{kind="decode"}' in prefill
    # 4 slots of 4,096 tokens and a prefix cache of as many, 23,040 bytes a token.
    assert 'disagg_engine_kv_cache_bytes{state="total"} 4.718592e+08' in prefill
    assert 'disagg_engine_prefix_cache_tokens{state="max"} 4096.0' in prefill
    assert 'disagg_engine_prefix_cache_tokens{state="stored"} ' in prefill
    assert "disagg_engine_step_seconds_count " in prefill
    # The same load under vLLM's names (llm-d's model-server protocol), by logical model;
    # the share of the KV cache holding tokens is used over total, as the engine says.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert f'{name}{{model_name="qwen3-coder:30b"}} 0.0' in prefill
    used = sample(prefill, 'disagg_engine_kv_cache_bytes{state="used"}')
    total = sample(prefill, 'disagg_engine_kv_cache_bytes{state="total"}')
    usage = sample(prefill, 'vllm:kv_cache_usage_perc{model_name="qwen3-coder:30b"}')
    assert 0.0 <= usage <= 1.0 and usage == pytest.approx(used / total)


async def test_routers_watch_each_nodes_health_instead_of_polling_it(mesh: Mesh) -> None:
    """Each router holds one grpc.health.v1 Watch stream per node: a change arrives as it
    happens, and a quiet node is asked nothing (polling 200 nodes every second cost the
    routers more CPU than the requests did)."""
    node = mesh.topology.node("prefill-qwen")
    before = await asyncio.to_thread(scrape, node)
    await asyncio.sleep(3 * mesh.topology.mesh.health_check_every_s + 0.5)
    after = await asyncio.to_thread(scrape, node)
    assert sample(after, "disagg_health_watchers") == len(mesh.topology.routers)
    checks = "disagg_health_checks_total"
    assert sample(after, checks) == sample(before, checks)


def sample(text: str, series: str) -> float:
    """The value of one series (name and labels, as exposed) in a scrape."""
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert found is not None, f"no {series} in the scrape"
    return float(found.group(1))


def scrape(node: Node) -> str:
    assert node.metrics_port is not None
    with urllib.request.urlopen(f"http://{node.host}:{node.metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())
