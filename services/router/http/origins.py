"""Which web pages may call the doors from a browser (CORS), as Ollama decides it: pages of
this machine (localhost, 127.0.0.1 and 0.0.0.0 on any port, http or https), desktop and
editor apps (app://, file://, tauri://, vscode-webview://, vscode-file://), browser
extensions, and the origins the router node's `http_origins` adds. The router's own pages
(the dashboard) send no Origin: a browser sends none with a page's requests to its own
origin but for a POST, which they make none of.

A request from any other page is refused with 403 before it is read: a page on the web the
user happens to open cannot make the mesh generate for it (a browser sends such a POST
without asking first). Requests without an Origin (the SDKs, curl, the mesh's own clients)
are not browsers' and pass. A door that listens on a loopback address only also refuses a
request naming a host that is not this machine (Ollama's allowed hosts): a page whose name
was made to point at 127.0.0.1 (DNS rebinding) would otherwise be served as the door's own.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence

import grpc
import structlog
from aiohttp import web

from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.router.http import ollama_api, openai_api
from disagg_mesh.server.router.http.common import Handler

log = structlog.get_logger("http")

# Ollama's own list (envconfig.AllowedOrigins), "*" matching anything.
DEFAULT_ORIGINS = (
    *(
        f"{scheme}://{host}{port}"
        for host in ("localhost", "127.0.0.1", "0.0.0.0")
        for scheme in ("http", "https")
        for port in ("", ":*")
    ),
    "app://*",
    "file://*",
    "tauri://*",
    "vscode-webview://*",
    "vscode-file://*",
)
BROWSER_EXTENSIONS = ("chrome-extension://", "moz-extension://", "safari-extension://")
# What a page may send: Ollama's list (its own and the openai SDK's headers), and ours.
ALLOWED_HEADERS = (
    "Authorization, Content-Type, User-Agent, Accept, X-Requested-With, X-Request-Id, "
    "X-Disagg-Dry-Run, OpenAI-Beta, x-stainless-arch, x-stainless-async, "
    "x-stainless-custom-poll-interval, x-stainless-helper-method, x-stainless-lang, "
    "x-stainless-os, x-stainless-package-version, x-stainless-poll-helper, "
    "x-stainless-retry-count, x-stainless-runtime, x-stainless-runtime-version, "
    "x-stainless-timeout"
)
ALLOWED_METHODS = "GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"
PREFLIGHT_MAX_AGE_S = 12 * 3600


class _Refused(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


def _pattern(origin: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in origin.split("*")))


def loopback_only(listen_host: str) -> bool:
    """Whether a door listening on this address serves this machine alone (not 0.0.0.0 or
    a LAN address)."""
    if listen_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        return False


def local_host(host: str) -> bool:
    """Whether a request's Host names this machine as Ollama accepts it on a loopback
    address: an IP that is loopback, private or unspecified; localhost, this machine's
    name, or a name under .localhost, .local or .internal."""
    if host.startswith("["):  # an IPv6 address, with a port or not
        name = host[1 : host.find("]")]
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.lower()
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return name in ("", "localhost", socket.gethostname().lower()) or name.endswith(
            (".localhost", ".local", ".internal")
        )
    return ip.is_loopback or ip.is_private or ip.is_unspecified


class BrowserOrigins:
    """The doors' middleware for browsers, as Ollama's: CORS for its origins and `extra`
    (patterns with *), and, on a door that listens on a loopback address only, requests
    naming another host refused (a page whose name an attacker made point at 127.0.0.1:
    DNS rebinding)."""

    def __init__(self, extra: Sequence[str] = (), listen_host: str = "") -> None:
        """listen_host: the address the door listens on ("": not known, no host check)."""
        self._patterns = [_pattern(o.rstrip("/")) for o in (*DEFAULT_ORIGINS, *extra)]
        self._loopback = loopback_only(listen_host)

    def allows(self, origin: str) -> bool:
        """Whether a page of `origin` may call the doors."""
        if origin.startswith(BROWSER_EXTENSIONS):
            return True
        return any(p.fullmatch(origin) for p in self._patterns)

    def _refuse(self, request: web.Request, what: str, message: str) -> web.Response:
        openai = request.path.startswith("/v1/")
        body = (openai_api if openai else ollama_api).error_body(_Refused(message), 403)
        log.info(
            f"http foreign {what}",
            path=f"{request.method} {request.path}",
            origin=request.headers.get("Origin"),
            host=request.headers.get("Host"),
        )
        # One label for every such path, as for unserved ones: the series stay few.
        api = "openai" if openai else "ollama"
        metrics.HTTP_REQUESTS.labels(api, f"foreign_{what}", "403").inc()
        return web.json_response(body, status=403)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # The Host as sent (none from an HTTP/1.0 caller: as Ollama, not refused).
        host = request.headers.get("Host", "")
        if self._loopback and not local_host(host):
            return self._refuse(
                request,
                "host",
                f"host {host!r} is not this machine's, and the router's HTTP port "
                "listens on a loopback address only (set its listen_host to serve others)",
            )
        origin = request.headers.get("Origin")
        if origin is None:
            return await handler(request)
        if not self.allows(origin):
            return self._refuse(
                request,
                "origin",
                f"origin {origin!r} may not call the mesh from a browser: add it to the router "
                "node's http_origins in the topology",
            )
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            headers = {
                **_allowed(origin),
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            }
            return web.Response(status=204, headers=headers)
        request[ALLOWED_ORIGIN] = origin
        return await handler(request)

    def install(self, app: web.Application) -> None:
        """The middleware first, and the allowed origin on every response's headers, a
        stream's too (set before it sends them: on_response_prepare)."""
        app.middlewares.insert(0, self.middleware)
        app.on_response_prepare.append(_add_origin)


ALLOWED_ORIGIN = web.RequestKey("allowed_origin", str)


def _allowed(origin: str) -> dict[str, str]:
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


async def _add_origin(request: web.Request, response: web.StreamResponse) -> None:
    origin = request.get(ALLOWED_ORIGIN)
    if origin is not None:
        response.headers.update(_allowed(origin))
