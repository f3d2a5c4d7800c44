"""Starting a prefill node."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.engines import open_engine
from disagg_mesh.server.common.kv.store import KvStore
from disagg_mesh.server.common.runtime.node_info import SERVICE_NAME as NODE_SERVICE_NAME
from disagg_mesh.server.common.runtime.node_info import (
    add_node_service,
    describer,
    engine_of,
    load_of,
)
from disagg_mesh.server.common.runtime.observability.metrics import watch_engine, watch_kv_store
from disagg_mesh.server.common.runtime.readiness import Ready
from disagg_mesh.server.common.runtime.server import metrics_address, serve
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
        watch_engine(load_of(engine_of(ready)))
        background.add(asyncio.create_task(store.expire_periodically()))
        ready.set(
            PrefillNode(
                name=node.name,
                models=topology.models_served_by(node.name),
                engine=engine,
                store=store,
                max_tokens_limit=topology.mesh.max_tokens_limit,
            )
        )

    async def problem() -> str | None:
        return await ready.get().engine.problem()

    async def close() -> None:
        for task in background:
            task.cancel()
        if ready.is_set():
            await ready.get().engine.close()

    await serve(
        bind_address=node.bind_address,
        service_names=[SERVICE_NAME, NODE_SERVICE_NAME],
        register=register,
        load=load,
        problem=problem,
        close=close,
        credentials=tls.server_credentials() if tls else None,
        metrics_address=metrics_address(node),
    )
