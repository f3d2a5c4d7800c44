"""HTTP front doors on the router: Ollama's API (/api/...) and OpenAI's (/v1/...), served by
aiohttp on the router's own event loop when the router node has `http_port`.

- `common.py`      request scope (request id, bearer token, log line, metrics), JSON fields,
                   mesh errors as HTTP statuses
- `ollama_api.py`  /api/generate, /api/chat, /api/tags, /api/ps, /api/show, /api/version
- `openai_api.py`  /v1/chat/completions, /v1/completions, /v1/models, /v1/models/{model}
- the live dashboard, /dashboard and /api/dashboard (router/dashboard/)
- `unserved.py`    any other path or method: the API's own JSON error, naming what is served
- `origins.py`     which web pages may call the doors from a browser (CORS), as Ollama's

Both call `Router.generate`, the logic behind gRPC's RouterService.Generate: the same
fallback chain, stage deadlines, request id and metrics. A client that disconnects cancels
its handler (aiohttp's handler_cancellation), which cancels the generation down to the
decode node.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

import structlog
from aiohttp import web

from disagg_mesh.server.common.runtime.tls import TlsPaths
from disagg_mesh.server.router.dashboard.state import DashboardState
from disagg_mesh.server.router.dashboard.web import DashboardApi
from disagg_mesh.server.router.http.common import MAX_BODY_BYTES
from disagg_mesh.server.router.http.ollama_api import OllamaApi
from disagg_mesh.server.router.http.openai_api import OpenAiApi
from disagg_mesh.server.router.http.origins import BrowserOrigins
from disagg_mesh.server.router.http.responses_api import ResponsesApi
from disagg_mesh.server.router.http.unserved import unserved_paths
from disagg_mesh.server.router.routing import Router

log = structlog.get_logger("http")


class HttpFrontDoor:
    def __init__(
        self,
        router: Router,
        host: str,
        port: int,
        tls: TlsPaths | None,
        dashboard: DashboardState | None = None,
        origins: Sequence[str] = (),
    ) -> None:
        """origins: the pages a browser may call the doors from, beyond Ollama's own."""
        self._dashboard = dashboard
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[unserved_paths])
        BrowserOrigins(origins, listen_host=host).install(app)
        app.add_routes(OllamaApi(router).routes())
        app.add_routes(OpenAiApi(router).routes())
        app.add_routes(ResponsesApi(router).routes())
        if dashboard is not None:
            app.add_routes(DashboardApi(dashboard).routes())
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self._host, self._port = host, port
        self._ssl = _ssl_context(tls) if tls is not None else None

    @property
    def url(self) -> str:
        return self.public_url(self._host)

    def public_url(self, host: str) -> str:
        """The door's URL as callers reach it through `host` (the topology's, which a
        listen_host of 0.0.0.0 is not)."""
        return f"{'https' if self._ssl else 'http'}://{host}:{self._port}"

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, ssl_context=self._ssl)
        await site.start()
        log.info(
            "http listening", url=self.url, apis="ollama /api, openai /v1, dashboard /dashboard"
        )

    async def close(self) -> None:
        if self._dashboard is not None:
            self._dashboard.close()  # open pages' feeds end, so shutdown waits for none
        await self._runner.cleanup()


def _ssl_context(tls: TlsPaths) -> ssl.SSLContext:
    """The router's own certificate; with mutual TLS, callers need one from the mesh's CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.mutual:
        context.load_verify_locations(tls.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
