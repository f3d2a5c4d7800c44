"""The router's logic, plain Python (the servicer and the HTTP front doors do the protocols):
a request for a logical model goes through its fallback chain, prefill then decode (or a
whole generation), its text relayed as it comes, then one RouteSummary.

The parts, a module each:
- request.py: one request (`Request`) and each try at serving it (`Attempt`);
- chain.py: the chain loop; selection.py: which nodes, in what order;
- stages/: prefill (with retries), decode, direct Ollama;
- migration.py: a generation going on elsewhere after its decode node (or router) failed;
- failures.py: what each failure means; knowledge.py: what the router learns as it serves;
- summary.py: what it reports.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from disagg_mesh.server.common.config.topology import ModelRoute, Node, SchemaLimits, Topology
from disagg_mesh.server.common.errors import InvalidArgument, MeshError, NotFound
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.types import Continuation, ModelFacts, Prompt, Sampling, TextChunk
from disagg_mesh.server.common.validation import (
    NO_FIM_TOKENS,
    check_format,
    validate_prompt,
    validate_sampling,
)
from disagg_mesh.server.common.wire.node_clients import ChannelPool, EngineInfo
from disagg_mesh.server.router.chain import Chain
from disagg_mesh.server.router.dashboard.recent import Recent
from disagg_mesh.server.router.deaths import fingerprint
from disagg_mesh.server.router.knowledge import Knowledge
from disagg_mesh.server.router.migration import Migrator, Stages
from disagg_mesh.server.router.node_health import NodeHealth
from disagg_mesh.server.router.prefixes import prompt_bytes, text_blocks
from disagg_mesh.server.router.request import Clock, Request
from disagg_mesh.server.router.selection import Selection
from disagg_mesh.server.router.stages import NodeClients, PooledClients
from disagg_mesh.server.router.stages.decode import DecodeStage
from disagg_mesh.server.router.stages.direct_ollama import DirectOllama
from disagg_mesh.server.router.stages.prefill import PrefillStage
from disagg_mesh.server.router.summary import (
    FailedAttempt,
    Migration,
    ResumeInfo,
    RouteMethod,
    RouteSummary,
    count_served,
)

__all__ = [
    "FailedAttempt",
    "Migration",
    "ResumeInfo",
    "RouteMethod",
    "RouteSummary",
    "Router",
]


class Router:
    def __init__(
        self,
        topology: Topology,
        pool: ChannelPool,
        health: NodeHealth,
        clients: NodeClients | None = None,
    ) -> None:
        """clients: how nodes are called (default: gRPC over `pool`; unit tests pass
        in-process fakes)."""
        self.topology = topology
        self.health = health
        self.knowledge = Knowledge([n for n in topology.nodes if n.role == "decode"])
        # Recent requests, for the dashboard (router/dashboard/).
        self.recent = Recent()
        self.selection = Selection(topology, health, self.knowledge)
        calls = clients if clients is not None else PooledClients(pool)
        self._direct = DirectOllama()
        stages = Stages(PrefillStage(calls, health), DecodeStage(calls, health), self._direct)
        self.migrator = Migrator(self.selection, stages)
        self.chain = Chain(self.selection, stages, self.migrator)

    @property
    def max_tokens_limit(self) -> int:
        return self.topology.mesh.max_tokens_limit

    @property
    def schema_limits(self) -> SchemaLimits:
        return self.topology.mesh.schema_limits

    def n_ctx(self, model: str) -> int:
        """The context a request to this logical model gets: the smallest of its nodes'."""
        route = self.route(model)
        nodes = self.selection.nodes([*route.prefill, *route.decode])
        return min((n.n_ctx for n in nodes), default=0)

    def model_engine(self, model: str) -> EngineInfo:
        """What the logical model's nodes said of their engine and model (the first that
        said, decode nodes first); an empty one while none has."""
        route = self.route(model)
        for name in (*route.decode, *route.prefill):
            engine = self.health.engine(name)
            if engine is not None:
                return engine
        return EngineInfo()

    def model_facts(self, model: str) -> ModelFacts:
        """What the logical model's nodes said their model is; empty while none has."""
        return self.model_engine(model).facts

    def check_reasons(self, model: str, field: str) -> None:
        """INVALID_ARGUMENT naming `field` (Ollama's think, OpenAI's reasoning_effort) for a
        model its nodes say does not reason apart from its answer, as Ollama refuses think
        for one; a model whose nodes have not said is given the benefit of the doubt."""
        facts = self.model_facts(model)
        if facts.reasons is False:
            what = facts.architecture or "its model"
            raise InvalidArgument(
                field,
                f"{model!r} does not support thinking ({what} does not reason apart from its "
                "answer)",
            )

    def routes(self) -> list[tuple[ModelRoute, list[Node], list[Node]]]:
        nodes = self.selection.nodes
        return [(m, nodes(m.prefill), nodes(m.decode)) for m in self.topology.models]

    def check(self, model: str, prompt: Prompt, sampling: Sampling) -> ModelRoute:
        """What a generation checks before it runs (NOT_FOUND for a model not served here,
        INVALID_ARGUMENT naming the field): the route it would take."""
        route = self.route(model)
        validate_prompt(prompt)
        offers_tools = sampling.tools is not None and bool(sampling.tools.tools)
        if prompt.suffix or offers_tools:  # the nodes' facts, only for what they can refuse
            self._check_capabilities(model, route, bool(prompt.suffix), offers_tools)
        validate_sampling(sampling, self.topology.mesh.max_tokens_limit, self.schema_limits)
        return route

    def _check_capabilities(self, model: str, route: ModelRoute, suffix: bool, tools: bool) -> None:
        """As Ollama refuses what its model cannot do, before any node is asked (a model
        whose nodes have not said is given the benefit of the doubt)."""
        facts = self.model_facts(model)
        if suffix and facts.inserts is False:
            nodes = (self.topology.node(n) for n in (*route.decode, *route.prefill))
            why = (
                "its Ollama template has no fill-in-the-middle branch ({{ if .Suffix }}); "
                "leave suffix out, or use a coder model whose template has one"
                if any(n.engine == "ollama" for n in nodes)
                else f"its model has {NO_FIM_TOKENS}"
            )
            raise InvalidArgument("suffix", f"{model!r} does not support insert: {why}")
        if tools and facts.takes_tools is False:
            raise InvalidArgument(
                "tools",
                f"{model!r} does not support tools: its model's template has no place for "
                "them (its nodes say); leave tools out, or use a model that takes them",
            )

    async def generate(
        self, model: str, prompt: Prompt, sampling: Sampling, time_remaining: float | None
    ) -> AsyncGenerator[TextChunk | RouteSummary, None]:
        """Text chunks as they are made, then one RouteSummary."""
        items = self.generate_resumable(model, prompt, sampling, time_remaining)
        async with aclosing(items) as stream:
            async for item in stream:
                if not isinstance(item, ResumeInfo):
                    yield item

    async def generate_resumable(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        time_remaining: float | None,
        resume: Continuation | None = None,
        resumed_from: str = "",
    ) -> AsyncGenerator[TextChunk | RouteSummary | ResumeInfo, None]:
        """As generate, with a ResumeInfo before the first chunk, for a client that can
        resume through another router (gRPC). resume: go on with a generation the router
        `resumed_from` was streaming when it failed, as a migration does."""
        try:
            clock = Clock(time_remaining)
            await check_format(sampling, self.schema_limits)
            route = self.check(model, prompt, sampling)
            data = prompt_bytes(prompt)
            blocks = text_blocks(route.name, data)
            fp = fingerprint(route.name, sampling)
            self.health.deaths.check(fp)
            request = Request(route, prompt, sampling, clock, len(data), blocks, fingerprint=fp)
            if resume is None:
                items = self.chain.run(request)
            else:
                items = self.migrator.resume(request, resume, resumed_from)
            async with aclosing(items) as stream:
                async for item in stream:
                    if isinstance(item, RouteSummary):
                        count_served(model, item)
                        self.recent.served(model, item)
                    yield item
        except MeshError as exc:
            metrics.request_failed(model, exc.code.name)
            self.recent.refused(model, exc.code.name)
            raise

    def route(self, model: str) -> ModelRoute:
        """The model's route; NOT_FOUND naming the models served when it has none
        (INVALID_ARGUMENT when no model is named)."""
        route = self.topology.route(model)
        if route is None:
            known = ", ".join(m.name for m in self.topology.models)
            if not model:
                raise InvalidArgument("model", f"is required; models: {known}")
            raise NotFound(f"model {model!r} is not served here; models: {known}")
        return route

    async def close(self) -> None:
        await self._direct.close()
