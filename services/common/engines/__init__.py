"""Model runtimes behind one interface (`base.Engine`)."""

from __future__ import annotations

from services.common.engines.base import Engine
from services.common.errors import MeshError
from services.common.models import resolve_model_path
from services.common.topology import Node, Topology
from services.common.worker import EngineWorker


class EngineUnavailable(MeshError):
    """The node's engine cannot be opened."""


async def open_engine(topology: Topology, node: Node) -> Engine:
    """Load the engine the topology names for this node."""
    assert node.model is not None
    if node.engine == "llama_cpp":
        from services.common.engines.llama_cpp_engine import LlamaCppEngine

        path = resolve_model_path(node.model, topology.source.parent)
        worker = EngineWorker(node.name, node.max_queue)
        return await LlamaCppEngine.open(path, node.n_ctx, topology.threads_for(node), worker)
    if node.engine == "ollama":
        from services.common.engines.ollama_engine import OllamaEngine

        return OllamaEngine(
            url=node.ollama_url,
            model=node.model,
            n_ctx=node.n_ctx,
            max_in_flight=max(node.max_queue, 1),
            keep_alive=node.ollama_keep_alive,
        )
    raise EngineUnavailable(f"node {node.name}: unknown engine {node.engine!r}")
