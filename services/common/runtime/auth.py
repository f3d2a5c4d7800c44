"""The optional shared bearer token: checked on every service but health, carried on calls.

The token itself never sits in a topology file: `[security] token_env` names the environment
variable that holds it. A missing or wrong token gets UNAUTHENTICATED with one message for
both, never a hint of which part was wrong.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from disagg_mesh.server.common.config.topology import Topology

HEADER = "authorization"
DENIED = "missing or invalid token"
_EXEMPT_PREFIX = "/grpc.health.v1.Health/"

_token: str | None = None


class TokenError(Exception):
    """The topology asks for a token that the environment does not hold."""


def token_from_topology(topology: Topology) -> str | None:
    name = topology.security.token_env
    if name is None:
        return None
    token = os.environ.get(name, "")
    if not token:
        raise TokenError(
            f"{topology.source}: security.token_env says the token is in ${name}, "
            "which is empty or not set"
        )
    return token


def use_token(token: str | None) -> None:
    """This process requires the token on its services and sends it on its own calls."""
    global _token
    _token = token or None


def configured_token() -> str | None:
    return _token


def bearer_accepted(authorization: str) -> bool:
    """Whether an Authorization value carries the mesh's token (any value, for a mesh
    without one): the HTTP doors and the dashboard."""
    if _token is None:
        return True
    return hmac.compare_digest(authorization.encode(), f"Bearer {_token}".encode())


def outgoing_auth() -> tuple[tuple[str, str], ...]:
    return ((HEADER, f"Bearer {_token}"),) if _token else ()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_EXEMPT_PREFIX):
            return handler
        given = next(
            (v for k, v in handler_call_details.invocation_metadata or () if k == HEADER), ""
        )
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    async def stream(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        nothing: tuple[Any, ...] = ()
        for item in nothing:  # an async generator that yields nothing: abort raises first
            yield item
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    kwargs: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream, **kwargs)
