"""The fallback chain: the route's steps in order (the selection policy's), each step's
attempts in turn, until one serves the request.

A failure before any text reached the caller moves on to the next attempt (logged, and
listed in the summary); a final one (failures.py) stops the chain. A failure after text was
sent is never retried, which would send duplicated text: the generation migrates
(migration.py), or the stream ends with the error, whose message says how much was
delivered.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc

from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.types import DecodeStats, KvSource, PrefillResult, Prompt, TextChunk
from disagg_mesh.server.router.failures import (
    attempt_failed,
    blame,
    decode_room,
    exhausted,
    is_final,
)
from disagg_mesh.server.router.knowledge import Knowledge
from disagg_mesh.server.router.migration import Migrator, Stages
from disagg_mesh.server.router.request import Attempt, Request
from disagg_mesh.server.router.selection import Selection
from disagg_mesh.server.router.stages.decode import required
from disagg_mesh.server.router.stages.prefill import kv_source
from disagg_mesh.server.router.summary import ResumeInfo, RouteMethod, RouteSummary


class Chain:
    def __init__(self, selection: Selection, stages: Stages, migrator: Migrator) -> None:
        self._selection = selection
        self._health = selection.health
        self._knowledge: Knowledge = selection.knowledge
        self._prefill, self._decode, self._direct = stages.prefill, stages.decode, stages.direct
        self._migrator = migrator

    async def run(
        self, request: Request
    ) -> AsyncGenerator[TextChunk | RouteSummary | ResumeInfo, None]:
        """Text chunks as they are made (a ResumeInfo before the first), then the summary."""
        steps, reason = self._selection.order(request)
        last_error: MeshError | None = None
        busy: MeshError | None = None  # a node's answer, in an earlier step
        for step in steps:
            busy_before = busy
            for attempt in self._selection.attempts(step, request):
                if busy_before is not None and not self._has_room(attempt):
                    continue
                attempt.started = time.perf_counter()
                attempt.summary.route_reason = reason
                sent = attempt.sent
                try:
                    async with aclosing(self._attempt(request, attempt)) as stream:
                        async for chunk in stream:
                            if not sent.deltas:
                                request.work_done = True  # text delivered
                                elapsed = request.clock.elapsed()
                                attempt.summary.time_to_first_token_seconds = elapsed
                                yield attempt.resume_info()
                            sent.add(chunk)
                            yield chunk
                except MeshError as exc:
                    if sent.deltas:
                        blame(self._health, attempt, exc)
                        resumed = self._migrator.migrate(request, attempt, exc)
                        async with aclosing(resumed) as stream:
                            async for chunk in stream:
                                yield chunk
                    elif is_final(exc):
                        raise
                    else:
                        attempt_failed(self._health, request, attempt, exc)
                        last_error = exc
                        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            busy = exc
                        continue
                yield self._served(request, attempt)
                return
        raise exhausted(request.route, request.failed, busy or last_error)

    def _has_room(self, attempt: Attempt) -> bool:
        """Whether a later step's attempt, after a node answered busy, goes to nodes with
        none of this router's calls (NodeHealth.idle): a busy node is not failing, and a
        later step on busy nodes would only move the work to where there is less room for
        it (a decode node evaluating the whole prompt between its streams' tokens slows
        them twofold, and its prompts queue behind each other: first tokens 20-50 s late
        under AIPerf at 32 at once, 2026-11-27). Otherwise the caller hears busy, and when
        to try again."""
        nodes = [attempt.decode, *attempt.prefill_candidates[:1]]
        return all(self._health.idle(n) for n in nodes if n is not None)

    def _served(self, request: Request, attempt: Attempt) -> RouteSummary:
        for node in (attempt.prefill, attempt.decode):
            if node is not None and node.name not in attempt.sent.failed_nodes:
                self._health.succeeded(node)
        summary = attempt.summary
        summary.failed_attempts = request.failed
        summary.total_seconds = request.clock.elapsed()
        self._knowledge.served(request, attempt)
        return summary

    async def _attempt(self, request: Request, attempt: Attempt) -> AsyncGenerator[TextChunk, None]:
        """One attempt: relays its text and fills in its summary (and request.failed, with
        the prefill calls that were retried)."""
        if attempt.method == RouteMethod.DIRECT_OLLAMA:
            async with aclosing(self._direct.run(request, attempt)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        while True:  # again only when a decode node had let the prefix go (ABORTED)
            source: KvSource | Prompt = request.prompt
            result: PrefillResult | None = None
            if attempt.prefill_candidates:
                self._knowledge.evaluating(attempt.prefill_candidates[0], request)
                candidates = self._selection.decode_candidates(request.route)
                assert attempt.decode is not None
                async with decode_room(self._health, request, attempt.decode):
                    result = await self._prefill.run(request, attempt, candidates)
                request.work_done = True  # a state was made for it
                assert attempt.prefill is not None
                request.held_s = attempt.prefill.kv_ttl_s
                attempt.decode = self._selection.decode_after_prefill(
                    request.route, attempt.decode, result.kv_prefix_node
                )
                source = kv_source(attempt.prefill, result)
            assert attempt.decode is not None
            attempt.current = decode = attempt.decode
            if result is None:  # the decode node evaluates the prompt itself
                self._knowledge.evaluating(decode, request)
            attempt.summary.decode_node = decode.name
            attempt.summary.decode_address = decode.address
            stats: DecodeStats | None = None
            streamed = False
            try:
                async with aclosing(self._decode.stream(request, decode, source)) as events:
                    async for event in events:
                        if isinstance(event, DecodeStats):
                            stats = event
                        else:
                            streamed = True
                            yield event
            except MeshError as exc:
                if exc.code != grpc.StatusCode.ABORTED or streamed or result is None:
                    raise
                # What the router believed of the node is stale: forget it, prefill again
                # (the prefill node's own cache makes that cheap) for the whole state.
                self._knowledge.forget(decode)
                attempt_failed(self._health, request, attempt, exc)
                attempt.started = time.perf_counter()
                request.held_s = 0.0  # that state is not waited for any more
                continue
            stats = required(stats, decode)
            attempt.summary.add_decode_stats(stats)
            if result is not None:
                self._knowledge.kept(decode, result, stats)
            return
