"""gRPC's I/O path in the mesh's own processes (routers, sim and Ollama nodes, and the
benchmark's bare relay that stands for any Python router): set before gRPC is imported,
which reads GRPC_EXPERIMENTS then.

Sockets go through gRPC's older I/O path rather than EventEngine's client and listener (on
by default for Python since grpcio 1.80). EventEngine hands each read and write between its
pool's threads and the poller; the older path wakes fewer threads a message: on 2 shared
cores a router's CPU a request fell by 11-15 % and its context switches by 40 % (README,
"gRPC's I/O path"). A process with a llama.cpp engine keeps EventEngine: there a decode node
served 4 streams 5-8 % slower on the older path. Only for the grpcio the project pins
(1.85), which has both paths: upstream plans to remove the older one. A setting of the
user's own wins.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Sequence
from importlib.metadata import version

from disagg_mesh.server.common.config import DEFAULT_TOPOLOGY

OLDER_IO = "-event_engine_client,-event_engine_listener"


def older_io_env() -> dict[str, str]:
    """What to add to a process's environment before gRPC loads in it ({} where the user set
    GRPC_EXPERIMENTS, or the grpcio installed is not the one measured)."""
    if "GRPC_EXPERIMENTS" in os.environ or not version("grpcio").startswith("1.85."):
        return {}
    return {"GRPC_EXPERIMENTS": OLDER_IO}


def node_process_env(argv: Sequence[str]) -> dict[str, str]:
    """older_io_env() for a node's process (`--topology FILE --node NAME[,NAME...]`) unless
    one of its nodes runs a llama.cpp engine. Read from the topology's TOML as it is, before
    gRPC loads (the topology's own loader imports it); a file it cannot read changes nothing
    here, and the node's start says what is wrong with it."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--topology", default=DEFAULT_TOPOLOGY)
    parser.add_argument("--node", default="")
    try:
        args, _ = parser.parse_known_args(list(argv))
        with open(args.topology, "rb") as file:
            nodes = tomllib.load(file).get("nodes", [])
    except (argparse.ArgumentError, OSError, tomllib.TOMLDecodeError):
        return {}
    if not isinstance(nodes, list):
        return {}
    names = {name.strip() for name in args.node.split(",")}
    if any(
        isinstance(n, dict) and n.get("name") in names and n.get("engine") == "llama_cpp"
        for n in nodes
    ):
        return {}
    return older_io_env()
