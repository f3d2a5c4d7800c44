"""Starting the router."""

from __future__ import annotations

import asyncio

import grpc

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc
from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.runtime.node_info import add_node_service, router_describer
from disagg_mesh.server.common.runtime.server import serve_node
from disagg_mesh.server.common.runtime.tls import tls_for, tls_paths
from disagg_mesh.server.common.wire.node_clients import ChannelPool, node_report
from disagg_mesh.server.router.dashboard.state import ASK_TIMEOUT_S, DashboardState
from disagg_mesh.server.router.dashboard.web import PeerPull
from disagg_mesh.server.router.http import HttpFrontDoor
from disagg_mesh.server.router.node_health import NodeHealth
from disagg_mesh.server.router.routing import Router
from disagg_mesh.server.router.servicer import RouterServicer

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


async def run(topology: Topology, node: Node) -> None:
    tls = tls_for(topology, node)
    pool = ChannelPool(tls.channel_credentials() if tls else None)
    health = NodeHealth(
        [n for n in topology.nodes if n.role != "router"],
        pool,
        every_s=topology.mesh.health_check_every_s,
        cooldown_s=topology.mesh.cooldown_s,
        quarantine_s=topology.mesh.query_of_death_quarantine_s,
    )
    router = Router(topology, pool, health)
    background: set[asyncio.Task[None]] = set()
    peers = PeerPull(tls_paths(topology, node))
    dashboard = (
        DashboardState(
            topology,
            node,
            router.recent,
            lambda other: node_report(pool.get(other.address), ASK_TIMEOUT_S),
            peers,
            serving=health.serving,
        )
        if node.http_port is not None
        else None
    )
    http = (
        HttpFrontDoor(
            router,
            node.listen_host or node.host,
            node.http_port,
            tls_paths(topology, node),
            dashboard,
            node.http_origins,
        )
        if node.http_port is not None
        else None
    )

    def register(server: grpc.aio.Server) -> None:
        servicer = RouterServicer(router, http.public_url(node.host) if http else "")
        router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
        # What it is and how often the launcher restarted it (disagg status).
        add_node_service(server, router_describer(topology, node))

    async def load() -> None:
        background.add(asyncio.create_task(health.watch()))
        if dashboard is not None:
            background.add(asyncio.create_task(dashboard.run()))
        if http is not None:
            await http.start()

    async def close() -> None:
        if http is not None:
            await http.close()
        for task in background:
            task.cancel()
        await peers.close()
        await router.close()
        await pool.close()

    await serve_node(node, tls, SERVICE_NAME, register, load, close)
