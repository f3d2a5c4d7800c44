"""The decode node's logic: pull a KV state (or take a prompt) and generate text."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.engines.base import Engine
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.kv.assembler import KvAssembler, check_fingerprint
from disagg_mesh.server.common.runtime.faults import crash_if_marked
from disagg_mesh.server.common.structured.response_format import DEFAULT_LIMITS
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeStats,
    GenerationEnd,
    KvSource,
    KvTransferKind,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
)
from disagg_mesh.server.common.validation import (
    check_format,
    check_served,
    validate_prompt,
    validate_sampling,
)
from disagg_mesh.server.common.wire.node_clients import ChannelPool, PrefillClient

# A KV state larger than this is refused before any byte is fetched.
MAX_KV_BYTES = 16 << 30


class DecodeNode:
    def __init__(
        self,
        *,
        name: str,
        models: list[str],
        engine: Engine,
        pool: ChannelPool,
        max_tokens_limit: int,
        schema_limits: SchemaLimits = DEFAULT_LIMITS,
    ) -> None:
        self.name = name
        self.models = models
        self.engine = engine
        self.pool = pool
        self.max_tokens_limit = max_tokens_limit
        self.schema_limits = schema_limits

    async def generate(
        self,
        model: str,
        source: KvSource | Prompt,
        sampling: Sampling,
        time_remaining: float | None,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """Text chunks as they are produced, then one DecodeStats. With a continuation, the
        generation resumes after the tokens another node generated: evaluated here (with a
        prompt), or by a prefill node whose state holds them (with a KvSource). limits: the
        caller's bounds on the wait for a slot and on the generation (engines/limits.py)."""
        arrived = time.perf_counter()
        check_served(model, self.name, self.models)
        await check_format(sampling, self.schema_limits)
        validate_sampling(sampling, self.max_tokens_limit, self.schema_limits)
        if isinstance(source, Prompt):
            crash_if_marked(source)
        stats = DecodeStats(kv_transfer=self.engine.kv_transfer)
        if isinstance(source, KvSource):
            state = await self._fetch_state(source, time_remaining, stats)
            generation = self.engine.continue_from_state(
                state, source.reference, sampling, continuation, limits
            )
        else:
            validate_prompt(source)
            stats.kv_transfer = KvTransferKind.NONE
            generation = self.engine.generate(source, sampling, continuation, limits)
        end: GenerationEnd | None = None
        async with aclosing(generation) as items:
            async for item in items:
                if isinstance(item, GenerationEnd):
                    end = item
                    continue
                if not stats.time_to_first_token_seconds:
                    stats.time_to_first_token_seconds = time.perf_counter() - arrived
                yield item
        assert end is not None, "an engine's generation ends with a GenerationEnd"
        stats.add_end(end)
        yield stats

    async def _fetch_state(
        self, source: KvSource, time_remaining: float | None, stats: DecodeStats
    ) -> memoryview:
        if not source.prefill_address:
            raise InvalidArgument("kv.prefill_address", "must be set")
        reference = source.reference
        if not reference.kv_handle:
            raise InvalidArgument("kv.kv_handle", "must be set")
        if not 0 < reference.kv_size_bytes <= MAX_KV_BYTES:
            raise InvalidArgument(
                "kv.kv_size_bytes",
                f"must be in 1..{MAX_KV_BYTES}, got {reference.kv_size_bytes}",
            )
        # Refuse a state this engine cannot load before moving any byte of it.
        check_fingerprint(reference.fingerprint, self.engine.fingerprint)
        started = time.perf_counter()
        assembler = KvAssembler(reference.kv_size_bytes, self.engine.fingerprint)
        client = PrefillClient(self.pool, source.prefill_address)
        async with aclosing(client.fetch_kv(reference.kv_handle, time_remaining)) as chunks:
            async for chunk in chunks:
                assembler.add(chunk)
        state = assembler.finish()
        stats.kv_fetch_seconds = time.perf_counter() - started
        stats.kv_fetch_bytes = assembler.received_bytes
        return state
