"""The ceiling for KV transfer: a plain gRPC stream of N bytes in 1 MiB messages.

Started by bench/run.py as a separate process (as a prefill node is); prints its port, then
serves `/bench.Bytes/Stream`: the request is the byte count as ASCII, the reply that many
bytes. Raw bytes, no protobuf: the cheapest stream grpc.aio can send.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

CHUNK = 1 << 20


async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    size = int(request)
    block = bytes(CHUNK)
    for offset in range(0, size, CHUNK):
        yield block[: min(CHUNK, size - offset)]


async def main() -> None:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 8 * CHUNK)])
    handler = grpc.method_handlers_generic_handler(
        "bench.Bytes", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
