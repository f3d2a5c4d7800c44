"""Errors the mesh raises, each with the gRPC status code it travels as.

Logic below the servicers raises these plain exceptions; `grpc_status.py` is the one place
that turns them (and anything unexpected) into a gRPC status.
"""

from __future__ import annotations

import re

import grpc


class MeshError(Exception):
    """An error with a clear message for the caller and the status code it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # A busy answer's advice: seconds before trying again (None: RETRY_AFTER_S).
    retry_after_s: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(MeshError):
    """A request field is wrong; the message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(MeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(MeshError):
    """Something the request counted on is gone (a decode node no longer holds a prefix):
    the caller redoes the step before (the prefill) and tries again."""

    code = grpc.StatusCode.ABORTED


class DataLoss(MeshError):
    code = grpc.StatusCode.DATA_LOSS


# A busy answer (RESOURCE_EXHAUSTED) says when to try again: gRPC in the trailing metadata
# RETRY_AFTER_KEY (milliseconds), HTTP in a Retry-After header (seconds, rounded up); by
# default RETRY_AFTER_S, or the error's own retry_after_s.
RETRY_AFTER_KEY = "retry-after-ms"
RETRY_AFTER_S = 1.0


class ResourceExhausted(MeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after(exc: MeshError) -> float:
    """Seconds a busy answer tells its caller to wait before trying again."""
    return max(RETRY_AFTER_S, exc.retry_after_s or 0.0)


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


# How InvalidArgument's message starts: the field's name (a.b, a[0].b), then ": ".
_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


class UpstreamError(MeshError):
    """A call to another node failed; keeps that node's status code and message, and for
    INVALID_ARGUMENT the field that node's message starts with (`field`, as InvalidArgument's;
    None when it starts otherwise)."""

    def __init__(self, code: grpc.StatusCode, message: str, details: str = "") -> None:
        """details: the node's own message, when `message` adds to it."""
        super().__init__(message)
        self.code = code
        named = _FIELD.match(details) if code == grpc.StatusCode.INVALID_ARGUMENT else None
        self.field = named.group(1) if named else None
