"""`disagg doctor`: will a KV handoff work between each model's prefill and decode nodes?

It asks every prefill and decode node of every logical model for its KV fingerprint
(GetNodeInfo) and compares each prefill node with each decode node of the same model: the
same model file (SHA-256), n_ctx, llama.cpp version, K/V cache types, flash attention, KV
stream layout and swa_full. The nodes answer for themselves, so this catches a machine
whose topology file or build drifted from the others'.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc

from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.server.common.kv.assembler import describe_mismatch
from disagg_mesh.server.common.types import Fingerprint
from disagg_mesh.server.common.wire.convert import fingerprint_from_proto


@dataclass(frozen=True)
class NodeAnswer:
    name: str
    engine: str
    fingerprint: Fingerprint | None = None
    placement: str = ""
    problem: str = ""


@dataclass(frozen=True)
class PairVerdict:
    model: str
    prefill: str
    decode: str
    ok: bool
    says: str


async def ask(
    node: Any, credentials: grpc.ChannelCredentials | None, metadata: tuple[tuple[str, str], ...]
) -> NodeAnswer:
    channel = (
        grpc.aio.secure_channel(node.address, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(node.address)
    )
    async with channel:
        stub: Any = node_pb2_grpc.NodeServiceStub(channel)
        try:
            info = await stub.GetNodeInfo(
                node_pb2.GetNodeInfoRequest(), timeout=5.0, metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            return NodeAnswer(node.name, node.engine or "", problem=f"{exc.code().name}")
    if not info.HasField("fingerprint"):
        return NodeAnswer(node.name, info.engine, problem=info.problem or "no fingerprint yet")
    placement = (
        f"{info.backend}, {info.gpu_layers}/{info.model_layers} layers on GPU"
        if info.backend
        else ""
    )
    return NodeAnswer(
        node.name, info.engine, fingerprint_from_proto(info.fingerprint), placement, info.problem
    )


def verdicts(topology: Any, answers: dict[str, NodeAnswer]) -> list[PairVerdict]:
    out = []
    for route in topology.models:
        for p in route.prefill:
            for d in route.decode:
                out.append(_verdict(route.name, answers[p], answers[d]))
    return out


def _verdict(model: str, p: NodeAnswer, d: NodeAnswer) -> PairVerdict:
    def verdict(ok: bool, says: str) -> PairVerdict:
        return PairVerdict(model, p.name, d.name, ok, says)

    for side in (p, d):
        if side.fingerprint is None:
            return verdict(False, f"cannot tell: {side.name} answers {side.problem}")
    if "ollama" in (p.engine, d.engine):
        return verdict(
            True,
            "token ids only (an Ollama engine passes no KV): the decode node evaluates the "
            "prompt again",
        )
    assert p.fingerprint is not None and d.fingerprint is not None
    differs = p.fingerprint.mismatch(d.fingerprint)
    if differs is not None:
        said = describe_mismatch(differs, f"on {p.name}", f"on {d.name}")
        return verdict(False, f"no KV handoff: {said}")
    where = f" ({p.placement} -> {d.placement})" if p.placement and d.placement else ""
    return verdict(True, f"KV handoff works{where}")


async def run(
    topology: Any,
    credentials: grpc.ChannelCredentials | None,
    metadata: tuple[tuple[str, str], ...],
) -> list[PairVerdict]:
    names = sorted({n for m in topology.models for n in (*m.prefill, *m.decode)})
    found = await asyncio.gather(*(ask(topology.node(n), credentials, metadata) for n in names))
    return verdicts(topology, {a.name: a for a in found})
