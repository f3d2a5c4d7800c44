"""What the router knows about its nodes: health (active checks and passive cool-down) and
load.

Every node's `grpc.health.v1` is checked in the background; a node whose call failed is
skipped for a cool-down. A dead node thus costs at most one failed attempt, not one per
request. When every candidate looks down, they are tried anyway (health can lag).

Load: the router counts the calls it has in flight on each node, and learns each node's
slots (GetNodeInfo) with the health checks. Among the available nodes, those with a free
slot go first, in the topology's order of preference, then the busy ones, least loaded
first: a request no longer queues behind another on the first node while the next one idles.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.wire.node_clients import ChannelPool, health_status, node_slots
from disagg_mesh.server.router.deaths import Deaths

log = structlog.get_logger("node_health")
CHECK_TIMEOUT_S = 1.0


class NodeHealth:
    def __init__(
        self,
        nodes: list[Node],
        pool: ChannelPool,
        every_s: float,
        cooldown_s: float,
        quarantine_s: float = 300.0,
    ) -> None:
        self._nodes = nodes
        self._pool = pool
        self._every_s = every_s
        self._cooldown_s = cooldown_s
        # None: not checked yet (given the benefit of the doubt).
        self._serving: dict[str, bool | None] = {n.name: None for n in nodes}
        self._cool_until: dict[str, float] = {}
        self._in_flight: dict[str, int] = {n.name: 0 for n in nodes}
        # Slots each node reports (0: not known yet).
        self._slots: dict[str, int] = {n.name: 0 for n in nodes}
        # Which requests each node holds, and the nodes that died holding one.
        self.deaths = Deaths(quarantine_s)

    def available(self, node: Node) -> bool:
        """Serving (or not checked yet) and not cooling down."""
        return self.serving(node) and self._cool_until.get(node.name, 0.0) <= time.monotonic()

    def serving(self, node: Node) -> bool:
        return self._serving.get(node.name) is not False

    def pick(self, nodes: list[Node]) -> list[Node]:
        """The nodes worth trying, in order: the available ones, those with a free slot first
        (in the given order of preference), then the busy ones, least loaded first; if none
        is available, those only cooling down; if none is serving either (or not known to
        be yet), all of them. What the router knows of health orders and skips, but never
        fails a request untried."""
        available = [n for n in nodes if self.available(n)]
        if available:
            return sorted(available, key=self.load)  # stable: preference breaks ties
        return [n for n in nodes if self.serving(n)] or list(nodes)

    def has_free_slot(self, node: Node) -> bool:
        """As far as the router knows (its own calls in flight, the node's slots)."""
        return self.load(node) == 0.0

    def load(self, node: Node) -> float:
        """0 while the node has a free slot (or its slots are not known yet), else calls in
        flight per slot."""
        slots = self._slots.get(node.name, 0)
        in_flight = self._in_flight.get(node.name, 0)
        if slots <= 0 or in_flight < slots:
            return 0.0
        return in_flight / slots

    @contextmanager
    def busy(self, node: Node, request_id: int = 0) -> Iterator[None]:
        """Count a call on the node while it lasts (for the request `request_id`)."""
        self._in_flight[node.name] = self._in_flight.get(node.name, 0) + 1
        try:
            with self.deaths.holding(node.name, request_id):
                yield
        finally:
            self._in_flight[node.name] -= 1

    def failed(self, node: Node) -> None:
        self._cool_until[node.name] = time.monotonic() + self._cooldown_s
        log.warning("node cooling down", node=node.name, cooldown_s=self._cooldown_s)

    def succeeded(self, node: Node) -> None:
        self._cool_until.pop(node.name, None)

    async def watch(self) -> None:
        """Check every node forever (run as a task)."""
        while True:
            await asyncio.gather(*(self._check(node) for node in self._nodes))
            await asyncio.sleep(self._every_s)

    async def _check(self, node: Node) -> None:
        channel = self._pool.get(node.address)
        status, _ = await health_status(channel, CHECK_TIMEOUT_S)
        serving = status == "SERVING"
        if not serving:
            self._slots[node.name] = 0  # it may come back with other settings
        elif not self._slots.get(node.name):
            self._slots[node.name] = await node_slots(channel, CHECK_TIMEOUT_S)
        if serving != self._serving[node.name]:
            log.info("node health", node=node.name, serving=serving)
            self._serving[node.name] = serving
