"""The router's logic: pick the nodes of a logical model, run prefill then decode, relay
the text, and add up the metrics. Plain Python; the servicer does the protobuf."""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog

from services.common.errors import DeadlineExceeded, NotFound, UpstreamError
from services.common.node_clients import ChannelPool, DecodeClient, PrefillClient
from services.common.retries import call_with_retries
from services.common.topology import ModelRoute, Node, Topology
from services.common.types import (
    DecodeStats,
    FinishReason,
    KvSource,
    KvTransferKind,
    PrefillResult,
    Prompt,
    Sampling,
    TextChunk,
)
from services.common.validation import validate_prompt, validate_sampling

log = structlog.get_logger("router")


class RouteMethod(enum.Enum):
    DISAGGREGATED = "disaggregated"
    DECODE_ONLY = "decode_only"


@dataclass
class RouteSummary:
    """Metrics of one request; durations in seconds."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    method: RouteMethod = RouteMethod.DISAGGREGATED
    kv_transfer: KvTransferKind = KvTransferKind.NONE
    prefill_seconds: float = 0.0
    prefill_tokens_per_second: float = 0.0
    kv_transfer_seconds: float = 0.0
    kv_transfer_bytes: int = 0
    kv_load_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    total_seconds: float = 0.0
    prefill_node: str = ""
    prefill_address: str = ""
    decode_node: str = ""
    decode_address: str = ""


class _Clock:
    """The request's own deadline and each stage's share of it."""

    def __init__(self, time_remaining: float | None) -> None:
        self.started = time.perf_counter()
        self._deadline = None if time_remaining is None else time.monotonic() + time_remaining

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def stage_timeout(self, stage_limit_s: float) -> tuple[float, bool]:
        """(timeout, True if the caller's deadline is what limits it)."""
        if self._deadline is None:
            return stage_limit_s, False
        left = self._deadline - time.monotonic()
        return (left, True) if left < stage_limit_s else (stage_limit_s, False)


class Router:
    def __init__(self, topology: Topology, pool: ChannelPool) -> None:
        self.topology = topology
        self.pool = pool

    def routes(self) -> list[tuple[ModelRoute, list[Node], list[Node]]]:
        t = self.topology
        return [
            (m, [t.node(n) for n in m.prefill], [t.node(n) for n in m.decode]) for m in t.models
        ]

    async def generate(
        self, model: str, prompt: Prompt, sampling: Sampling, time_remaining: float | None
    ) -> AsyncGenerator[TextChunk | RouteSummary, None]:
        """Text chunks as the decode node makes them, then one RouteSummary."""
        clock = _Clock(time_remaining)
        route = self._route(model)
        validate_prompt(prompt)
        validate_sampling(sampling, self.topology.mesh.max_tokens_limit)
        summary = RouteSummary()
        source: KvSource | Prompt = prompt
        if route.mode == "disaggregated":
            prefill_node = self.topology.node(route.prefill[0])
            result = await self._prefill(route, prefill_node, prompt, sampling, clock)
            summary.method = RouteMethod.DISAGGREGATED
            summary.prefill_node, summary.prefill_address = prefill_node.name, prefill_node.address
            summary.prefill_seconds = result.prefill_seconds
            summary.prompt_tokens = result.prompt_tokens
            source = KvSource(
                prefill_address=prefill_node.address,
                kv_handle=result.kv_handle,
                first_token_id=result.first_token_id,
                prompt_tokens=result.prompt_tokens,
                fingerprint=result.fingerprint,
                kv_size_bytes=result.kv_size_bytes,
                first_token_text=result.first_token_text,
            )
        else:
            summary.method = RouteMethod.DECODE_ONLY
        decode_node = self.topology.node(route.decode[0])
        summary.decode_node, summary.decode_address = decode_node.name, decode_node.address
        stats: DecodeStats | None = None
        async with aclosing(self._decode(route, decode_node, source, sampling, clock)) as events:
            async for event in events:
                if isinstance(event, DecodeStats):
                    stats = event
                    continue
                if not summary.time_to_first_token_seconds:
                    summary.time_to_first_token_seconds = clock.elapsed()
                yield event
        if stats is None:
            raise UpstreamError(
                grpc.StatusCode.DATA_LOSS,
                f"decode node {decode_node.address} ended the stream without a summary",
            )
        yield self._finish(summary, stats, clock)

    def _route(self, model: str) -> ModelRoute:
        route = self.topology.route(model)
        if route is None:
            known = ", ".join(m.name for m in self.topology.models)
            raise NotFound(f"model {model!r} is not served here; models: {known}")
        return route

    async def _prefill(
        self, route: ModelRoute, node: Node, prompt: Prompt, sampling: Sampling, clock: _Clock
    ) -> PrefillResult:
        timeout, caller_bound = clock.stage_timeout(route.prefill_deadline_s)
        client = PrefillClient(self.pool, node.address)
        try:
            return await call_with_retries(
                lambda t: client.prefill(route.name, prompt, sampling, timeout_s=t), timeout
            )
        except UpstreamError as exc:
            raise _stage_error(exc, "prefill", node, timeout, caller_bound) from exc

    async def _decode(
        self,
        route: ModelRoute,
        node: Node,
        source: KvSource | Prompt,
        sampling: Sampling,
        clock: _Clock,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        timeout, caller_bound = clock.stage_timeout(route.decode_deadline_s)
        client = DecodeClient(self.pool, node.address)
        try:
            async with aclosing(client.generate(route.name, source, sampling, timeout)) as events:
                async for event in events:
                    yield event
        except UpstreamError as exc:
            raise _stage_error(exc, "decode", node, timeout, caller_bound) from exc

    @staticmethod
    def _finish(summary: RouteSummary, stats: DecodeStats, clock: _Clock) -> RouteSummary:
        summary.prompt_tokens = summary.prompt_tokens or stats.prompt_tokens
        summary.completion_tokens = stats.completion_tokens
        summary.finish_reason = stats.finish_reason
        summary.kv_transfer = stats.kv_transfer
        summary.kv_transfer_seconds = stats.kv_fetch_seconds
        summary.kv_transfer_bytes = stats.kv_fetch_bytes
        summary.kv_load_seconds = stats.kv_load_seconds
        if summary.method == RouteMethod.DECODE_ONLY:
            summary.prefill_seconds = stats.prompt_eval_seconds
        summary.decode_seconds = stats.decode_seconds
        if summary.prefill_seconds > 0:
            summary.prefill_tokens_per_second = summary.prompt_tokens / summary.prefill_seconds
        if stats.decode_seconds > 0:
            summary.decode_tokens_per_second = stats.completion_tokens / stats.decode_seconds
        summary.total_seconds = clock.elapsed()
        return summary


def _stage_error(
    exc: UpstreamError, stage: str, node: Node, timeout: float, caller_bound: bool
) -> UpstreamError | DeadlineExceeded:
    if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return exc
    limit = (
        f"the caller's deadline passed ({timeout:.3f} s were left when the stage began)"
        if caller_bound
        else f"its {timeout:g} s stage deadline passed"
    )
    return DeadlineExceeded(
        f"{stage} stage on node {node.name} ({node.address}) ran out of time: {limit}"
    )
