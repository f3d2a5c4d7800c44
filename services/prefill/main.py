"""Starting a prefill node."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.engines import open_engine
from disagg_mesh.server.common.kv.store import KvStore
from disagg_mesh.server.common.runtime.node_info import (
    add_node_service,
    describer,
    engine_of,
    load_of,
)
from disagg_mesh.server.common.runtime.observability.metrics import watch_engine, watch_kv_store
from disagg_mesh.server.common.runtime.readiness import Ready
from disagg_mesh.server.common.runtime.server import serve_engine_node
from disagg_mesh.server.common.runtime.tls import tls_for
from disagg_mesh.server.prefill.node import PrefillNode
from disagg_mesh.server.prefill.servicer import SERVICE_NAME, PrefillServicer, add_prefill_service


def store_of(ready: Ready[PrefillNode]) -> Callable[[], KvStore | None]:
    return lambda: ready.get().store if ready.is_set() else None


async def run(topology: Topology, node: Node) -> None:
    tls = tls_for(topology, node)
    ready: Ready[PrefillNode] = Ready(f"prefill node {node.name}")
    background: set[asyncio.Task[None]] = set()

    def register(server: grpc.aio.Server) -> None:
        add_prefill_service(PrefillServicer(ready), server)
        add_node_service(server, describer(topology, node, engine_of(ready), store_of(ready)))

    async def load() -> None:
        engine = await open_engine(topology, node)
        store = KvStore(budget_bytes=node.kv_budget_bytes, ttl_s=node.kv_ttl_s)
        watch_kv_store(lambda: store.bytes_held, lambda: len(store))
        watch_engine(load_of(engine_of(ready)), topology.models_served_by(node.name))
        background.add(asyncio.create_task(store.expire_periodically()))
        ready.set(
            PrefillNode(
                name=node.name,
                models=topology.models_served_by(node.name),
                engine=engine,
                store=store,
                max_tokens_limit=topology.mesh.max_tokens_limit,
                schema_limits=topology.mesh.schema_limits,
            )
        )

    async def cancel_background() -> None:
        for task in background:
            task.cancel()

    await serve_engine_node(node, tls, SERVICE_NAME, ready, register, load, cancel_background)
