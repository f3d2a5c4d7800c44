"""Starting a decode node."""

from __future__ import annotations

import grpc

from disagg_mesh.proto.v1 import decode_pb2, decode_pb2_grpc
from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.engines import open_engine
from disagg_mesh.server.common.runtime.node_info import (
    add_node_service,
    describer,
    engine_of,
    load_of,
)
from disagg_mesh.server.common.runtime.observability.metrics import watch_engine
from disagg_mesh.server.common.runtime.readiness import Ready
from disagg_mesh.server.common.runtime.server import serve_engine_node
from disagg_mesh.server.common.runtime.tls import tls_for
from disagg_mesh.server.common.wire.node_clients import ChannelPool
from disagg_mesh.server.decode.node import DecodeNode
from disagg_mesh.server.decode.servicer import DecodeServicer

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


async def run(topology: Topology, node: Node) -> None:
    tls = tls_for(topology, node)
    ready: Ready[DecodeNode] = Ready(f"decode node {node.name}")
    pool = ChannelPool(tls.channel_credentials() if tls else None)

    def register(server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(ready), server)
        add_node_service(server, describer(topology, node, engine_of(ready)))

    async def load() -> None:
        watch_engine(load_of(engine_of(ready)), topology.models_served_by(node.name))
        ready.set(
            DecodeNode(
                name=node.name,
                models=topology.models_served_by(node.name),
                engine=await open_engine(topology, node),
                pool=pool,
                max_tokens_limit=topology.mesh.max_tokens_limit,
                schema_limits=topology.mesh.schema_limits,
            )
        )

    await serve_engine_node(node, tls, SERVICE_NAME, ready, register, load, pool.close)
