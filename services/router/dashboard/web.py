"""The dashboard's HTTP routes on the router's HTTP port.

- `GET /dashboard`               the page (static files shipped in this package: no CDN)
- `GET /dashboard/static/NAME`   its script, style and the vendored uPlot (MIT, LICENSE-uPlot)
- `GET /api/dashboard`           the state as JSON, with the last hour's samples
- `GET /api/dashboard/events`    server-sent events: one `update` a tick (the state and
                                 that tick's sample); a page reconnects on its own
- `GET /api/dashboard/requests?since=T`  this router's requests that ended after T (its
                                 own clock), for the other routers' dashboards: each page
                                 counts the whole mesh's traffic, whichever router serves it

When the mesh has a token, every route wants it: `Authorization: Bearer TOKEN`, or
`?token=TOKEN` (a browser's EventSource sends no headers; the page passes on its own URL's).
"""

from __future__ import annotations

import asyncio
import functools
import math
import ssl
from dataclasses import asdict
from importlib import resources

import aiohttp
import structlog
from aiohttp import web

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.runtime.auth import bearer_accepted, outgoing_auth
from disagg_mesh.server.common.runtime.tls import TlsPaths
from disagg_mesh.server.router.dashboard.recent import Done, Failed
from disagg_mesh.server.router.dashboard.state import DashboardState, Pulled, dumps

log = structlog.get_logger("dashboard")

STATIC = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "LICENSE-uPlot": "text/plain",
}
# A comment line when nothing else was sent for this long keeps proxies from closing the feed.
KEEPALIVE_S = 15.0


@functools.cache
def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class DashboardApi:
    def __init__(self, state: DashboardState) -> None:
        self._state = state

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/dashboard", self.page),
            web.get("/dashboard/", self.page),
            web.get("/dashboard/static/{name}", self.static),
            web.get("/api/dashboard", self.snapshot),
            web.get("/api/dashboard/events", self.events),
            web.get("/api/dashboard/requests", self.requests),
        ]

    async def page(self, request: web.Request) -> web.StreamResponse:
        _authorize(request)
        return web.Response(body=_static("index.html"), content_type="text/html", charset="utf-8")

    async def static(self, request: web.Request) -> web.StreamResponse:
        _authorize(request)
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound(text=f"no dashboard file {name!r}")
        return web.Response(
            body=_static(name),
            content_type=STATIC[name],
            headers={"Cache-Control": "max-age=3600"},
        )

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        _authorize(request)
        return web.Response(text=self._state.snapshot_json(), content_type="application/json")

    async def requests(self, request: web.Request) -> web.StreamResponse:
        _authorize(request)
        try:
            since = float(request.query.get("since", "0"))
            if math.isnan(since):  # compares false with every time
                raise ValueError
        except ValueError:
            raise web.HTTPBadRequest(
                text=f"since: a time in Unix seconds, got {request.query['since']!r}"
            ) from None
        done, failed, now = self._state.requests_after(since)
        body = {
            "router": self._state.router_name,
            "now": now,
            "done": [asdict(d) for d in done],
            "failed": [asdict(f) for f in failed],
        }
        return web.json_response(body, dumps=dumps)

    async def events(self, request: web.Request) -> web.StreamResponse:
        _authorize(request)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        await response.write(b"retry: 1000\n\n")  # reconnect after 1 s (a router restart)
        async with self._state.feed() as updates:
            while True:
                try:
                    update = await asyncio.wait_for(updates.get(), KEEPALIVE_S)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if update is None:  # the router is stopping
                    return response
                await response.write(f"event: update\ndata: {update}\n\n".encode())


class PeerPull:
    """Pulls another router's requests over its HTTP door (TLS and the token as the mesh
    has them): DashboardState's `pull`."""

    def __init__(self, tls: TlsPaths | None) -> None:
        self._ssl: ssl.SSLContext | bool = False
        if tls is not None:
            context = ssl.create_default_context(cafile=str(tls.ca_file))
            if tls.mutual:
                context.load_cert_chain(tls.cert_file, tls.key_file)
            self._ssl = context
        self._scheme = "https" if tls is not None else "http"
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, peer: Node, since: float) -> Pulled | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        headers = dict(outgoing_auth())
        url = f"{self._scheme}://{peer.host}:{peer.http_port}/api/dashboard/requests"
        try:
            async with self._session.get(
                url, params={"since": repr(since)}, headers=headers, ssl=self._ssl
            ) as reply:
                if reply.status != 200:
                    return None
                body = await reply.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return (
            [Done(**d) for d in body["done"]],
            [Failed(**f) for f in body["failed"]],
            float(body["now"]),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _authorize(request: web.Request) -> None:
    given = request.headers.get("Authorization", "")
    if not given.startswith("Bearer "):  # a browser's page: ?token=
        given = f"Bearer {request.query.get('token', '')}"
    if not bearer_accepted(given):
        raise web.HTTPUnauthorized(
            text="missing or invalid token: send Authorization: Bearer <token>, or open "
            "/dashboard?token=<token>"
        )
