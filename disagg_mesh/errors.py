"""The client's exceptions: a small set, each carrying the gRPC code and the router's message."""

from __future__ import annotations

import grpc


class MeshError(Exception):
    """A call to the mesh failed. `code` is the gRPC status code, `message` the router's."""

    def __init__(
        self, code: grpc.StatusCode, message: str, address: str, request_id: str = ""
    ) -> None:
        super().__init__(f"{address}: {code.name}: {message}")
        self.code = code
        self.message = message
        self.address = address
        self.request_id = request_id


class InvalidRequest(MeshError):
    """INVALID_ARGUMENT: the message starts with the field that is wrong."""


class ModelNotFound(MeshError):
    """NOT_FOUND: the router (or an Ollama server) does not serve that model."""


class Timeout(MeshError):
    """DEADLINE_EXCEEDED: the message says which stage ran out of time."""


class Unavailable(MeshError):
    """UNAVAILABLE or RESOURCE_EXHAUSTED: nodes down or busy; trying again later may work."""


_BY_CODE: dict[grpc.StatusCode, type[MeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Unavailable,
}


def from_rpc_error(exc: grpc.RpcError, address: str) -> MeshError:
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or code.name
    request_id = ""
    initial = getattr(exc, "initial_metadata", None)
    if callable(initial):
        metadata = initial() or ()
        request_id = next((str(v) for k, v in metadata if k == "x-request-id"), "")
    return _BY_CODE.get(code, MeshError)(code, details, address, request_id)
