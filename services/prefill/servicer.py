"""PrefillService: protobuf in, plain Python to `PrefillNode`, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from disagg.v1 import prefill_pb2, prefill_pb2_grpc
from services.common import convert
from services.common.readiness import Ready
from services.prefill.node import PrefillNode

Context = grpc.aio.ServicerContext[Any, Any]


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, node: Ready[PrefillNode]) -> None:
        self._node = node

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: Context
    ) -> prefill_pb2.PrefillResponse:
        result = await self._node.get().prefill(
            request.model,
            convert.prompt_from_proto(request.prompt, request.messages),
            convert.sampling_from_proto(request.sampling),
        )
        return prefill_pb2.PrefillResponse(
            kv_handle=result.kv_handle,
            first_token_id=result.first_token_id,
            first_token_text=result.first_token_text,
            prompt_tokens=result.prompt_tokens,
            prefill_duration=convert.duration(result.prefill_seconds),
            kv_size_bytes=result.kv_size_bytes,
            fingerprint=convert.fingerprint_to_proto(result.fingerprint),
            kv_ttl=convert.duration(result.kv_ttl_seconds),
            kv_transfer=convert.KV_TRANSFER_TO_PROTO[result.kv_transfer],
        )

    async def FetchKv(
        self, request: prefill_pb2.FetchKvRequest, context: Context
    ) -> AsyncIterator[prefill_pb2.FetchKvResponse]:
        for chunk in self._node.get().fetch(request.kv_handle):
            yield prefill_pb2.FetchKvResponse(
                offset_bytes=chunk.offset,
                data=chunk.data,
                total_size_bytes=chunk.total_size,
                sha256=chunk.sha256,
                fingerprint=(
                    convert.fingerprint_to_proto(chunk.fingerprint) if chunk.fingerprint else None
                ),
            )
