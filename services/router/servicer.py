"""RouterService: protobuf in, plain Python to `Router`, protobuf out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from disagg.v1 import router_pb2, router_pb2_grpc
from services.common.config.topology import Node
from services.common.wire import convert
from services.router.routing import ResumeInfo, RouteMethod, Router, RouteSummary

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
            convert.prompt_from_proto(request.prompt, request.messages, request.reasoning_effort),
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
                    prefill_deadline=convert.duration(route.prefill_deadline_s),
                    decode_deadline=convert.duration(route.decode_deadline_s),
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
    return router_pb2.GenerateSummary(
        prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens,
        decode_cached_prompt_tokens=s.decode_cached_prompt_tokens,
        kv_state_bytes=s.kv_state_bytes,
        route_reason=s.route_reason,
        completion_tokens=s.completion_tokens,
        finish_reason=convert.FINISH_REASON_TO_PROTO[s.finish_reason],
        method=ROUTE_METHOD_TO_PROTO[s.method],
        kv_transfer=convert.KV_TRANSFER_TO_PROTO[s.kv_transfer],
        prefill_duration=convert.duration(s.prefill_seconds),
        prefill_tokens_per_second=s.prefill_tokens_per_second,
        kv_transfer_duration=convert.duration(s.kv_transfer_seconds),
        kv_transfer_bytes=s.kv_transfer_bytes,
        kv_load_duration=convert.duration(s.kv_load_seconds),
        time_to_first_token=convert.duration(s.time_to_first_token_seconds),
        decode_duration=convert.duration(s.decode_seconds),
        decode_tokens_per_second=s.decode_tokens_per_second,
        total_duration=convert.duration(s.total_seconds),
        prefill_node=s.prefill_node,
        prefill_address=s.prefill_address,
        decode_node=s.decode_node,
        decode_address=s.decode_address,
        decode_prompt_eval_duration=convert.duration(s.decode_prompt_eval_seconds),
        failed_attempts=[
            router_pb2.FailedAttempt(
                method=ROUTE_METHOD_TO_PROTO[f.method],
                node=f.node,
                code=f.code,
                message=f.message,
                duration=convert.duration(f.seconds),
            )
            for f in s.failed_attempts
        ],
        migrations=[
            router_pb2.Migration(
                failed_node=m.failed_node,
                code=m.code,
                tokens_delivered=m.tokens_delivered,
                resumed_on=m.resumed_on,
                resume_duration=convert.duration(m.resume_seconds),
                via_prefill_node=m.via_prefill_node,
                reason=m.reason,
            )
            for m in s.migrations
        ],
    )
