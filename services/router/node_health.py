"""What the router knows about its nodes' health: active checks and passive cool-down.

Every node's `grpc.health.v1` is checked in the background; a node whose call failed is
skipped for a cool-down. A dead node thus costs at most one failed attempt, not one per
request. When every candidate looks down, they are tried anyway (health can lag).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from services.common.node_clients import ChannelPool, health_status
from services.common.topology import Node

log = structlog.get_logger("node_health")
CHECK_TIMEOUT_S = 1.0


class NodeHealth:
    def __init__(
        self, nodes: list[Node], pool: ChannelPool, every_s: float, cooldown_s: float
    ) -> None:
        self._nodes = nodes
        self._pool = pool
        self._every_s = every_s
        self._cooldown_s = cooldown_s
        # None: not checked yet (given the benefit of the doubt).
        self._serving: dict[str, bool | None] = {n.name: None for n in nodes}
        self._cool_until: dict[str, float] = {}

    def available(self, node: Node) -> bool:
        """Serving (or not checked yet) and not cooling down."""
        return self.serving(node) and self._cool_until.get(node.name, 0.0) <= time.monotonic()

    def serving(self, node: Node) -> bool:
        return self._serving.get(node.name) is not False

    def pick(self, nodes: list[Node]) -> list[Node]:
        """The nodes worth trying, in order: the available ones; if none is, those only
        cooling down; if none is serving either (or not known to be yet), all of them. What
        the router knows of health orders and skips, but never fails a request untried."""
        return (
            [n for n in nodes if self.available(n)]
            or [n for n in nodes if self.serving(n)]
            or list(nodes)
        )

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
        status, _ = await health_status(self._pool.get(node.address), CHECK_TIMEOUT_S)
        serving = status == "SERVING"
        if serving != self._serving[node.name]:
            log.info("node health", node=node.name, serving=serving)
            self._serving[node.name] = serving
