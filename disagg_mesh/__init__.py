"""disagg-mesh's Python client: call the router from a grader in a few lines.

from disagg_mesh import MeshClient

with MeshClient("127.0.0.1:50051") as mesh:
    result = mesh.generate("qwen3-coder:30b", "Review this code: ...", max_tokens=400)
    print(result.text, result.metrics.decode_speed)
"""

from disagg_mesh.client import (
    AsyncMeshClient,
    GenerateCall,
    MeshClient,
    Reasoning,
    Result,
    TlsFiles,
)
from disagg_mesh.errors import (
    InvalidRequest,
    MeshError,
    ModelNotFound,
    Timeout,
    Unavailable,
)
from disagg_mesh.metrics import FailedAttempt, Metrics

__all__ = [
    "AsyncMeshClient",
    "FailedAttempt",
    "GenerateCall",
    "InvalidRequest",
    "MeshClient",
    "MeshError",
    "Metrics",
    "ModelNotFound",
    "Reasoning",
    "Result",
    "Timeout",
    "TlsFiles",
    "Unavailable",
]
