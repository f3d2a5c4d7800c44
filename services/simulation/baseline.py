"""The Ollama baseline: the same workload on the same machines, served as the grader's
glue serves it today (profiles/ollama.toml states each assumption).

Each engine node of the topology is an Ollama server of its model on its machine, timed by
the machine's profile (the simulated engine, so batching and depth count as in the mesh),
with OLLAMA_NUM_PARALLEL slots, their prompts evaluated together in passes of its batch
(512 tokens), and each slot's own prompt cache. A request goes to its model's prefill
machine, which evaluates the prompt (and makes one token), then to its decode machine,
which evaluates the whole prompt again (Ollama's `context` carries token ids, not KV) and
generates the answer: the glue's two calls, in turn. A model's requests take its machines in
turn. The client sends as many at once as the mesh's run did.
The topology is the simulation's (simulated_topology): each node's hardware is known.

No sockets: it runs on a virtual clock (clock.py), its times exact and instant.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from disagg_mesh.batch.runner import Turns
from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.engines.sim.engine import SimEngine, SimSettings
from disagg_mesh.server.common.engines.sim.profile import OllamaBaseline, load_profile
from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.types import GenerationEnd, TextChunk
from disagg_mesh.server.simulation.clock import run_virtual
from disagg_mesh.server.simulation.topology import sim_model
from disagg_mesh.server.simulation.workload import Work


@dataclass(frozen=True)
class Served:
    """One request's figures, simulated seconds from when the client sent it."""

    custom_id: str
    model: str
    ok: bool
    time_to_first_token_seconds: float = 0.0
    latency_seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class BaselineRun:
    wall_seconds: float = 0.0
    served: list[Served] = field(default_factory=list)
    # Simulated seconds each node's machine spent on prompts and on decode steps.
    prompt_seconds: dict[str, float] = field(default_factory=dict)
    decode_seconds: dict[str, float] = field(default_factory=dict)


def run_baseline(
    topology: Topology,
    order: Sequence[tuple[Work, str | None]],
    concurrency: int,
    serving: OllamaBaseline,
    model_concurrency: Mapping[str, int] | None = None,
) -> BaselineRun:
    """The workload (in the order the mesh's run sent it, each with the request it waited
    for, as many at once as it sent: per model, else in all) through Ollama's flow, on a
    virtual clock."""
    return run_virtual(_run(topology, order, concurrency, serving, model_concurrency or {}))


async def _run(
    topology: Topology,
    order: Sequence[tuple[Work, str | None]],
    concurrency: int,
    serving: OllamaBaseline,
    model_concurrency: Mapping[str, int],
) -> BaselineRun:
    loop = asyncio.get_running_loop()
    servers: dict[str, SimEngine] = {}

    def server(node: Node) -> SimEngine:
        if node.name not in servers:
            assert node.hardware is not None  # simulated_topology set it
            model = sim_model(node.model or "")
            servers[node.name] = SimEngine(
                model,
                load_profile(node.hardware),
                node.n_ctx,
                SimSettings(
                    slots=serving.parallel_for(model),
                    max_queue=serving.max_queue,
                    # Its runner's batch: the parallel requests' prompts share each pass.
                    prompts_at_once=serving.parallel_for(model),
                    ubatch_tokens=serving.batch_tokens,
                    prefix_cache="per-slot",
                    host=node.machine,
                    schema_limits=topology.mesh.schema_limits,
                ),
            )
        return servers[node.name]

    turns = {
        route.name: (
            itertools.cycle([topology.node(n) for n in route.prefill]) if route.prefill else None,
            itertools.cycle([topology.node(n) for n in route.decode]),
        )
        for route in topology.models
    }
    run = BaselineRun()
    sending = Turns((w.custom_id for w, _ in order), concurrency, model_concurrency)

    async def one(w: Work, after: str | None) -> None:
        async with sending.turn(w.custom_id, w.model, after):
            run.served.append(await _served(w))

    async def _served(w: Work) -> Served:
        sent = loop.time()
        prefill, decode = turns[w.model]
        try:
            if prefill is not None and serving.prompt_evaluated_on_decode_host:
                # The glue's first call: the prefill machine evaluates the prompt.
                one_token = replace(w.sampling, max_tokens=1, ignore_eos=True)
                async for _ in server(next(prefill)).generate(w.prompt, one_token):
                    pass
            first = 0.0
            end: GenerationEnd | None = None
            async for event in server(next(decode)).generate(w.prompt, w.sampling):
                if isinstance(event, TextChunk) and not first:
                    first = loop.time() - sent
                elif isinstance(event, GenerationEnd):
                    end = event
        except MeshError as exc:  # refused (all slots and the queue full): a result
            return Served(
                w.custom_id, w.model, False, latency_seconds=loop.time() - sent, error=str(exc)
            )
        assert end is not None
        return Served(
            w.custom_id,
            w.model,
            True,
            time_to_first_token_seconds=first,
            latency_seconds=loop.time() - sent,
            prompt_tokens=end.prompt_tokens,
            completion_tokens=end.completion_tokens,
        )

    await asyncio.gather(*(one(w, after) for w, after in order))
    run.wall_seconds = loop.time()
    run.prompt_seconds = {name: e.prompt_seconds for name, e in servers.items()}
    run.decode_seconds = {name: e.decode_seconds for name, e in servers.items()}
    for engine in servers.values():
        await engine.close()
    return run
