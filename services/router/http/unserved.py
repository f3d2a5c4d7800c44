"""Requests for a path or method the router's doors do not serve: answered in the error
format of the API the path belongs to (OpenAI's under /v1, Ollama's elsewhere), naming what
was asked and what is served, instead of aiohttp's bare plain-text "404: Not Found"."""

from __future__ import annotations

from typing import Any

import grpc
import structlog
from aiohttp import web

from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.router.http import ollama_api, openai_api
from disagg_mesh.server.router.http.common import Handler

log = structlog.get_logger("http")

_NO_EMBEDDINGS = "the mesh generates text; it computes no embeddings"
_TOPOLOGY_MODELS = (
    "the mesh's topology lists the models it serves: edit it and restart the mesh to change them"
)
# Paths clients try that the mesh does not serve, and why not.
WHY_NOT = {
    "/api/embed": _NO_EMBEDDINGS,
    "/api/embeddings": _NO_EMBEDDINGS,
    "/v1/embeddings": _NO_EMBEDDINGS,
    "/api/pull": _TOPOLOGY_MODELS,
    "/api/push": _TOPOLOGY_MODELS,
    "/api/create": _TOPOLOGY_MODELS,
    "/api/copy": _TOPOLOGY_MODELS,
    "/api/delete": _TOPOLOGY_MODELS,
}
# Paths under these, and why not (a stored response asked for again, cancelled or deleted).
WHY_NOT_UNDER = {
    "/v1/responses/": "this mesh keeps no responses, as Ollama keeps none: each is answered "
    "in the request that asks for it",
}


class _Unserved(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class _WrongMethod(MeshError):
    code = grpc.StatusCode.UNIMPLEMENTED


@web.middleware
async def unserved_paths(request: web.Request, handler: Handler) -> web.StreamResponse:
    unmatched = request.match_info.http_exception
    if unmatched is None:
        return await handler(request)
    openai = request.path.startswith("/v1/") or request.path == "/v1"
    asked = f"{request.method} {request.path}"
    headers: dict[str, str] = {}
    error: MeshError
    if isinstance(unmatched, web.HTTPMethodNotAllowed):
        allowed = sorted(unmatched.allowed_methods - {"HEAD"})
        error = _WrongMethod(f"{asked}: the method is not allowed here; use {' or '.join(allowed)}")
        headers["Allow"] = ", ".join(sorted(unmatched.allowed_methods))
    else:
        why = WHY_NOT.get(request.path.rstrip("/")) or next(
            (why for under, why in WHY_NOT_UNDER.items() if request.path.startswith(under)), None
        )
        served = ", ".join(_served(request.app, openai))
        error = _Unserved(
            f"this mesh does not serve {asked}"
            + (f" ({why})" if why else "")
            + f"; it serves {served}"
        )
    body: dict[str, Any] = (openai_api if openai else ollama_api).error_body(
        error, unmatched.status
    )
    log.info("http unserved", path=asked, status=unmatched.status)
    # One label for every such path, whatever callers send: the metric's series stay few.
    api = "openai" if openai else "ollama"
    metrics.HTTP_REQUESTS.labels(api, "unserved", str(unmatched.status)).inc()
    return web.json_response(body, status=unmatched.status, headers=headers)


def _served(app: web.Application, openai: bool) -> list[str]:
    """The door's routes of one API as METHOD /path (not HEAD, which aiohttp adds to each
    GET, nor the dashboard's)."""
    prefix = "/v1/" if openai else "/api/"
    served = []
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method != "HEAD" and path.startswith(prefix):
            if not path.startswith("/api/dashboard"):
                served.append(f"{route.method} {path}")
    return served
