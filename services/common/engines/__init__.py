"""Model runtimes behind one interface (`base.Engine`)."""

from __future__ import annotations

import asyncio

import structlog

from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.engines.base import Engine
from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.models import locate_model
from disagg_mesh.server.common.models.gptoss import Progress

log = structlog.get_logger("engine")


class EngineUnavailable(MeshError):
    """The node's engine cannot be opened."""


async def open_engine(topology: Topology, node: Node) -> Engine:
    """Load the engine the topology names for this node."""
    assert node.model is not None
    if node.engine == "llama_cpp":
        from disagg_mesh.server.common.engines.llama_cpp import EngineSettings, LlamaCppEngine

        located = await asyncio.to_thread(
            locate_model,
            node.model,
            topology.source.parent,
            node.ollama_models,
            _conversion_progress(node.name),
        )
        settings = EngineSettings(
            n_ctx=node.n_ctx,
            n_threads=topology.threads_for(node),
            host_peers=topology.host_peers(node),
            max_queue=node.max_queue,
            slots=node.slots,
            default_slots=node.default_slots,
            n_batch=node.n_batch,
            n_ubatch=node.n_ubatch,
            flash_attn=node.flash_attn,
            max_itl_slowdown=node.max_itl_slowdown,
            prompts_at_once=node.prompts_at_once,
            kv_cache_max_bytes=node.kv_cache_max_bytes,
            n_gpu_layers=node.n_gpu_layers,
            type_k=node.type_k,
            type_v=node.type_v,
            swa_full=node.swa_full,
            prefix_cache_tokens=node.prefix_cache_capacity_tokens,
            schema_limits=topology.mesh.schema_limits,
        )
        return await LlamaCppEngine.open(node.name, located.path, settings, located.sha256)
    if node.engine == "ollama":
        from disagg_mesh.server.common.engines.ollama_engine import OllamaEngine

        return OllamaEngine(
            url=node.ollama_url,
            model=node.model,
            n_ctx=node.n_ctx,
            max_in_flight=max(node.max_queue, 1),
            keep_alive=node.ollama_keep_alive,
        )
    if node.engine == "sim":
        from disagg_mesh.server.common.engines.sim.engine import SimEngine, SimSettings
        from disagg_mesh.server.common.engines.sim.profile import load_profile

        assert node.hardware is not None
        profile = load_profile(node.hardware, topology.source.parent)
        return SimEngine(
            model=node.model,
            profile=profile,
            n_ctx=node.n_ctx,
            settings=SimSettings(
                slots=node.slots or node.default_slots,
                max_queue=node.max_queue,
                speedup=topology.mesh.sim_speedup,
                prefix_cache_tokens=node.prefix_cache_capacity_tokens,
                host=node.machine,
                compact_kv=topology.mesh.sim_compact_kv,
                schema_limits=topology.mesh.schema_limits,
                prompts_at_once=node.prompts_at_once,
                ubatch_tokens=node.n_ubatch,
            ),
        )
    raise EngineUnavailable(f"node {node.name}: unknown engine {node.engine!r}")


def _conversion_progress(node: str) -> Progress:
    """A log line every 5% while Ollama's gpt-oss blob is rewritten for llama.cpp (once)."""
    shown = -1

    def progress(done: int, total: int) -> None:
        nonlocal shown
        percent = 100 * done // max(total, 1)
        if percent // 5 > shown:
            shown = percent // 5
            log.info(
                "writing the llama.cpp version of Ollama's gpt-oss blob (once)",
                node=node,
                percent=percent,
                done_gb=round(done / 1e9, 2),
                total_gb=round(total / 1e9, 2),
            )

    return progress
