"""DecodeService: protobuf in, plain Python to `DecodeNode`, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from disagg.v1 import decode_pb2, decode_pb2_grpc
from services.common.errors import InvalidArgument
from services.common.runtime.readiness import Ready
from services.common.types import Continuation, DecodeStats, KvSource, Prompt
from services.common.wire import convert
from services.decode.node import DecodeNode

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
            request.model, source, sampling, context.time_remaining(), continuation
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
        kv = request.kv
        return KvSource(
            prefill_address=kv.prefill_address,
            kv_handle=kv.kv_handle,
            first_token_id=kv.first_token_id,
            prompt_tokens=kv.prompt_tokens,
            fingerprint=convert.fingerprint_from_proto(kv.fingerprint),
            kv_size_bytes=kv.kv_size_bytes,
            first_token_text=kv.first_token_text,
            block_hashes=tuple(kv.block_hashes),
            prefix_tokens=kv.prefix_tokens,
            open_message=tuple(kv.open_message_token_ids),
        )
    return convert.prompt_from_proto(request.prompt, request.messages, request.reasoning_effort)
