"""Starting the nodes of a topology as child processes, waiting for them, stopping them.

Used by `make run` (services/launcher.py) and by the tests, so both run the mesh the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from disagg_mesh.server.common.config.topology import Node, Topology, load_topology
from disagg_mesh.server.common.runtime.tls import tls_for
from disagg_mesh.server.common.wire.node_clients import health_status, open_channel

# What a node started again by the launcher (make run) is told of its restarts: read by
# GetNodeInfo, the router's dashboard and the restarts metric.
RESTARTS_ENV = "DISAGG_RESTARTS"


def restarts() -> int:
    """Times the launcher started this process again (0 for a first start)."""
    return int(os.environ.get(RESTARTS_ENV, "0") or 0)


_ISSUED: set[int] = set()


def free_port() -> int:
    """A loopback port free now, and never handed out before by this process (the OS can
    give the same free port twice in a row, and two nodes of one topology must not share
    one). For topologies written on the fly: the tests and the benchmarks."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _ISSUED:
            _ISSUED.add(port)
            return port


class MeshStartError(Exception):
    """A node exited or did not become SERVING in time."""


class MeshProcesses:
    def __init__(self, topology: Topology, log_dir: Path) -> None:
        self.topology = topology
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, nodes: list[Node] | None = None) -> None:
        """Start these nodes (default all), each in a process of its own (start_group puts
        simulated ones together)."""
        for node in nodes or self.topology.nodes:
            self.start_node(node)

    def start_node(self, node: Node, extra_env: dict[str, str] | None = None) -> None:
        self.start_group([node], extra_env)

    def start_group(self, nodes: list[Node], extra_env: dict[str, str] | None = None) -> None:
        """One process serving these nodes (several: sim nodes only; their log: the first
        one's name + "-group.log"); procs maps each name to it, so stopping or killing one
        of them stops them all."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = nodes[0].name if len(nodes) == 1 else f"{nodes[0].name}-group"
        log = (self.log_dir / f"{name}.log").open("ab")
        env = {**os.environ, "LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "disagg_mesh.server.node",
                "--topology",
                str(self.topology.source),
                "--node",
                ",".join(n.name for n in nodes),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in order
        )
        log.close()
        for node in nodes:
            self.procs[node.name] = proc

    def wait_routers_see_serving(
        self,
        timeout_s: float = 15.0,
        names: list[str] | None = None,
        after: dict[str, int] | None = None,
    ) -> None:
        """Wait until each router has found every other node (or those named) serving: its
        health log line (LOG_FORMAT=json), past the first `after[router]` lines of its log.
        A router dials its nodes as it starts, before they listen (or again after one
        restarts); its channel then waits out a reconnect back-off (up to 0.5 s), and a call
        in that while fails at once, so a request could meet a node the router cannot reach
        yet although it is SERVING."""
        engines = set(names or (n.name for n in self.topology.nodes if n.role != "router"))
        deadline = time.monotonic() + timeout_s
        for router in self.topology.routers:
            skip = (after or {}).get(router.name, 0)
            while time.monotonic() < deadline:
                seen = set()
                for line in self.log_lines(router.name)[skip:]:
                    if '"event": "node health"' in line and '"serving": true' in line:
                        seen.add(json.loads(line)["node"])
                if engines <= seen:
                    break
                time.sleep(0.1)

    async def restart_node(self, name: str, timeout_s: float = 120.0) -> None:
        """Start a stopped or killed node again; return once it is SERVING and every router
        has found it so (its channel reconnected), as a node that never went away."""
        marks = {router.name: len(self.log_lines(router.name)) for router in self.topology.routers}
        self.start_node(self.topology.node(name))
        await self.wait_serving(timeout_s, names=[name])
        await asyncio.to_thread(self.wait_routers_see_serving, 15.0, [name], marks)

    def log_lines(self, name: str) -> list[str]:
        """Every line of the node's log so far."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def log_tail(self, name: str, lines: int = 15) -> str:
        return "\n".join(self.log_lines(name)[-lines:])

    async def wait_serving(
        self,
        timeout_s: float = 300.0,
        progress: Callable[[str], None] | None = None,
        every_s: float = 2.0,
        names: list[str] | None = None,
    ) -> None:
        """Return once every started node (or those named) reports SERVING; raise
        MeshStartError if one exits or the time runs out. progress() gets a line every
        `every_s` seconds."""
        started = time.monotonic()
        last_report = started
        pending = {name: "starting" for name in (names or self.procs)}
        channels = {name: self._channel(self.topology.node(name)) for name in pending}
        try:
            while pending:
                for name in list(pending):
                    code = self.procs[name].poll()
                    if code is not None:
                        log_file = self.log_dir / f"{name}.log"
                        raise MeshStartError(
                            f"node {name} exited with code {code} while starting; "
                            f"last lines of {log_file}:\n{self.log_tail(name)}"
                        )
                    pending[name], _ = await health_status(channels[name], timeout_s=1.0)
                    if pending[name] == "SERVING":
                        del pending[name]
                now = time.monotonic()
                if pending and now - started > timeout_s:
                    states = ", ".join(f"{n} ({s})" for n, s in pending.items())
                    raise MeshStartError(f"not SERVING after {timeout_s:g} s: {states}")
                if pending and progress and now - last_report >= every_s:
                    last_report = now
                    states = ", ".join(f"{n} ({s})" for n, s in pending.items())
                    progress(f"waiting for {len(pending)} node(s), {now - started:.0f} s: {states}")
                if pending:
                    await asyncio.sleep(0.2)
        finally:
            for channel in channels.values():
                await channel.close()

    def _channel(self, node: Node) -> grpc.aio.Channel:
        """A channel to the node as the mesh's own nodes reach it (TLS when configured)."""
        tls = tls_for(self.topology, node)
        return open_channel(node.address, tls.channel_credentials() if tls else None)

    def stop_node(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 15.0) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(sig)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop(self, grace_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every node, wait for them (grace_s in all), SIGKILL what is left."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        return codes


@asynccontextmanager
async def serving_mesh(
    topology_text: str, prefix: str, timeout_s: float = 300.0
) -> AsyncIterator[MeshProcesses]:
    """A topology written to a new temporary folder (its logs beside it), every node started
    and SERVING; all stopped afterwards. For the benchmarks that start meshes of their own."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    path = folder / "topology.toml"
    path.write_text(topology_text)
    mesh = MeshProcesses(load_topology(path), folder / "logs")
    mesh.start()
    try:
        await mesh.wait_serving(timeout_s)
        yield mesh
    finally:
        mesh.stop()
