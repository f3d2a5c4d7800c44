"""The shared bearer token: every service but health refuses a call without it, with one
message whatever was wrong; with it, requests work end to end (router -> prefill -> decode,
and the decode node's own FetchKv call)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg_mesh import MeshClient, MeshError
from disagg_mesh.proto.v1 import (
    node_pb2,
    node_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from disagg_mesh.server.common.config.topology import Topology
from tests.conftest import engine_node, route, router_node, running_mesh
from tests.grpcurl import grpcurl
from tests.streams import collect, request

TOKEN = "s3cret-token-for-tests"
ENV = "DISAGG_TEST_TOKEN"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    folder: Path = tmp_path_factory.mktemp("secured")
    parts = [
        f'[security]\ntoken_env = "{ENV}"\n',
        router_node(),
        engine_node("prefill-a", "prefill"),
        engine_node("decode-a", "decode"),
        route("qwen3-coder:30b", ["prefill-a"], ["decode-a"], chain=["disaggregated"]),
    ]
    os.environ[ENV] = TOKEN  # the nodes inherit it
    try:
        with running_mesh(folder, parts) as processes:
            yield processes.topology
    finally:
        del os.environ[ENV]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("metadata", [(), bearer("wrong"), (("authorization", TOKEN),)])
async def test_every_service_but_health_refuses_a_missing_or_wrong_token(
    secured: Topology, metadata: tuple[tuple[str, str], ...]
) -> None:
    router_addr = secured.router.address
    prefill_addr = secured.node("prefill-a").address
    async with (
        grpc.aio.insecure_channel(router_addr) as rc,
        grpc.aio.insecure_channel(prefill_addr) as pc,
    ):
        router: object = router_pb2_grpc.RouterServiceStub(rc)
        prefill: object = prefill_pb2_grpc.PrefillServiceStub(pc)
        node: object = node_pb2_grpc.NodeServiceStub(pc)
        calls = [
            collect(router.Generate(request("qwen3-coder:30b", "hi", 2), metadata=metadata)),  # type: ignore[attr-defined]
            router.ListModels(router_pb2.ListModelsRequest(), metadata=metadata),  # type: ignore[attr-defined]
            collect(prefill.FetchKv(prefill_pb2.FetchKvRequest(kv_handle="x"), metadata=metadata)),  # type: ignore[attr-defined]
            node.GetNodeInfo(node_pb2.GetNodeInfoRequest(), metadata=metadata),  # type: ignore[attr-defined]
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert info.value.details() == "missing or invalid token"
        health: object = health_pb2_grpc.HealthStub(rc)
        reply = await health.Check(health_pb2.HealthCheckRequest(), metadata=metadata)  # type: ignore[attr-defined]
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_with_the_token_requests_work_end_to_end(secured: Topology) -> None:
    with MeshClient(secured.router.address, token=TOKEN) as client:
        result = client.generate(
            "qwen3-coder:30b", "def add(a, b):", max_tokens=6, temperature=0.0, ignore_eos=True
        )
    assert result.metrics.completion_tokens == 6 and result.metrics.kv_transfer == "state"
    with (
        MeshClient(secured.router.address, token="nope") as client,
        pytest.raises(MeshError) as info,
    ):
        client.generate("qwen3-coder:30b", "hi", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_needs_the_token_too(secured: Topology) -> None:
    refused = grpcurl("-plaintext", secured.router.address, "list")
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr
    listed = grpcurl(
        "-plaintext", "-H", f"authorization: Bearer {TOKEN}", secured.router.address, "list"
    )
    assert listed.returncode == 0 and "disagg.v1.RouterService" in listed.stdout


def test_a_node_whose_token_variable_is_empty_refuses_to_start(secured: Topology) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "disagg_mesh.server.node",
            "--topology",
            str(secured.source),
            "--node",
            "router",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and f"${ENV}" in out.stderr and "Traceback" not in out.stderr
