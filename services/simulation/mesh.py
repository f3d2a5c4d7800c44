"""The workload through the real mesh: the simulated topology's processes (routers, and sim
nodes: a process per host, hosts sharing them beyond PROCESSES), the requests sent as
`disagg batch` sends them, each node's use from its own busy-time counts. Times are real
seconds times the speedup: simulated seconds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from disagg_mesh.batch import BatchRequest
from disagg_mesh.client import AsyncMeshClient
from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.server.common.config.topology import Node, load_topology
from disagg_mesh.server.common.runtime.processes import MeshProcesses
from disagg_mesh.server.simulation.baseline import Served

# The sim nodes of each host run in a process (they share the host's compute), up to this
# many processes; beyond, hosts share them.
PROCESSES = 16


@dataclass
class NodeUse:
    """How busy a node was over the run: the share of the time it had a slot in use, and of
    its slots' time, from its own counts (GetNodeInfo's busy_seconds and slot_busy_seconds,
    read before and after the run)."""

    wall_seconds: float = 0.0
    busy_seconds: float = 0.0
    slot_busy_seconds: float = 0.0
    slots: int = 0

    @property
    def active_share(self) -> float:
        return min(self.busy_seconds / self.wall_seconds, 1.0) if self.wall_seconds else 0.0

    @property
    def slots_share(self) -> float:
        if not self.wall_seconds or not self.slots:
            return 0.0
        return min(self.slot_busy_seconds / (self.slots * self.wall_seconds), 1.0)


@dataclass
class MeshRun:
    wall_seconds: float = 0.0
    concurrency: int = 0
    model_concurrency: dict[str, int] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)
    # Per request: its route's method, nodes, KV bytes moved (the real size) and cached
    # prompt tokens, as the router reported them.
    details: list[dict[str, Any]] = field(default_factory=list)
    use: dict[str, NodeUse] = field(default_factory=dict)


async def run_mesh(
    topology_file: Path,
    requests: Sequence[BatchRequest],
    speedup: float,
    log_dir: Path,
    concurrency: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> MeshRun:
    topology = load_topology(topology_file)
    processes = MeshProcesses(topology, log_dir)
    processes.start([n for n in topology.nodes if n.engine != "sim"])
    # A host's sim nodes in one process (they share its compute), up to PROCESSES.
    hosts: dict[str, list[Node]] = {}
    for node in topology.nodes:
        if node.engine == "sim":
            hosts.setdefault(node.machine, []).append(node)
    groups = list(hosts.values())
    per = -(-len(groups) // PROCESSES)
    for i in range(0, len(groups), per):
        processes.start_group([node for group in groups[i : i + per] for node in group])
    try:
        await processes.wait_serving(timeout_s=120, progress=progress)
        await asyncio.to_thread(processes.wait_routers_see_serving)
        routers = [r.address for r in topology.routers]
        async with AsyncMeshClient(routers, timeout=24 * 3600) as client:
            nodes = [n for n in topology.nodes if n.role != "router"]
            before = await _busy(nodes)
            began = time.monotonic()
            batch = await client.batch_run(requests, concurrency=concurrency)
            run = MeshRun(concurrency=batch.concurrency, model_concurrency=batch.model_concurrency)
            started = time.monotonic()
            done = 0
            try:
                async for result in batch.results():
                    run.served.append(_served(result, speedup))
                    run.details.append(dict((result.body or {}).get("disagg") or {}))
                    done += 1
                    if progress is not None and done % max(len(requests) // 10, 1) == 0:
                        progress(f"{done}/{len(requests)} requests answered")
            finally:
                run.wall_seconds = (time.monotonic() - started) * speedup
            wall = time.monotonic() - began
            after = await _busy(nodes)
            for name, (busy, slot_busy, slots) in after.items():
                was = before.get(name)
                if was is not None and busy >= was[0]:  # else it started again: from its start
                    busy, slot_busy = busy - was[0], slot_busy - was[1]
                run.use[name] = NodeUse(wall, busy, slot_busy, slots)
        return run
    finally:
        processes.stop()


def _served(result: Any, speedup: float) -> Served:
    body = result.body or {}
    usage = body.get("usage") or {}
    mesh = body.get("disagg") or {}
    return Served(
        result.custom_id,
        result.model,
        result.ok,
        time_to_first_token_seconds=float(mesh.get("time_to_first_token_seconds") or 0) * speedup,
        latency_seconds=result.latency_s * speedup,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        error="" if result.ok else result.message,
    )


async def _busy(nodes: Sequence[Node]) -> dict[str, tuple[float, float, int]]:
    """Each node's busy seconds, slot-seconds and slots so far, all asked at once (a node
    that does not answer is left out)."""

    async def one(node: Node) -> tuple[float, float, int] | None:
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub: Any = node_pb2_grpc.NodeServiceStub(channel)
            try:
                info = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=5.0)
            except grpc.aio.AioRpcError:
                return None
            return info.busy_seconds, info.slot_busy_seconds, info.slots

    got = await asyncio.gather(*(one(node) for node in nodes))
    return {node.name: use for node, use in zip(nodes, got, strict=True) if use is not None}
