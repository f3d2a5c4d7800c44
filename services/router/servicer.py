"""RouterService: protobuf in, plain Python to `Router`, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc
from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.wire import convert
from disagg_mesh.server.common.wire.mirror import duration, register, register_enum, to_proto
from disagg_mesh.server.router.routing import (
    FailedAttempt,
    Migration,
    ResumeInfo,
    RouteMethod,
    Router,
    RouteSummary,
)

Context = grpc.aio.ServicerContext[Any, Any]

ROUTE_METHOD_TO_PROTO = {
    RouteMethod.DISAGGREGATED: router_pb2.ROUTE_METHOD_DISAGGREGATED,
    RouteMethod.DECODE_ONLY: router_pb2.ROUTE_METHOD_DECODE_ONLY,
    RouteMethod.DIRECT_OLLAMA: router_pb2.ROUTE_METHOD_DIRECT_OLLAMA,
}


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router, http_url: str = "") -> None:
        self._router = router
        self._http_url = http_url

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        events = self._router.generate_resumable(
            request.model,
            convert.prompt_from_proto(request),
            convert.sampling_from_proto(request.sampling, self._router.max_tokens_limit),
            context.time_remaining(),
            resume=convert.continuation_from_proto(request.continuation)
            if request.HasField("continuation")
            else None,
            resumed_from=request.resumed_from_router,
        )
        resume: router_pb2.ResumeInfo | None = None
        async with aclosing(events) as stream:
            async for event in stream:
                if isinstance(event, RouteSummary):
                    yield router_pb2.GenerateResponse(summary=summary_to_proto(event))
                elif isinstance(event, ResumeInfo):  # goes out with the next delta
                    resume = router_pb2.ResumeInfo(
                        first_token_from_prefill=event.first_token_from_prefill,
                        prompt_cached_tokens=event.prompt_cached_tokens,
                    )
                else:
                    reply = router_pb2.GenerateResponse(delta=convert.text_delta_to_proto(event))
                    if resume is not None:
                        reply.resume.CopyFrom(resume)
                        resume = None
                    yield reply

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: Context
    ) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(
            models=[
                router_pb2.ModelRoute(
                    model=route.name,
                    prefill_nodes=[_node_info(n) for n in prefill],
                    decode_nodes=[_node_info(n) for n in decode],
                    prefill_deadline=duration(route.prefill_deadline_s),
                    decode_deadline=duration(route.decode_deadline_s),
                )
                for route, prefill, decode in self._router.routes()
            ],
            http_url=self._http_url,
        )


def _node_info(node: Node) -> router_pb2.NodeInfo:
    return router_pb2.NodeInfo(
        name=node.name,
        address=node.address,
        engine=node.engine or "",
        engine_model=node.model or "",
    )


def summary_to_proto(s: RouteSummary) -> router_pb2.GenerateSummary:
    summary: router_pb2.GenerateSummary = to_proto(s)
    return summary


# The router's summary mirrors GenerateSummary field for field (wire/mirror.py).
register_enum(RouteMethod, ROUTE_METHOD_TO_PROTO)
register(FailedAttempt, router_pb2.FailedAttempt)
register(Migration, router_pb2.Migration)
register(RouteSummary, router_pb2.GenerateSummary)
