"""The one place that turns exceptions into gRPC statuses, and every RPC's request scope.

`RequestScopeInterceptor` wraps each of our RPC handlers: it binds the request id (from the
caller's `x-request-id` metadata, or a new one) to every log line of the call, sends it
back as initial metadata, maps `MeshError`s to their status codes and anything unexpected to
INTERNAL, and logs one summary line per call with its outcome and duration.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from disagg_mesh.server.common.errors import (
    RETRY_AFTER_KEY,
    RETRY_AFTER_S,
    MeshError,
    retry_after,
)
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.runtime.observability.logging import REQUEST_ID_KEY, new_request_id

log = structlog.get_logger("rpc")


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, MeshError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream call failed: keep its status
        return exc.code(), exc.details() or exc.code().name
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _request_id(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and 0 < len(value) <= 128:
            return value
    return new_request_id()


class _Scope:
    def __init__(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.method = method
        self.context = context
        self.request_id = _request_id(context)
        self.started = time.perf_counter()

    async def __aenter__(self) -> _Scope:
        metrics.IN_FLIGHT.labels(self.method).inc()
        structlog.contextvars.bind_contextvars(request_id=self.request_id)
        await self.context.send_initial_metadata(((REQUEST_ID_KEY, self.request_id),))
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        elapsed_ms = round((time.perf_counter() - self.started) * 1000, 2)
        metrics.IN_FLIGHT.labels(self.method).dec()
        try:
            if exc is None:
                self._count_and_log("rpc done", "OK", elapsed_ms)
                return
            # The caller went away: its task cancelled, or, when that came while gRPC was
            # sending a message, the stream's generator closed later (GeneratorExit): no
            # status to send either way.
            if isinstance(exc, asyncio.CancelledError | GeneratorExit):
                self._count_and_log("rpc cancelled", "CANCELLED", elapsed_ms)
                return
            if isinstance(exc, grpc.aio.AbortError):  # the handler set its own status
                self._count_and_log("rpc aborted", "ABORTED_BY_HANDLER", elapsed_ms)
                return
            code, message = status_of(exc)
            if code == grpc.StatusCode.INTERNAL and not isinstance(exc, MeshError):
                metrics.RPCS.labels(self.method, code.name).inc()
                log.exception(
                    "rpc failed", method=self.method, code=code.name, duration_ms=elapsed_ms
                )
            else:
                self._count_and_log("rpc failed", code.name, elapsed_ms, error=message)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy: when to try again
                after_s = retry_after(exc) if isinstance(exc, MeshError) else RETRY_AFTER_S
                self.context.set_trailing_metadata(((RETRY_AFTER_KEY, str(round(after_s * 1000))),))
            await self.context.abort(code, message)  # raises AbortError
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def _count_and_log(self, event: str, code: str, elapsed_ms: float, **extra: str) -> None:
        """The call's one summary line, and its count by method and code."""
        metrics.RPCS.labels(self.method, code).inc()
        log.info(event, method=self.method, code=code, duration_ms=elapsed_ms, **extra)


class RequestScopeInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith("/disagg."):
            return handler  # health and reflection stay as they are
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(method: str, inner: Any) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        async with _Scope(method, context):
            return await inner(request, context)

    return handle


def _wrap_stream(method: str, inner: Any) -> Any:
    async def handle(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async with _Scope(method, context):
            stream = inner(request, context)
            try:
                async for response in stream:
                    yield response
            finally:
                await stream.aclose()

    return handle
