"""PrefillService: protobuf in, plain Python to `PrefillNode`, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from disagg_mesh.proto.v1 import prefill_pb2
from disagg_mesh.server.common.runtime.readiness import Ready
from disagg_mesh.server.common.types import DecodeCandidate
from disagg_mesh.server.common.wire import convert
from disagg_mesh.server.common.wire.mirror import to_proto
from disagg_mesh.server.prefill.node import PrefillNode

Context = grpc.aio.ServicerContext[Any, Any]
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServicer:
    def __init__(self, node: Ready[PrefillNode]) -> None:
        self._node = node

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: Context
    ) -> prefill_pb2.PrefillResponse:
        result = await self._node.get().prefill(
            request.model,
            convert.prompt_from_proto(request),
            convert.sampling_from_proto(request.sampling, self._node.get().max_tokens_limit),
            [DecodeCandidate(c.node, frozenset(c.block_hashes)) for c in request.decode_candidates],
            convert.continuation_from_proto(request.continuation)
            if request.HasField("continuation")
            else None,
            convert.limits_from_proto(request),
        )
        response: prefill_pb2.PrefillResponse = to_proto(result)
        return response

    async def FetchKv(
        self, request: prefill_pb2.FetchKvRequest, context: Context
    ) -> AsyncIterator[bytes]:
        """Yields FetchKvResponse messages serialized when the state was stored (kv_wire)."""
        for message in self._node.get().fetch(request.kv_handle):
            yield message


def add_prefill_service(servicer: PrefillServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_PrefillServiceServicer_to_server, except that FetchKv's replies
    are already serialized."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Prefill": grpc.unary_unary_rpc_method_handler(
            servicer.Prefill,
            request_deserializer=prefill_pb2.PrefillRequest.FromString,
            response_serializer=prefill_pb2.PrefillResponse.SerializeToString,
        ),
        "FetchKv": grpc.unary_stream_rpc_method_handler(
            servicer.FetchKv,
            request_deserializer=prefill_pb2.FetchKvRequest.FromString,
            response_serializer=None,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
