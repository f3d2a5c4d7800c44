"""The floor under the router's CPU per request (#41, bench/scale.py): a bare Python gRPC
asyncio relay making a router's calls for a request and nothing else. A client's stream
comes in; the relay makes one unary call (as the prefill stage does) and relays a server
stream (the decode stage's) message for message. No choice of node, health, logging,
metrics or summary. Backend and relay run in processes of their own, on loopback; the
relay's CPU time (/proc) over the requests is what any Python gRPC router pays here for
those calls at that rate.

    python -m bench.relay_floor [--rate 13.3] [--requests 400] [--messages 4] [--gap-ms 0]

--gap-ms spaces the streamed messages as a decode node paces its tokens (each then wakes
the relay on its own, as a lone stream's tokens do: row 2's router against this, #42):
`--rate 0.5 --requests 4 --messages 400 --gap-ms 8` is one 400-token stream at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from bench.common import cpu_seconds
from disagg_mesh.proto.v1 import (
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    types_pb2,
)
from disagg_mesh.server.common.runtime.grpc_io import older_io_env
from disagg_mesh.server.common.runtime.processes import free_port


class _Backend(router_pb2_grpc.RouterServiceServicer, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, messages: int, gap_s: float) -> None:
        self._messages = messages
        self._gap_s = gap_s

    async def Prefill(self, request: Any, context: Any) -> Any:
        return prefill_pb2.PrefillResponse(kv_handle="h", prompt_tokens=1_000)

    async def FetchKv(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield prefill_pb2.FetchKvResponse()

    async def ListModels(self, request: Any, context: Any) -> Any:
        return router_pb2.ListModelsResponse()

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for _ in range(self._messages - 1):
            if self._gap_s:
                await asyncio.sleep(self._gap_s)
            yield router_pb2.GenerateResponse(delta=types_pb2.TextDelta(text=" word" * 8))
        yield router_pb2.GenerateResponse(summary=router_pb2.GenerateSummary(decode_node="d"))


class _Relay(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, backend: str) -> None:
        channel = grpc.aio.insecure_channel(backend)
        self._prefill: Any = prefill_pb2_grpc.PrefillServiceStub(channel)
        self._decode: Any = router_pb2_grpc.RouterServiceStub(channel)

    async def ListModels(self, request: Any, context: Any) -> Any:
        return router_pb2.ListModelsResponse()

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        prefill = prefill_pb2.PrefillRequest(model=request.model, prompt=request.prompt)
        await self._prefill.Prefill(prefill, timeout=30)
        async for reply in self._decode.Generate(request, timeout=30):
            yield reply


async def _serve(port: int, backend: str | None, messages: int, gap_s: float) -> None:
    server = grpc.aio.server()
    if backend is None:
        servicer = _Backend(messages, gap_s)
        router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    else:
        router_pb2_grpc.add_RouterServiceServicer_to_server(_Relay(backend), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def floor_ms(rate: float, requests: int, messages: int, gap_s: float = 0.0) -> float:
    """The relay's CPU milliseconds per request, requests sent at `rate` a second (each its
    own task, as the benchmark's clients send them), the backend's messages gap_s apart."""
    backend_port, relay_port = free_port(), free_port()
    here = [sys.executable, "-m", "bench.relay_floor"]
    env = {**os.environ, **older_io_env()}  # gRPC's I/O path as the mesh's processes take it
    procs = [
        await asyncio.create_subprocess_exec(
            *here,
            *("--serve", str(backend_port), "--messages", str(messages)),
            *("--gap-ms", repr(1000 * gap_s)),
            env=env,
        ),
        await asyncio.create_subprocess_exec(
            *here, "--serve", str(relay_port), "--backend", f"127.0.0.1:{backend_port}", env=env
        ),
    ]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}") as channel:
            stub: Any = router_pb2_grpc.RouterServiceStub(channel)
            request = router_pb2.GenerateRequest(model="m", prompt="x " * 1_000)

            async def one() -> None:
                async for _ in stub.Generate(request, timeout=30, wait_for_ready=True):
                    pass

            for _ in range(20 if not gap_s else 2):  # connections made, code paths warm
                await one()
            before = cpu_seconds([procs[1].pid])
            started = time.perf_counter()
            tasks = []
            for i in range(requests):
                delay = started + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one()))
            await asyncio.gather(*tasks)
            return 1000 * (cpu_seconds([procs[1].pid]) - before) / requests
    finally:
        for proc in procs:
            proc.kill()
            await proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=13.3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--messages", type=int, default=4)
    parser.add_argument("--gap-ms", type=float, default=0.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.backend, args.messages, args.gap_ms / 1000))
        return 0
    ms = asyncio.run(floor_ms(args.rate, args.requests, args.messages, args.gap_ms / 1000))
    print(
        f"bare relay CPU per request at {args.rate:g}/s: {ms:.2f} ms "
        f"({ms / args.messages:.3f} ms a message)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
