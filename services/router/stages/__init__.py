"""The router's stages, a module each: prefill (with its retries), decode (the relay of a
decode node's stream) and direct Ollama (the router calling Ollama's HTTP API itself).

They call nodes through `NodeClients`: gRPC clients over the router's channel pool, or, in
unit tests, in-process fakes."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    DecodeStats,
    KvSource,
    PrefillResult,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
)
from disagg_mesh.server.common.wire.node_clients import ChannelPool, DecodeClient, PrefillClient


class PrefillCalls(Protocol):
    async def prefill(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        timeout_s: float,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillResult: ...


class DecodeCalls(Protocol):
    def generate(
        self,
        model: str,
        source: KvSource | Prompt,
        sampling: Sampling,
        timeout_s: float,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]: ...


class NodeClients(Protocol):
    def prefill(self, address: str) -> PrefillCalls: ...

    def decode(self, address: str) -> DecodeCalls: ...


class PooledClients:
    """The nodes' gRPC clients, over one channel per address."""

    def __init__(self, pool: ChannelPool) -> None:
        self._pool = pool

    def prefill(self, address: str) -> PrefillCalls:
        return PrefillClient(self._pool, address)

    def decode(self, address: str) -> DecodeCalls:
        return DecodeClient(self._pool, address)
