"""NodeService: every prefill and decode node tells what it is and how it is doing."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.engines.base import Engine, EngineLoad, Placement
from disagg_mesh.server.common.kv.store import KvStore
from disagg_mesh.server.common.runtime.observability.host import this_host
from disagg_mesh.server.common.runtime.processes import restarts
from disagg_mesh.server.common.runtime.readiness import Ready
from disagg_mesh.server.common.types import Fingerprint, KvTransferKind, ModelFacts
from disagg_mesh.server.common.wire import convert
from disagg_mesh.server.common.wire.convert import host_to_proto
from disagg_mesh.server.common.wire.mirror import to_proto

SERVICE_NAME = node_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name
# When this process started (imported at start by every node's main).
STARTED = time.monotonic()


@dataclass
class NodeStatus:
    name: str
    role: str
    engine: str
    engine_model: str
    models: list[str] = field(default_factory=list)
    fingerprint: Fingerprint | None = None
    kv_transfer: KvTransferKind = KvTransferKind.NONE
    ready: bool = False
    problem: str = ""
    model_loaded_in_memory: bool = False
    kv_store_handles: int = 0
    kv_store_bytes: int = 0
    load: EngineLoad | None = None
    placement: Placement = field(default_factory=Placement)
    model_facts: ModelFacts = field(default_factory=ModelFacts)


def describer(
    topology: Topology,
    node: Node,
    engine: Callable[[], Engine | None],
    store: Callable[[], KvStore | None] = lambda: None,
) -> Callable[[], Awaitable[NodeStatus]]:
    """How a node builds its NodeStatus from its engine (None while loading) and KV store."""

    async def describe() -> NodeStatus:
        status = NodeStatus(
            name=node.name,
            role=node.role,
            engine=node.engine or "",
            engine_model=node.model or "",
            models=topology.models_served_by(node.name),
        )
        current = engine()
        if current is None:
            status.problem = "loading the model"
            return status
        problem = await current.problem()
        status.fingerprint = current.fingerprint
        status.kv_transfer = current.kv_transfer
        status.ready = problem is None
        status.problem = problem or ""
        status.model_loaded_in_memory = current.loaded_in_memory
        status.load = current.load()
        status.placement = current.placement
        status.model_facts = current.model_facts
        kv = store()
        if kv is not None:
            status.kv_store_handles, status.kv_store_bytes = len(kv), kv.bytes_held
        return status

    return describe


def engine_of(ready: Ready[Any]) -> Callable[[], Engine | None]:
    return lambda: ready.get().engine if ready.is_set() else None


def load_of(engine: Callable[[], Engine | None]) -> Callable[[], EngineLoad | None]:
    def load() -> EngineLoad | None:
        current = engine()
        return current.load() if current is not None else None

    return load


class NodeServicer(node_pb2_grpc.NodeServiceServicer):
    def __init__(self, describe: Callable[[], Awaitable[NodeStatus]]) -> None:
        self._describe = describe

    async def GetNodeInfo(
        self, request: node_pb2.GetNodeInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> node_pb2.GetNodeInfoResponse:
        s = await self._describe()
        load = s.load or EngineLoad(0, 0, 0, 0, 0.0, 0.0)
        return node_pb2.GetNodeInfoResponse(
            uptime_seconds=time.monotonic() - STARTED,
            host=host_to_proto(this_host()),
            name=s.name,
            role=s.role,
            engine=s.engine,
            engine_model=s.engine_model,
            models=s.models,
            fingerprint=convert.fingerprint_to_proto(s.fingerprint) if s.fingerprint else None,
            kv_transfer=convert.KV_TRANSFER_TO_PROTO[s.kv_transfer],
            ready=s.ready,
            problem=s.problem,
            model_loaded_in_memory=s.model_loaded_in_memory,
            kv_store_handles=s.kv_store_handles,
            kv_store_bytes=s.kv_store_bytes,
            slots=load.slots,
            slots_busy=load.slots_busy,
            queue_depth=load.queue_depth,
            max_queue=load.max_queue,
            prompt_tokens_per_second=load.prompt_tokens_per_second,
            decode_tokens_per_second=load.decode_tokens_per_second,
            kv_cache_bytes=load.kv_cache_bytes,
            kv_cache_used_bytes=load.kv_cache_used_bytes,
            prefix_cache_tokens=load.prefix_cache_tokens,
            prefix_cache_max_tokens=load.prefix_cache_max_tokens,
            busy_seconds=load.busy_seconds,
            slot_busy_seconds=load.slot_busy_seconds,
            backend=s.placement.backend,
            gpu_layers=s.placement.gpu_layers,
            model_layers=s.placement.layers,
            model_facts=to_proto(s.model_facts),
            restarts=restarts(),
        )


def router_describer(topology: Topology, node: Node) -> Callable[[], Awaitable[NodeStatus]]:
    """A router's NodeStatus: what it is and the models it routes (no engine of its own)."""

    async def describe() -> NodeStatus:
        models = [m.name for m in topology.models]
        return NodeStatus(node.name, node.role, "", "", models=models, ready=True)

    return describe


def add_node_service(
    server: grpc.aio.Server, describe: Callable[[], Awaitable[NodeStatus]]
) -> None:
    node_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(describe), server)
