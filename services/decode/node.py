"""The decode node's logic: pull a KV state (or take a prompt) and generate text."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass

from services.common.engines.base import Engine, GeneratedToken
from services.common.errors import InvalidArgument
from services.common.kv import KvAssembler, check_fingerprint
from services.common.node_clients import ChannelPool, PrefillClient
from services.common.text import GenerationEnd, assemble
from services.common.types import (
    DecodeStats,
    KvSource,
    KvTransferKind,
    Prompt,
    Sampling,
    TextChunk,
)
from services.common.validation import check_served, validate_prompt, validate_sampling
from services.common.worker import EngineWorker

# A KV state larger than this is refused before any byte is fetched.
MAX_KV_BYTES = 16 << 30


@dataclass
class _EngineTimes:
    """Written on the engine thread, read after the stream ends."""

    prompt_tokens: int = 0
    started: float = 0.0
    first_token: float = 0.0


class DecodeNode:
    def __init__(
        self,
        *,
        name: str,
        models: list[str],
        engine: Engine,
        worker: EngineWorker,
        pool: ChannelPool,
        max_tokens_limit: int,
    ) -> None:
        self.name = name
        self.models = models
        self.engine = engine
        self.worker = worker
        self.pool = pool
        self.max_tokens_limit = max_tokens_limit

    async def generate(
        self,
        model: str,
        source: KvSource | Prompt,
        sampling: Sampling,
        time_remaining: float | None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """Text chunks as they are produced, then one DecodeStats."""
        arrived = time.perf_counter()
        check_served(model, self.name, self.models)
        validate_sampling(sampling, self.max_tokens_limit)
        stats = DecodeStats()
        engine = self.engine
        times = _EngineTimes()

        if isinstance(source, KvSource):
            state = await self._fetch_state(source, time_remaining, stats)
            stats.kv_transfer = KvTransferKind.STATE
            times.prompt_tokens = source.prompt_tokens

            def tokens(cancel: threading.Event) -> Iterator[GeneratedToken]:
                return engine.continue_from_state(
                    state, source.prompt_tokens, source.first_token_id, sampling, cancel
                )
        else:
            validate_prompt(source)

            def tokens(cancel: threading.Event) -> Iterator[GeneratedToken]:
                prompt_tokens = engine.tokenize(source)
                times.prompt_tokens = len(prompt_tokens)
                return engine.generate(prompt_tokens, sampling, cancel)

        def job(cancel: threading.Event) -> Iterator[TextChunk | GenerationEnd]:
            times.started = time.perf_counter()
            return assemble(_timed(tokens(cancel), times), sampling.max_tokens, sampling.stop)

        end: GenerationEnd | None = None
        async with aclosing(self.worker.stream(job)) as items:
            async for item in items:
                if isinstance(item, GenerationEnd):
                    end = item
                    continue
                if not stats.time_to_first_token_seconds:
                    stats.time_to_first_token_seconds = time.perf_counter() - arrived
                yield item
        assert end is not None
        finished = time.perf_counter()
        ready_at = times.first_token or finished
        if stats.kv_transfer == KvTransferKind.STATE:
            stats.kv_load_seconds = ready_at - times.started
        else:
            stats.prompt_eval_seconds = ready_at - times.started
        stats.prompt_tokens = times.prompt_tokens
        stats.completion_tokens = end.completion_tokens
        stats.finish_reason = end.finish_reason
        stats.decode_seconds = finished - ready_at
        yield stats

    async def _fetch_state(
        self, source: KvSource, time_remaining: float | None, stats: DecodeStats
    ) -> memoryview:
        if not source.prefill_address:
            raise InvalidArgument("kv.prefill_address", "must be set")
        if not source.kv_handle:
            raise InvalidArgument("kv.kv_handle", "must be set")
        if not 0 < source.kv_size_bytes <= MAX_KV_BYTES:
            raise InvalidArgument(
                "kv.kv_size_bytes", f"must be in 1..{MAX_KV_BYTES}, got {source.kv_size_bytes}"
            )
        # Refuse a state this engine cannot load before moving any byte of it.
        check_fingerprint(source.fingerprint, self.engine.fingerprint)
        started = time.perf_counter()
        assembler = KvAssembler(source.kv_size_bytes, self.engine.fingerprint)
        client = PrefillClient(self.pool, source.prefill_address)
        async with aclosing(client.fetch_kv(source.kv_handle, time_remaining)) as chunks:
            async for chunk in chunks:
                assembler.add(chunk)
        state = assembler.finish()
        stats.kv_fetch_seconds = time.perf_counter() - started
        stats.kv_fetch_bytes = assembler.received_bytes
        return state


def _timed(tokens: Iterator[GeneratedToken], times: _EngineTimes) -> Iterator[GeneratedToken]:
    for token in tokens:
        if not times.first_token:
            times.first_token = time.perf_counter()
        yield token
