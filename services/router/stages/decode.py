"""The decode stage: a decode node generates (from a KV state it pulls, or from the prompt)
and its text is relayed as it comes, then its summary."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.errors import UpstreamError
from disagg_mesh.server.common.types import Continuation, DecodeStats, KvSource, Prompt, TextChunk
from disagg_mesh.server.router.failures import (
    failed_call,
    free_slot,
    node_wait_s,
    watched_events,
)
from disagg_mesh.server.router.node_health import NodeHealth
from disagg_mesh.server.router.request import Request
from disagg_mesh.server.router.stages import NodeClients

Event = TextChunk | DecodeStats


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
    ) -> AsyncGenerator[Event, None]:
        """The node's text chunks, then its DecodeStats, once the node has a slot free of
        this router's calls (queue_budget_s). As a prefill call's (PrefillStage.call), the
        node counts the stage deadline from the generation's turn and answers busy if other
        callers keep its turn from coming within what is left of the queue budget (the
        router's own calls keep none waiting: it sends one only into a free slot); until
        the stream ends, a node it waits for past its stage deadline is asked whether it
        answers at all (`watched_events`)."""
        route = request.route
        await free_slot(self._health, request, node)
        stage_s = route.decode_deadline_s
        bounds = request.clock.node_bounds(stage_s, node_wait_s(request, 0.0, stage_s))
        limits, timeout, _ = bounds
        client = self._clients.decode(node.address)
        generation = client.generate(
            route.name, source, request.sampling, timeout, continuation, limits
        )
        sent = time.monotonic()
        try:
            with self._health.busy(node, request.ident):
                watch_s = limits.work_s or timeout
                watched = watched_events(self._health, node, "decode", watch_s, generation)
                async with aclosing(generation), aclosing(watched) as events:
                    async for event in events:
                        yield event
        except UpstreamError as exc:
            raise failed_call(exc, request, "decode", node, sent, bounds, stage_s) from exc


def required(stats: DecodeStats | None, node: Node | str) -> DecodeStats:
    """A stream that ended without its summary lost something."""
    if stats is None:
        where = node.address if isinstance(node, Node) else node
        raise UpstreamError(
            grpc.StatusCode.DATA_LOSS, f"decode node {where} ended the stream without a summary"
        )
    return stats
