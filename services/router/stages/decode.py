"""The decode stage: a decode node generates (from a KV state it pulls, or from the prompt)
and its text is relayed as it comes, then its summary."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.errors import UpstreamError
from disagg_mesh.server.common.types import Continuation, DecodeStats, KvSource, Prompt, TextChunk
from disagg_mesh.server.router.failures import free_slot, stage_error
from disagg_mesh.server.router.node_health import NodeHealth
from disagg_mesh.server.router.request import Request
from disagg_mesh.server.router.stages import NodeClients


class DecodeStage:
    def __init__(self, clients: NodeClients, health: NodeHealth) -> None:
        self._clients = clients
        self._health = health

    async def stream(
        self,
        request: Request,
        node: Node,
        source: KvSource | Prompt,
        continuation: Continuation | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """The node's text chunks, then its DecodeStats, with the stage deadline (or what is
        left of the caller's)."""
        route = request.route
        await free_slot(self._health, request, node)  # the stage deadline starts with a slot
        timeout, caller_bound = request.clock.stage_timeout(route.decode_deadline_s)
        client = self._clients.decode(node.address)
        generation = client.generate(route.name, source, request.sampling, timeout, continuation)
        try:
            with self._health.busy(node, request.ident):
                async with aclosing(generation) as events:
                    async for event in events:
                        yield event
        except UpstreamError as exc:
            raise stage_error(exc, "decode", node, timeout, caller_bound) from exc


def required(stats: DecodeStats | None, node: Node | str) -> DecodeStats:
    """A stream that ended without its summary lost something."""
    if stats is None:
        where = node.address if isinstance(node, Node) else node
        raise UpstreamError(
            grpc.StatusCode.DATA_LOSS, f"decode node {where} ended the stream without a summary"
        )
    return stats
