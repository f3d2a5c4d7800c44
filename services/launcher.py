"""`make run`: start every node of a topology on this machine, wait until all are SERVING,
stream one example generation per logical model through the router, then serve until Ctrl-C.

    python -m services.launcher [--topology topology/local.toml] [--exit-after-examples]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

from disagg_mesh import AsyncMeshClient, GenerateCall, MeshError, Metrics, TlsFiles
from services.common.auth import TokenError, token_from_topology
from services.common.processes import MeshProcesses, MeshStartError
from services.common.tls import tls_paths
from services.common.topology import TopologyError, load_topology

EXAMPLES = {
    "qwen3-coder:30b": "Review this Python function and name one bug:\n\n"
    "def average(xs):\n    return sum(xs) / len(xs) + 1\n",
    "gpt-oss:120b": "Write two sentences of encouraging feedback for a student whose essay "
    "had a clear thesis but weak evidence.",
}
DEFAULT_EXAMPLE = "Say hello in one short sentence."


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
        async for item in mesh.stream(call):
            if isinstance(item, Metrics):
                metrics = item
            else:
                sys.stdout.write(item)
                sys.stdout.flush()
    say()
    assert metrics is not None  # the client raises if the stream ends without them
    return metrics


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
        say(f"\n>> mesh serving; router at {router}. Ctrl-C stops every node.")
        r = topology.router
        if r.http_port is not None:
            scheme = "https" if paths else "http"
            base = f"{scheme}://{r.host}:{r.http_port}"
            say(
                f'>> HTTP: Ollama API at {base} (e.g. ollama.Client(host="{base}")), OpenAI API '
                f"at {base}/v1"
            )
        await stop.wait()
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
    parser.add_argument("--topology", default="topology/local.toml")
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
