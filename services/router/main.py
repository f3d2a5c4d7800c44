"""Starting the router."""

from __future__ import annotations

import grpc

from disagg.v1 import router_pb2, router_pb2_grpc
from services.common.node_clients import ChannelPool
from services.common.server import serve
from services.common.topology import Node, Topology
from services.router.routing import Router
from services.router.servicer import RouterServicer

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


async def run(topology: Topology, node: Node) -> None:
    pool = ChannelPool()

    def register(server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServiceServicer_to_server(
            RouterServicer(Router(topology, pool)), server
        )

    async def load() -> None:
        return None  # the router holds no model

    await serve(
        bind_address=node.bind_address,
        service_names=[SERVICE_NAME],
        register=register,
        load=load,
        close=pool.close,
    )
