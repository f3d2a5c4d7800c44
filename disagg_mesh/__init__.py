"""disagg-mesh's Python client: call the router from a grader in a few lines.

from disagg_mesh import MeshClient

with MeshClient("127.0.0.1:50051") as mesh:
    result = mesh.generate("qwen3-coder:30b", "Review this code: ...", max_tokens=400)
    print(result.text, result.metrics.decode_speed)
"""

# The names below load on first use (PEP 562), not when the package is imported: a node's
# process (python -m disagg_mesh.server.node) imports this package before its own module,
# and must load llama.cpp's libraries before grpc's (services/node.py says why). Importing
# the client here loaded grpc first, and every node of a CUDA build crashed at start.

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg_mesh.client import (
        AsyncMeshClient,
        GenerateCall,
        Logprobs,
        MeshClient,
        Reasoning,
        Result,
        TlsFiles,
        TokenLogprob,
        ToolCall,
        ToolCallDelta,
    )
    from disagg_mesh.errors import (
        InvalidRequest,
        MeshError,
        ModelNotFound,
        Timeout,
        Unavailable,
    )
    from disagg_mesh.metrics import FailedAttempt, Metrics

_HOMES = {
    "AsyncMeshClient": "client",
    "GenerateCall": "client",
    "Logprobs": "client",
    "MeshClient": "client",
    "Reasoning": "client",
    "Result": "client",
    "TlsFiles": "client",
    "TokenLogprob": "client",
    "ToolCall": "client",
    "ToolCallDelta": "client",
    "InvalidRequest": "errors",
    "MeshError": "errors",
    "ModelNotFound": "errors",
    "Timeout": "errors",
    "Unavailable": "errors",
    "FailedAttempt": "metrics",
    "Metrics": "metrics",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'disagg_mesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"disagg_mesh.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = [
    "AsyncMeshClient",
    "FailedAttempt",
    "GenerateCall",
    "InvalidRequest",
    "Logprobs",
    "MeshClient",
    "MeshError",
    "Metrics",
    "ModelNotFound",
    "Reasoning",
    "Result",
    "Timeout",
    "TlsFiles",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "Unavailable",
]
