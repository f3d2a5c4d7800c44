"""The prefill node's logic: evaluate prompts, keep their KV states until fetched."""

from __future__ import annotations

from collections.abc import Iterator

from services.common.engines.base import Engine
from services.common.kv import KvChunk, KvStore, iter_chunks
from services.common.types import PrefillResult, Prompt, Sampling
from services.common.validation import check_served, validate_prompt, validate_sampling


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

    async def prefill(self, model: str, prompt: Prompt, sampling: Sampling) -> PrefillResult:
        check_served(model, self.name, self.models)
        validate_prompt(prompt)
        validate_sampling(sampling, self.max_tokens_limit)
        out = await self.engine.prefill(prompt, sampling)
        # The store is only touched from the event loop, so it needs no lock.
        handle = self.store.put(out.kv_state, out.kv_sha256, self.engine.fingerprint)
        return PrefillResult(
            kv_handle=handle,
            first_token_id=out.first_token_id,
            first_token_text=out.first_token_text,
            prompt_tokens=out.prompt_tokens,
            prefill_seconds=out.seconds,
            kv_size_bytes=len(out.kv_state),
            fingerprint=self.engine.fingerprint,
            kv_ttl_seconds=self.store.ttl_s,
            kv_transfer=self.engine.kv_transfer,
        )

    def fetch(self, kv_handle: str) -> Iterator[KvChunk]:
        """The state's chunks; the handle is gone once this is called."""
        return iter_chunks(self.store.take(kv_handle))
