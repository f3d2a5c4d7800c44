"""gRPC's I/O path in the mesh's own processes (nodes, routers, and the benchmark's bare relay
that stands for any Python router): set before gRPC is imported, which reads
GRPC_EXPERIMENTS then.

Sockets go through gRPC's older I/O path rather than EventEngine's client and listener (on
by default for Python since grpcio 1.80). EventEngine hands each read and write between its
pool's threads and the poller; the older path wakes fewer threads a message: on 2 shared
cores a router's CPU a request fell by 11-15 % and its context switches by 40 % (README,
"gRPC's I/O path"). Only for the grpcio the project pins (1.85), which has both paths:
upstream plans to remove the older one. A setting of the user's own wins.
"""

from __future__ import annotations

import os
from importlib.metadata import version

OLDER_IO = "-event_engine_client,-event_engine_listener"


def older_io_env() -> dict[str, str]:
    """What to add to a process's environment before gRPC loads in it ({} where the user set
    GRPC_EXPERIMENTS, or the grpcio installed is not the one measured)."""
    if "GRPC_EXPERIMENTS" in os.environ or not version("grpcio").startswith("1.85."):
        return {}
    return {"GRPC_EXPERIMENTS": OLDER_IO}
