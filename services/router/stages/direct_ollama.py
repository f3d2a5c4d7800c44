"""The direct_ollama step: the user's old path, the router calling the route's Ollama
server's HTTP API itself, still streaming. Also a migration's last resort."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

from disagg_mesh.server.common.config.topology import ModelRoute
from disagg_mesh.server.common.engines.ollama_engine import OllamaEngine
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeStats,
    GenerationEnd,
    Prompt,
    Sampling,
    TextChunk,
)
from disagg_mesh.server.router.request import Attempt, Request

MAX_IN_FLIGHT = 64


class DirectOllama:
    def __init__(self) -> None:
        self._engines: dict[str, OllamaEngine] = {}

    async def run(self, request: Request, attempt: Attempt) -> AsyncGenerator[TextChunk, None]:
        """The step: text as it comes; the summary gets Ollama's figures."""
        route, summary = request.route, attempt.summary
        assert route.ollama_url is not None
        summary.decode_node = summary.decode_address = route.ollama_url
        async with aclosing(self.events(route, request.prompt, request.sampling)) as items:
            async for item in items:
                if isinstance(item, DecodeStats):
                    summary.add_decode_stats(item)
                else:
                    yield item

    async def events(
        self,
        route: ModelRoute,
        prompt: Prompt,
        sampling: Sampling,
        continuation: Continuation | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """Text from the route's Ollama server, then one DecodeStats; bounded by the
        caller's deadline, and by decode_deadline_s between two chunks."""
        assert route.ollama_url is not None
        engine = self._engines.get(route.name)
        if engine is None:
            engine = OllamaEngine(
                url=route.ollama_url,
                model=route.ollama_model or route.name,
                n_ctx=0,
                max_in_flight=MAX_IN_FLIGHT,
                timeout_s=route.decode_deadline_s,
            )
            self._engines[route.name] = engine
        async with aclosing(engine.generate(prompt, sampling, continuation)) as items:
            async for item in items:
                if isinstance(item, GenerationEnd):
                    stats = DecodeStats()
                    stats.add_end(item)
                    yield stats
                else:
                    yield item

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.close()
