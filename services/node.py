"""Start one node of a topology by its name (or several simulated nodes in one process).

python -m disagg_mesh.server.node --topology topology/local.toml --node prefill-qwen
python -m disagg_mesh.server.node --topology sim.toml --node spark-1,spark-2,mac-1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from disagg_mesh.server.common.config import DEFAULT_TOPOLOGY
from disagg_mesh.server.common.runtime.grpc_io import node_process_env

# llama.cpp's CPU threads are OpenMP's (this build links libgomp, which reads its settings
# when the library loads). By default a waiting thread spins ~300,000 rounds before it sleeps,
# so engine nodes sharing a machine's cores spin against each other. Spinning 10,000 rounds
# keeps one request as fast and lets many run at once. Measured on 2 cores (a router, a
# prefill and a decode node, 2 threads each, 8 greedy 64-token prompts): one at a time 85
# tok/s and 8 at once 0.45x of that by default; 81 tok/s and 1.30x with 10,000 (passive,
# no spinning: 35 tok/s alone). A setting of the user's own wins (#24 goes on from here).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# gRPC's older I/O path in a process with no llama.cpp engine (fewer threads woken a
# message): before grpc loads, below.
os.environ.update(node_process_env(sys.argv[1:]))

# llama.cpp's libraries load first, before grpc's: with grpc (or numpy, or sentencepiece)
# loaded before it, a CUDA build of llama.cpp crashed the process (SIGSEGV while setting up
# the model's tokenizer) on an H100 machine. Importing it here costs the router ~0.1 s.
try:
    import llama_cpp  # noqa: F401
except ModuleNotFoundError as missing:  # a client-only install
    sys.exit(
        f"disagg node: {missing.name} is not installed: the nodes need the server extra "
        "(pip install 'disagg-mesh[server]', or make venv)"
    )
import structlog

from disagg_mesh.server.common.config.topology import (
    Node,
    Topology,
    TopologyError,
    load_topology,
)
from disagg_mesh.server.common.models import ModelFileError
from disagg_mesh.server.common.runtime.auth import TokenError, token_from_topology, use_token
from disagg_mesh.server.common.runtime.observability.logging import configure_logging
from disagg_mesh.server.common.runtime.server import BindError

# Python's interpreter lock in an engine node's process: how long a thread that wants it waits
# before the thread holding it must let go (Python's default: 5 ms). The engine thread leaves
# the lock for every llama.cpp call; meanwhile the event loop takes it to send the last
# step's tokens, and when llama_decode returns, the engine thread waits until the loop's burst
# of Python ends or this interval passes. Over 16-stream steps, that wait was a third of the
# time spent "in llama_decode" (py-spy --native: the lock's condition wait under the ctypes
# call), time that keeps a decode node under raw llama.cpp where steps are short (a GPU). At
# 0.2 ms the loop's work waits for the engine's instead, and still overlaps the next pass:
# in a short-step stand-in (docs/batching.md, "The interpreter's lock"), node / raw llama.cpp
# went from 0.75-0.83x to 0.84-0.89x at 16 streams, 0.76-0.80x to 0.82-0.89x at 8 and
# 0.62-0.67x to 0.67-0.72x at 1; 0.05 ms did no better.
ENGINE_SWITCH_INTERVAL_S = 0.0002


def share_the_interpreter(nodes: list[Node]) -> None:
    """A process running a llama.cpp engine hands the interpreter's lock over sooner."""
    if any(node.engine == "llama_cpp" for node in nodes):
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)


def _event_loop(nodes: list[Node]) -> Callable[[Coroutine[Any, Any, None]], None]:
    """How the process runs: simulated nodes' time is their loop's timers, which wake
    within a tenth of a millisecond there (engines/sim/timers.py) where asyncio's own on
    Linux wakes up to a millisecond late."""
    if all(node.engine == "sim" for node in nodes):
        from disagg_mesh.server.common.engines.sim import timers

        return timers.run
    return asyncio.run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", default=DEFAULT_TOPOLOGY, help="topology TOML file")
    parser.add_argument(
        "--node",
        required=True,
        help='name of the node to run; several comma-separated: engine = "sim" nodes, '
        "all in this process (hundreds fit on one machine)",
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="default: LOG_FORMAT, else console on a terminal",
    )
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.node.split(",") if name.strip()]
    if not names:
        parser.error("--node: a node's name (or several, comma-separated)")
    configure_logging(names[0] if len(names) == 1 else "sim-group", args.log_format)
    log = structlog.get_logger("node")
    try:
        topology = load_topology(args.topology)
        nodes = [topology.node(name) for name in names]
        use_token(token_from_topology(topology))
    except (TopologyError, TokenError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(nodes) > 1 and any(node.engine != "sim" for node in nodes):
        print(
            "error: --node: several nodes share a process only when they are all "
            f'engine = "sim"; {", ".join(n.name for n in nodes if n.engine != "sim")} '
            "need processes of their own",
            file=sys.stderr,
        )
        return 2
    share_the_interpreter(nodes)
    try:
        _event_loop(nodes)(_run_all(topology, nodes, str(args.topology)))
    except (BindError, ModelFileError) as exc:
        log.error("cannot start", error=str(exc))
        return 1
    except Exception as exc:
        # e.g. the engine is not available: one clear line, not a traceback
        if type(exc).__module__.startswith("disagg_mesh.server."):
            log.error("cannot start", error=str(exc))
            return 1
        raise
    return 0


async def _run_all(topology: Topology, nodes: list[Node], source: str) -> None:
    """Each node in a task of its own, its log lines carrying its name; the first to fail
    ends the process."""

    async def one(node: Node) -> None:
        structlog.contextvars.bind_contextvars(node=node.name)
        structlog.get_logger("node").info(
            "starting", role=node.role, topology=source, engine=node.engine, model=node.model
        )
        if node.role == "prefill":
            from disagg_mesh.server.prefill.main import run
        elif node.role == "decode":
            from disagg_mesh.server.decode.main import run
        else:
            from disagg_mesh.server.router.main import run
        await run(topology, node)

    await asyncio.gather(*(asyncio.create_task(one(node)) for node in nodes))


if __name__ == "__main__":
    sys.exit(main())
