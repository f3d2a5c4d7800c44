"""The dashboard's state: the whole mesh every SAMPLE_S, the last hour of it, and the page's
live feed.

Every tick the router asks the nodes of the topology (routers too) for GetNodeInfo, with a
short deadline: a node that does not answer is drawn down, and the tick goes on. A tick asks
at most ASKS_PER_TICK nodes, those asked longest ago: every node every tick on a mesh of that
size or less, and on a bigger one each node in turn, its last answer standing in between (its
age in the row), while the router's health watch (NodeHealth) says at once when a node goes
down; so the sampler's cost does not grow with the mesh. From the
answers and the router's recent requests (recent.py) it builds one snapshot: the topology
by host, each host's CPU, memory and GPU, each logical model's figures over the last
WINDOW_S, and the seeds' targets green or red. A compact sample of it joins the history
(an hour: a page opened late still draws its charts), and every open page's feed gets it.
Each is encoded to JSON once: a sample when it joins, the feed's update and GET
/api/dashboard's body once a tick.

The JSON shape is documented in the README (`GET /api/dashboard`); `SCHEMA` names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

import structlog

from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.runtime.node_info import STARTED
from disagg_mesh.server.common.runtime.observability.host import this_host
from disagg_mesh.server.common.runtime.processes import restarts
from disagg_mesh.server.common.types import NodeReport
from disagg_mesh.server.router.dashboard.recent import (
    KEEP_S,
    Done,
    Failed,
    Merged,
    Recent,
    Records,
    figures,
    parallel_efficiency,
    percentile,
)

log = structlog.get_logger("dashboard")

SCHEMA = "disagg-mesh.dashboard.v1"
SAMPLE_S = 2.0
WINDOW_S = 60.0
ASK_TIMEOUT_S = 1.5
# GetNodeInfo calls a tick at most (12 a second): at 200 nodes, asking each every tick was
# 100 calls a second a router, whatever the traffic.
ASKS_PER_TICK = 24
HISTORY = int(KEEP_S / SAMPLE_S)
# What the seeds' guide sets as targets: (key, what, goal, unit, lower is better).
TARGETS = (
    ("end_to_end_p95", "end-to-end latency p95", 15.0, "s", True),
    ("requests_per_second", "throughput", 10.0, "req/s", False),
    ("parallel_efficiency", "parallel efficiency (two pipelines' overlap)", 1.5, "x", False),
    ("uptime", "uptime (nodes serving)", 99.9, "%", False),
    ("error_rate", "error rate", 0.1, "%", True),
    ("failover", "failover time (longest)", 5.0, "s", True),
)


# How the dashboard asks a node: its NodeReport, or None when it did not answer.
Ask = Callable[[Node], Awaitable[NodeReport | None]]
# How it pulls another router's requests that ended after a time of that router's clock:
# (done, failed, that router's time now), or None when it did not answer.
Pulled = tuple[list[Done], list[Failed], float]
Pull = Callable[[Node, float], Awaitable[Pulled | None]]


class DashboardState:
    def __init__(
        self,
        topology: Topology,
        router: Node,
        recent: Recent,
        ask: Ask,
        pull: Pull | None = None,
        clock: Callable[[], float] = time.time,
        serving: Callable[[Node], bool] | None = None,
    ) -> None:
        """pull: how to get the other routers' requests (None: count this router's only).
        serving: whether the router's health watch holds a node as serving (a node not
        asked this tick whose watch says not is drawn down; None: its last answer stands)."""
        self._topology = topology
        self._router = router
        self._ask = ask
        self._pull = pull
        # The other routers with a dashboard, and how far each was pulled (its clock).
        self._peers = [
            n
            for n in topology.routers
            if n.name != router.name and n.http_port is not None and pull is not None
        ]
        self._pulled: dict[str, float] = {}
        self._counted: list[str] = [router.name]
        self._peer_records = Records(clock)
        # The whole mesh's requests: this router's and the others'.
        self._own = recent
        self._recent = Merged([recent, self._peer_records], clock)
        self._clock = clock
        # The history's samples as JSON, each encoded once (a GET of an hour's 1,800 samples
        # joins them: encoding them all again took ~35 ms on the user's topology).
        self._history: deque[str] = deque(maxlen=HISTORY)
        self.current: dict[str, Any] = {}
        # This tick's state as JSON (the feed's update and GET /api/dashboard's body both
        # hold it), and the body, each built once a tick by the first that needs it.
        self._current_json: str | None = None
        self._snapshot_json: str | None = None
        self._feeds: set[asyncio.Queue[str | None]] = set()
        self._closed = False
        # Ticks each node was serving, and ticks since it first served (uptime: a node still
        # loading its model when the router started is not down).
        self._serving_ticks: dict[str, int] = {n.name: 0 for n in topology.nodes}
        self._watched_ticks: dict[str, int] = {n.name: 0 for n in topology.nodes}
        # Each node's last answer (None: none) and when it was asked (time.monotonic()).
        self._last: dict[str, tuple[NodeReport | None, float]] = {}
        self._asked_now: set[str] = set()
        self._serving = serving

    async def run(self) -> None:
        """Sample forever (a background task of the router)."""
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except Exception:  # a tick that fails must not end the dashboard
                log.exception("dashboard tick failed")
            await asyncio.sleep(max(0.1, SAMPLE_S - (time.monotonic() - started)))

    async def tick(self) -> None:
        asked = self._to_ask()
        reports, counted = await asyncio.gather(
            asyncio.gather(*(self._ask_or_none(n) for n in asked)), self._pull_peers()
        )
        self._counted = [self._router.name, *counted]
        now, at = self._clock(), time.monotonic()
        self._asked_now = {n.name for n in asked}
        for node, report in zip(asked, reports, strict=True):
            self._last[node.name] = (report, at)
            if report is not None and report.ready:
                self._serving_ticks[node.name] += 1
            if self._serving_ticks[node.name]:
                self._watched_ticks[node.name] += 1
        self.current = self._snapshot(
            now, [(n, self._last_report(n)) for n in self._topology.nodes]
        )
        sample = dumps(self._sample(now))
        self._history.append(sample)
        self._current_json = self._snapshot_json = None
        if not self._feeds:
            return
        update = _with_key(self._encoded_current(), "sample", sample)  # once for all pages
        for feed in list(self._feeds):
            if feed.full():  # a page that stopped reading loses its oldest update
                with contextlib.suppress(asyncio.QueueEmpty):
                    feed.get_nowait()
            feed.put_nowait(update)

    def _to_ask(self) -> list[Node]:
        """This tick's nodes: every node never asked (the first tick asks them all), then up
        to ASKS_PER_TICK in all of those asked longest ago, those whose last answer the
        health watch contradicts (it went down, or came back) first; the topology's order
        among equals."""

        def key(node: Node) -> tuple[bool, float]:
            report, at = self._last[node.name]
            ready = report is not None and report.ready
            return self._serving is None or self._serving(node) == ready, at

        never = [n for n in self._topology.nodes if n.name not in self._last]
        asked = [n for n in self._topology.nodes if n.name in self._last]
        return never + sorted(asked, key=key)[: max(0, ASKS_PER_TICK - len(never))]

    def _last_report(self, node: Node) -> NodeReport | None:
        return self._last.get(node.name, (None, 0.0))[0]

    async def _ask_or_none(self, node: Node) -> NodeReport | None:
        if node.name == self._router.name:
            return self._own_report()
        try:
            return await asyncio.wait_for(self._ask(node), ASK_TIMEOUT_S)
        except TimeoutError:
            return None

    async def _pull_peers(self) -> list[str]:
        """Pull the other routers' new requests; the names of those that answered."""

        async def one(peer: Node) -> str | None:
            assert self._pull is not None
            try:
                pulled = await asyncio.wait_for(
                    self._pull(peer, self._pulled.get(peer.name, 0.0)), ASK_TIMEOUT_S
                )
            except TimeoutError:
                return None
            if pulled is None:
                return None
            done, failed, now = pulled
            self._peer_records.add(done, failed)
            self._pulled[peer.name] = now
            return peer.name

        answered = await asyncio.gather(*(one(peer) for peer in self._peers))
        return [name for name in answered if name is not None]

    @property
    def router_name(self) -> str:
        return self._router.name

    def requests_after(self, t: float) -> Pulled:
        """This router's own requests that ended after t, and its time now: what another
        router's dashboard pulls (GET /api/dashboard/requests)."""
        done, failed = self._own.after(t)
        return done, failed, self._clock()

    def _own_report(self) -> NodeReport:
        return NodeReport(
            name=self._router.name,
            role="router",
            engine="",
            engine_model="",
            backend="",
            gpu_layers=0,
            model_layers=0,
            ready=True,
            problem="",
            slots=0,
            slots_busy=0,
            queue_depth=0,
            restarts=restarts(),
            uptime_seconds=time.monotonic() - STARTED,
            host=this_host(),
        )

    @property
    def history(self) -> list[dict[str, Any]]:
        """The last hour's samples, oldest first."""
        return [json.loads(sample) for sample in self._history]

    def snapshot_json(self) -> str:
        """The current state with the history, as JSON: GET /api/dashboard. Built once a
        tick (a script polling every second, or several pages opening, cost one build)."""
        if not self.current:  # before the first tick
            return _with_key(dumps(self._snapshot(self._clock(), [])), "history", "[]")
        if self._snapshot_json is None:
            history = "[" + ",".join(self._history) + "]"
            self._snapshot_json = _with_key(self._encoded_current(), "history", history)
        return self._snapshot_json

    def _encoded_current(self) -> str:
        if self._current_json is None:
            self._current_json = dumps(self.current)
        return self._current_json

    def close(self) -> None:
        """End every page's feed (the router is stopping: an open page must not hold its
        HTTP door's shutdown up; the page reconnects to whichever router comes back)."""
        self._closed = True
        for feed in self._feeds:
            while not feed.empty():
                feed.get_nowait()
            feed.put_nowait(None)

    @contextlib.asynccontextmanager
    async def feed(self) -> AsyncIterator[asyncio.Queue[str | None]]:
        """A page's live updates: each tick's state with its sample, as JSON; None when it
        ends."""
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=8)
        if self._closed:
            queue.put_nowait(None)
        self._feeds.add(queue)
        try:
            yield queue
        finally:
            self._feeds.discard(queue)

    # -- building ------------------------------------------------------------------------

    def _snapshot(
        self, now: float, reports: list[tuple[Node, NodeReport | None]]
    ) -> dict[str, Any]:
        models = [m.name for m in self._topology.models]
        nodes = [self._node_row(node, report) for node, report in reports]
        done, failed = self._recent.since(WINDOW_S)  # the window's records, read once
        return {
            "schema": SCHEMA,
            "router": self._router.name,
            # The routers whose requests the figures count (this one, and the others with
            # an HTTP door that answered this tick).
            "routers_counted": list(self._counted),
            "generated_at": now,
            "sample_every_seconds": SAMPLE_S,
            "window_seconds": WINDOW_S,
            "nodes": nodes,
            "hosts": self._hosts(reports),
            "models": {
                name: asdict(f) for name, f in figures(done, failed, models, WINDOW_S).items()
            },
            "targets": self._targets(done),
        }

    def _node_row(self, node: Node, r: NodeReport | None) -> dict[str, Any]:
        asked = self._last.get(node.name)
        age_s = time.monotonic() - asked[1] if asked is not None else None
        health = "down" if r is None else ("serving" if r.ready else "not ready")
        problem = r.problem if r is not None else "no answer to GetNodeInfo"
        stale = node.name not in self._asked_now
        if r is not None and stale and self._serving is not None and not self._serving(node):
            # Asked a while ago; the health watch saw it go since.
            health = "down"
            problem = f"its health watch lost it (GetNodeInfo answered {age_s or 0.0:.0f} s ago)"
        return {
            "name": node.name,
            "role": node.role,
            "host": node.host,
            "address": node.address,
            "models": self._topology.models_served_by(node.name)
            if node.role != "router"
            else [m.name for m in self._topology.models],
            "engine": node.engine or "",
            "health": health,
            "problem": problem,
            "asked_seconds_ago": age_s,
            "backend": r.backend if r is not None else "",
            "gpu_layers": r.gpu_layers if r is not None else 0,
            "model_layers": r.model_layers if r is not None else 0,
            "slots": r.slots if r is not None else 0,
            "slots_busy": r.slots_busy if r is not None else 0,
            "queue_depth": r.queue_depth if r is not None else 0,
            "restarts": r.restarts if r is not None else 0,
            "uptime_seconds": r.uptime_seconds if r is not None else None,
        }

    def _hosts(self, reports: list[tuple[Node, NodeReport | None]]) -> list[dict[str, Any]]:
        """The topology's hosts, each with its nodes and the machine's figures (from the
        first of its nodes that answered)."""
        hosts: dict[str, dict[str, Any]] = {}
        for node, report in reports:
            row = hosts.setdefault(node.host, {"host": node.host, "nodes": [], "usage": None})
            row["nodes"].append(node.name)
            if row["usage"] is None and report is not None and report.host is not None:
                row["usage"] = asdict(report.host)
        return list(hosts.values())

    def _targets(self, done: list[Done]) -> list[dict[str, Any]]:
        """The seeds' targets: latency, rate and overlap over the window's `done`; errors
        and failovers over the hour."""
        hour = self._recent.hour()
        values: dict[str, float | None] = {
            "end_to_end_p95": percentile([d.total_s for d in done], 95),
            "requests_per_second": len(done) / WINDOW_S if done else None,
            "parallel_efficiency": parallel_efficiency(done),
            "uptime": (
                100.0 * sum(self._serving_ticks.values()) / sum(self._watched_ticks.values())
                if any(self._watched_ticks.values())
                else None
            ),
            "error_rate": (
                100.0 * hour.failed / (hour.done + hour.failed)
                if hour.done or hour.failed
                else None
            ),
            "failover": hour.longest_failover_s,
        }
        rows = []
        for key, what, goal, unit, lower in TARGETS:
            value = values[key]
            ok = None if value is None else (value < goal if lower else value > goal)
            rows.append(
                {"key": key, "what": what, "goal": goal, "unit": unit, "value": value, "ok": ok}
            )
        return rows

    def _sample(self, now: float) -> dict[str, Any]:
        """What the charts draw: one point per tick, its values (not `t`) to 4 significant
        digits (an hour of them is what GET /api/dashboard sends)."""
        models = self.current.get("models", {})
        hosts = [h for h in self.current.get("hosts", []) if h["usage"] is not None]
        return {
            "t": now,
            "models": {
                name: {
                    "rps": _chart(f["requests_per_second"]),
                    "tps": _chart(f["tokens_per_second"]),
                    **{
                        f"{short}_{p}": _chart(f[f"{short}_seconds"].get(p))
                        for short in ("ttft", "total")
                        for p in ("p50", "p95", "p99")
                    },
                }
                for name, f in models.items()
            },
            "hosts": {h["host"]: _host_point(h["usage"]) for h in hosts},
            "serving": sum(1 for n in self.current.get("nodes", []) if n["health"] == "serving"),
        }


def dumps(value: Any) -> str:
    """JSON as the dashboard's routes send it: compact, no NaN."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _with_key(encoded: str, key: str, value: str) -> str:
    """An encoded JSON object (not empty) with one more key whose value is encoded."""
    assert encoded.endswith("}") and encoded != "{}"
    return f'{encoded[:-1]},"{key}":{value}}}'


def _host_point(u: dict[str, Any]) -> dict[str, float | None]:
    """A host's CPU, memory and GPU (None: no GPU seen) in percent."""
    return {
        "cpu": _chart(u["cpu_busy_percent"]),
        "memory": _chart(100.0 * u["memory_used_bytes"] / max(1, u["memory_total_bytes"])),
        "gpu": _chart(u["gpu_utilization_percent"]) if u["gpu_name"] else None,
    }


def _chart(value: float | None) -> float | None:
    """A chart's value to 4 significant digits."""
    return None if value is None else float(f"{value:.4g}")
