"""DecodeService: protobuf in, plain Python to `DecodeNode`, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from disagg_mesh.proto.v1 import decode_pb2, decode_pb2_grpc
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.runtime.readiness import Ready
from disagg_mesh.server.common.types import Continuation, DecodeStats, KvSource, Prompt
from disagg_mesh.server.common.wire import convert
from disagg_mesh.server.common.wire.mirror import from_proto
from disagg_mesh.server.decode.node import DecodeNode

Context = grpc.aio.ServicerContext[Any, Any]


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, node: Ready[DecodeNode]) -> None:
        self._node = node

    async def Generate(
        self, request: decode_pb2.DecodeServiceGenerateRequest, context: Context
    ) -> AsyncIterator[decode_pb2.DecodeServiceGenerateResponse]:
        node = self._node.get()
        source = _source(request)
        sampling = convert.sampling_from_proto(request.sampling, node.max_tokens_limit)
        continuation = _continuation(request)
        events = node.generate(
            request.model,
            source,
            sampling,
            context.time_remaining(),
            continuation,
            convert.limits_from_proto(request),
        )
        async with aclosing(events) as stream:
            async for event in stream:
                if isinstance(event, DecodeStats):
                    yield decode_pb2.DecodeServiceGenerateResponse(
                        summary=convert.decode_stats_to_proto(event)
                    )
                else:
                    yield decode_pb2.DecodeServiceGenerateResponse(
                        delta=convert.text_delta_to_proto(event)
                    )


def _continuation(request: decode_pb2.DecodeServiceGenerateRequest) -> Continuation | None:
    if not request.HasField("continuation"):
        return None
    return convert.continuation_from_proto(request.continuation)


def _source(request: decode_pb2.DecodeServiceGenerateRequest) -> KvSource | Prompt:
    has_prompt = bool(request.prompt or request.messages)
    if request.HasField("kv"):
        if has_prompt:
            raise InvalidArgument("kv", "set either kv or prompt/messages, not both")
        return from_proto(request.kv, KvSource)
    return convert.prompt_from_proto(request)
