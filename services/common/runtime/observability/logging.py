"""structlog setup, and the request id that follows a request across hops.

The router makes a request id (or takes the caller's `x-request-id` metadata); every node
binds it to its log lines and every outgoing call carries it on in gRPC metadata.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import Any

import structlog

from disagg_mesh.server.common.runtime.auth import outgoing_auth

REQUEST_ID_KEY = "x-request-id"


def configure_logging(node: str, fmt: str | None = None) -> None:
    """Console lines on a terminal, JSON lines otherwise (LOG_FORMAT=json|console wins)."""
    fmt = fmt or os.environ.get("LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    level = getattr(logging, os.environ.get("LOG_LEVEL", "INFO").upper(), logging.INFO)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(node=node)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def current_request_id() -> str | None:
    value = structlog.contextvars.get_contextvars().get("request_id")
    return str(value) if value else None


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata for a call to another node: the current request id, and the mesh's token."""
    request_id = current_request_id()
    return (((REQUEST_ID_KEY, request_id),) if request_id else ()) + outgoing_auth()
