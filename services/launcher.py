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

import grpc
from google.protobuf.duration_pb2 import Duration

from disagg.v1 import router_pb2, router_pb2_grpc, types_pb2
from services.common.processes import MeshProcesses, MeshStartError
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


async def stream_example(address: str, model: str, max_tokens: int) -> router_pb2.GenerateSummary:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(
            model=model,
            messages=[
                types_pb2.ChatMessage(role="user", content=EXAMPLES.get(model, DEFAULT_EXAMPLE))
            ],
            sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        summary = router_pb2.GenerateSummary()
        async for reply in stub.Generate(request, timeout=240):
            if reply.HasField("delta"):
                sys.stdout.write(reply.delta.text)
                sys.stdout.flush()
            else:
                summary = reply.summary
        say()
        return summary


def ms(d: Duration) -> float:
    return d.ToNanoseconds() / 1e6


def describe(s: router_pb2.GenerateSummary) -> str:
    method = router_pb2.RouteMethod.Name(s.method).removeprefix("ROUTE_METHOD_").lower()
    kv = types_pb2.KvTransfer.Name(s.kv_transfer).removeprefix("KV_TRANSFER_").lower()
    return (
        f"  {method} via {s.prefill_node or '-'} -> {s.decode_node} | kv {kv} "
        f"{s.kv_transfer_bytes / 1e6:.1f} MB in {ms(s.kv_transfer_duration):.1f} ms\n"
        f"  prompt {s.prompt_tokens} tok, prefill {ms(s.prefill_duration):.0f} ms "
        f"({s.prefill_tokens_per_second:.0f} tok/s) | completion {s.completion_tokens} tok, "
        f"decode {ms(s.decode_duration):.0f} ms ({s.decode_tokens_per_second:.0f} tok/s) | "
        f"TTFT {ms(s.time_to_first_token):.0f} ms | total {ms(s.total_duration):.0f} ms"
    )


async def main_async(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
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
            summary = await stream_example(router, route.name, args.max_tokens)
            say(describe(summary))
        if args.exit_after_examples:
            return 0
        say(f"\n>> mesh serving; router at {router}. Ctrl-C stops every node.")
        await stop.wait()
        return 0
    except MeshStartError as exc:
        say(f"error: {exc}")
        return 1
    except grpc.aio.AioRpcError as exc:
        say(f"\nerror: the example request failed: {exc.code().name}: {exc.details()}")
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
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
