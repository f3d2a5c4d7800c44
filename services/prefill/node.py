"""The prefill node's logic: evaluate prompts, keep their KV states until fetched."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.common.engines.base import Engine
from services.common.kv.store import KvStore
from services.common.types import (
    Continuation,
    DecodeCandidate,
    PrefillResult,
    Prompt,
    Sampling,
)
from services.common.validation import check_served, validate_prompt, validate_sampling
from services.common.wire.kv_wire import encode_state


class PrefillNode:
    def __init__(
        self,
        *,
        name: str,
        models: list[str],
        engine: Engine,
        store: KvStore,
        max_tokens_limit: int,
    ) -> None:
        self.name = name
        self.models = models
        self.engine = engine
        self.store = store
        self.max_tokens_limit = max_tokens_limit

    async def prefill(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
    ) -> PrefillResult:
        """Evaluate the prompt (and a continuation's tokens) and keep the KV state for the
        decode node to fetch."""
        check_served(model, self.name, self.models)
        validate_prompt(prompt)
        validate_sampling(sampling, self.max_tokens_limit)
        out = await self.engine.prefill(prompt, sampling, candidates, continuation)
        fingerprint = self.engine.fingerprint
        # Serialized off the event loop, once: FetchKv then only hands the messages out.
        messages = await asyncio.to_thread(encode_state, out.kv_state, out.kv_sha256, fingerprint)
        # The store is only touched from the event loop, so it needs no lock.
        handle = self.store.put(messages, len(out.kv_state))
        return PrefillResult(
            kv_handle=handle,
            first_token_id=out.first_token_id,
            first_token_text=out.first_token_text,
            prompt_tokens=out.prompt_tokens,
            cached_prompt_tokens=out.cached_prompt_tokens,
            prefill_seconds=out.seconds,
            kv_size_bytes=len(out.kv_state),
            fingerprint=self.engine.fingerprint,
            kv_ttl_seconds=self.store.ttl_s,
            kv_transfer=self.engine.kv_transfer,
            block_hashes=out.block_hashes,
            kv_prefix_tokens=out.kv_prefix_tokens,
            kv_prefix_node=out.kv_prefix_node,
            kv_state_bytes=out.kv_state_bytes or len(out.kv_state),
            replayed_tokens=out.replayed_tokens,
            replay_seconds=out.replay_seconds,
            open_message=out.open_message,
        )

    def fetch(self, kv_handle: str) -> list[bytes]:
        """The state's serialized FetchKv messages; the handle is gone once this is called."""
        return self.store.take(kv_handle).messages
