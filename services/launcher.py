"""`make run`: start every node of a topology on this machine, wait until all are SERVING,
stream one example generation per logical model through the router, then serve until Ctrl-C.
A node that exits without being asked to (a crash, the OOM killer, kill -9) is started again
with backoff, and one line says which node, how it ended and that it was restarted.

    python -m disagg_mesh.server.launcher [--topology topology/local.toml] [--exit-after-examples]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from disagg_mesh import AsyncMeshClient, GenerateCall, MeshError, Metrics, TlsFiles
from disagg_mesh.errors import Unavailable
from disagg_mesh.server.common.config import DEFAULT_TOPOLOGY
from disagg_mesh.server.common.config.topology import TopologyError, load_topology
from disagg_mesh.server.common.runtime.auth import TokenError, token_from_topology
from disagg_mesh.server.common.runtime.processes import RESTARTS_ENV, MeshProcesses, MeshStartError
from disagg_mesh.server.common.runtime.tls import tls_paths

EXAMPLES = {
    "qwen3-coder:30b": "Review this Python function and name one bug:\n\n"
    "def average(xs):\n    return sum(xs) / len(xs) + 1\n",
    "gpt-oss:120b": "Write two sentences of encouraging feedback for a student whose essay "
    "had a clear thesis but weak evidence.",
}
DEFAULT_EXAMPLE = "Say hello in one short sentence."
# Restart backoff: 1 s, doubling to 30 s for a node that keeps dying; back to 1 s once a
# node has run for a minute.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
# How long the first example tries again while the router's channels reconnect.
START_RETRY_S = 10.0


def say(line: str = "") -> None:
    print(line, flush=True)


async def stream_example(
    address: str, model: str, max_tokens: int, token: str | None, tls: TlsFiles | None
) -> Metrics:
    """Stream one example generation through the router to the terminal."""
    call = GenerateCall(
        model=model,
        messages=[{"role": "user", "content": EXAMPLES.get(model, DEFAULT_EXAMPLE)}],
        max_tokens=max_tokens,
        temperature=0.0,
        timeout=240,
    )
    metrics: Metrics | None = None
    async with AsyncMeshClient(address, token=token, tls=tls) as mesh:
        # The router dialled its nodes while they started; a channel that found one not
        # listening yet waits out gRPC's reconnect back-off (up to 0.5 s: node_clients.py)
        # after the node says SERVING. So UNAVAILABLE before any text is tried again, for a
        # few seconds.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Unavailable),
            stop=stop_after_delay(START_RETRY_S),
            wait=wait_fixed(0.5),
            reraise=True,
        ):
            with attempt:
                started = False
                try:
                    async for item in mesh.stream(call):
                        started = True
                        if isinstance(item, Metrics):
                            metrics = item
                        elif isinstance(item, str):
                            sys.stdout.write(item)
                            sys.stdout.flush()
                except Unavailable as exc:
                    if started:
                        raise MeshError(exc.code, exc.message, exc.address) from None
                    raise
    say()
    assert metrics is not None  # the client raises if the stream ends without them
    return metrics


def how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    """Starts again a node that exits without being asked to, with backoff."""

    def __init__(self, mesh: MeshProcesses) -> None:
        self.mesh = mesh
        self.restarts: dict[str, int] = {}
        self._started_at = {name: time.monotonic() for name in mesh.procs}
        self._backoff: dict[str, float] = {}

    async def run(self, stop: asyncio.Event, every_s: float = 0.5) -> None:
        pending: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                for name, proc in list(self.mesh.procs.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    del self.mesh.procs[name]
                    task = asyncio.create_task(self._restart(name, code))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                try:
                    await asyncio.wait_for(stop.wait(), every_s)
                except TimeoutError:
                    pass
        finally:
            for task in pending:
                task.cancel()

    async def _restart(self, name: str, code: int) -> None:
        ran = time.monotonic() - self._started_at.get(name, 0.0)
        delay = BACKOFF_FIRST_S if ran >= STABLE_AFTER_S else self._backoff.get(name, 0.0)
        delay = min(max(delay, BACKOFF_FIRST_S), BACKOFF_MAX_S)
        self._backoff[name] = delay * 2
        count = self.restarts[name] = self.restarts.get(name, 0) + 1
        say(
            f">> node {name} exited ({how_it_ended(code)}); restarting it in {delay:g} s "
            f"(restart {count}; log: {self.mesh.log_dir / (name + '.log')})"
        )
        await asyncio.sleep(delay)
        self.mesh.start_node(self.mesh.topology.node(name), {RESTARTS_ENV: str(count)})
        self._started_at[name] = time.monotonic()


async def main_async(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    token = token_from_topology(topology)  # before starting anything: fail fast
    paths = tls_paths(topology, topology.router)
    # The examples call the router as the router's own calls go out (its certificate).
    client_tls = TlsFiles(paths.ca_file, paths.cert_file, paths.key_file) if paths else None
    mesh = MeshProcesses(topology, Path(args.log_dir))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    say(f">> starting {len(topology.nodes)} nodes of {args.topology} (logs in {args.log_dir}/)")
    for node in topology.nodes:
        say(f"   {node.name:<18} {node.role:<8} {node.address}")
    mesh.start()
    try:
        started = time.monotonic()
        waiting = asyncio.create_task(mesh.wait_serving(args.start_timeout, progress=say))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()
            say(">> interrupted while starting")
            return 130
        waiting.result()
        say(f">> all nodes SERVING after {time.monotonic() - started:.1f} s")
        router = topology.router.address
        for route in topology.models:
            say(f"\n>> {route.name}: streaming an example through the router at {router}")
            metrics = await stream_example(router, route.name, args.max_tokens, token, client_tls)
            say(f"   {metrics.one_line()}")
        if args.exit_after_examples:
            return 0
        supervisor = asyncio.create_task(Supervisor(mesh).run(stop))
        routers = topology.router_addresses.replace(",", ", ")
        say(f"\n>> mesh serving; routers at {routers}. Ctrl-C stops every node.")
        r = topology.router
        if r.http_port is not None:
            scheme = "https" if paths else "http"
            base = f"{scheme}://{r.host}:{r.http_port}"
            say(
                f'>> HTTP: Ollama API at {base} (e.g. ollama.Client(host="{base}")), OpenAI API '
                f"at {base}/v1"
            )
            say(f">> dashboard: {base}/dashboard (the mesh live; JSON at {base}/api/dashboard)")
        await stop.wait()
        await supervisor
        return 0
    except MeshStartError as exc:
        say(f"error: {exc}")
        return 1
    except MeshError as exc:
        say(f"\nerror: the example request failed: {exc}")
        return 1
    finally:
        say(">> stopping every node")
        codes = mesh.stop()
        failed = {n: c for n, c in codes.items() if c not in (0, None)}
        say(">> stopped" + (f" (non-zero exits: {failed})" if failed else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", default=DEFAULT_TOPOLOGY)
    parser.add_argument("--log-dir", default=".run/logs")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument(
        "--exit-after-examples", action="store_true", help="stop after the examples"
    )
    args = parser.parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except (TopologyError, TokenError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
