"""Migration: a decode node fails after text was delivered, and the same generation goes on
elsewhere, from the prompt and the tokens delivered. Nothing is sent twice and nothing is
skipped; max_tokens, stop strings and the caller's deadline count across the whole answer.

The node taking over (the selection policy's `takeover_targets`: another decode node of the
route, last its direct_ollama step) evaluates the prompt and the delivered tokens itself, or
a prefill node does and hands their KV state over (route.migrate_via; `resume_via`). A
client resuming a generation through this router after another router failed is the same
thing, with that router in the failed node's place.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.errors import MeshError, Unavailable
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    DecodeStats,
    KvSource,
    Prompt,
    TextChunk,
)
from disagg_mesh.server.router.failures import (
    blame,
    blames_node,
    can_migrate,
    is_final,
    midstream_error,
)
from disagg_mesh.server.router.knowledge import Knowledge
from disagg_mesh.server.router.request import Attempt, Delivered, Request
from disagg_mesh.server.router.selection import Selection
from disagg_mesh.server.router.stages.decode import DecodeStage, required
from disagg_mesh.server.router.stages.direct_ollama import DirectOllama
from disagg_mesh.server.router.stages.prefill import PrefillStage, kv_source
from disagg_mesh.server.router.summary import Migration, ResumeInfo, RouteMethod, RouteSummary

log = structlog.get_logger("router")


@dataclass(frozen=True)
class Stages:
    """The stages the chain and the migrations call."""

    prefill: PrefillStage
    decode: DecodeStage
    direct: DirectOllama


class Migrator:
    def __init__(self, selection: Selection, stages: Stages) -> None:
        self._selection = selection
        self._health = selection.health
        self._knowledge: Knowledge = selection.knowledge
        self._prefill, self._decode, self._direct = stages.prefill, stages.decode, stages.direct

    async def migrate(
        self, request: Request, attempt: Attempt, error: MeshError
    ) -> AsyncGenerator[TextChunk, None]:
        """Go on with the attempt's generation elsewhere, up to route.max_migrations times.
        Raises the mid-stream error (saying how much was delivered) when no node can take
        over."""
        route, summary, sent = request.route, attempt.summary, attempt.sent
        failed_name = attempt.blamed
        # How the original request rendered its prompt: an Ollama continuation renders it
        # the same way.
        disaggregated = attempt.method == RouteMethod.DISAGGREGATED
        renderer = attempt.prefill if disaggregated else attempt.decode
        raw_prompt = (
            not request.prompt.messages and renderer is not None and renderer.engine == "llama_cpp"
        )
        # The prefill node that evaluated this prompt: its prefix cache holds it.
        prefilled = attempt.prefill.name if disaggregated and attempt.prefill else ""
        info = attempt.resume_info()
        while True:
            sent.failed_nodes.add(failed_name)
            done = len(summary.migrations)
            targets = self._selection.takeover_targets(route, sent.failed_nodes)
            exhausted = not route.migrate or done >= route.max_migrations or not targets
            if exhausted or not can_migrate(error):
                raise midstream_error(error, failed_name, sent.deltas, done)
            target = targets[0]
            name = target.name if isinstance(target, Node) else target
            migration = Migration(failed_name, error.code.name, sent.tokens, name)
            summary.migrations.append(migration)
            metrics.migration(route.name, error.code.name)
            log.warning(
                "decode node failed mid-answer, resuming on another",
                failed_node=failed_name,
                code=error.code.name,
                tokens_delivered=sent.tokens,
                resumed_on=name,
            )
            failed_at = time.perf_counter()
            continuation = _continuation(sent, info, raw_prompt)
            attempt.current = target if isinstance(target, Node) else None
            stats: DecodeStats | None = None
            try:
                if isinstance(target, Node):
                    via, migration.reason = self._selection.resume_via(
                        request, attempt, target, prefilled
                    )
                    events = self._resume_on(request, target, via, continuation, migration)
                else:
                    events = self._direct.events(
                        route, request.prompt, request.sampling, continuation
                    )
                async with aclosing(events) as stream:
                    async for event in stream:
                        if isinstance(event, DecodeStats):
                            stats = event
                            continue
                        if not migration.resume_seconds:
                            migration.resume_seconds = time.perf_counter() - failed_at
                        sent.add(event)
                        yield event
                stats = required(stats, target)
            except MeshError as again:
                blame(self._health, attempt, again)  # attempt.current: the target (or None)
                failed_name, error = name, again
                continue
            if not migration.resume_seconds:
                migration.resume_seconds = time.perf_counter() - failed_at
            if isinstance(target, Node):
                attempt.decode = target
                summary.decode_node, summary.decode_address = target.name, target.address
                replayed = 0 if migration.via_prefill_node else sent.tokens
                self._knowledge.took_over(target, stats, sent.tokens, replayed)
            else:
                summary.decode_node = summary.decode_address = target
            summary.add_resumed_stats(stats)
            return

    async def resume(
        self, request: Request, resume: Continuation, resumed_from: str
    ) -> AsyncGenerator[TextChunk | RouteSummary | ResumeInfo, None]:
        """A client resuming, through this router, a generation another router was serving
        when it failed: the rest of it on a decode node, as a migration (the failed router
        in the failed node's place)."""
        route = request.route
        prefill = self._selection.nodes(route.prefill)
        decode = self._selection.nodes(route.decode)
        origin = f"router {resumed_from or '(unnamed)'}"
        disaggregated = resume.first_token_from_prefill and bool(prefill)
        ids = list(resume.generated_token_ids)
        attempt = Attempt(
            RouteMethod.DISAGGREGATED if disaggregated else RouteMethod.DECODE_ONLY,
            # The nodes that would have rendered the prompt, as the first router's did.
            prefill=prefill[0] if prefill else None,
            decode=decode[0] if decode else None,
            origin=origin,
            summary=RouteSummary(
                route_reason=f"resumed after {origin} failed mid-answer",
                cached_prompt_tokens=resume.prompt_cached_tokens or 0,
            ),
            sent=Delivered(
                deltas=1,
                tokens=max(resume.generated_tokens, len(ids)),
                token_ids=ids,
                ids_complete=bool(ids),
                text=[resume.generated_text],
            ),
        )
        yield attempt.resume_info()
        error = Unavailable(f"{origin} failed mid-answer")
        async with aclosing(self.migrate(request, attempt, error)) as stream:
            async for chunk in stream:
                yield chunk
        attempt.summary.total_seconds = request.clock.elapsed()
        yield attempt.summary

    async def _resume_on(
        self,
        request: Request,
        target: Node,
        via: Node | None,
        continuation: Continuation,
        migration: Migration,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """The generation going on on `target`: from the KV state of the prompt and the
        delivered tokens that `via` evaluated, or from the prompt and the delivered tokens,
        evaluated by target itself. When the prefill node fails, or target no longer holds
        the prefix the state left out (ABORTED), target evaluates them itself."""
        migration.via_prefill_node = via.name if via else ""
        source: KvSource | Prompt = request.prompt
        if via is not None:
            try:
                source = await self._prefill_continuation(request, via, target, continuation)
            except MeshError as exc:
                if is_final(exc):
                    raise
                if blames_node(exc):
                    self._health.failed(via)
                self._resume_alone(migration, target, via, exc)
        streamed = False
        try:
            events = self._decode.stream(request, target, source, continuation)
            async for event in events:
                streamed |= isinstance(event, TextChunk)
                yield event
            return
        except MeshError as exc:
            if exc.code != grpc.StatusCode.ABORTED or streamed or via is None:
                raise
            self._knowledge.forget(target)
            self._resume_alone(migration, target, via, exc)
        async for event in self._decode.stream(request, target, request.prompt, continuation):
            yield event

    def _resume_alone(self, migration: Migration, target: Node, via: Node, exc: MeshError) -> None:
        migration.via_prefill_node = ""
        migration.reason += (
            f"; {via.name}'s way failed ({exc.code.name}: {exc.message}), so {target.name} "
            "evaluated them itself"
        )
        log.warning(
            "resuming through the prefill node failed; the decode node evaluates it itself",
            prefill_node=via.name,
            decode_node=target.name,
            code=exc.code.name,
            error=exc.message,
        )

    async def _prefill_continuation(
        self, request: Request, via: Node, target: Node, continuation: Continuation
    ) -> KvSource:
        """The prefill node evaluates the prompt and the delivered tokens but the last, and
        keeps their KV state for target (less the prefix target holds)."""
        held = frozenset(self._knowledge.prefixes.held(target.name))
        candidates = [DecodeCandidate(target.name, held)]
        result = await self._prefill.call(request, via, candidates, continuation)
        self._knowledge.replayed(via, result)
        return kv_source(via, result)


def _continuation(sent: Delivered, info: ResumeInfo, raw_prompt: bool) -> Continuation:
    return Continuation(
        # Without every id, a llama.cpp node tokenizes the text instead.
        generated_token_ids=tuple(sent.token_ids) if sent.ids_complete else (),
        generated_text="".join(sent.text),
        first_token_from_prefill=info.first_token_from_prefill,
        raw_prompt=raw_prompt,
        generated_tokens=sent.tokens,
        prompt_cached_tokens=info.prompt_cached_tokens,
    )
