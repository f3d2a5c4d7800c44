"""The prefill node's logic: evaluate prompts, keep their KV states until fetched."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.engines.base import Engine
from disagg_mesh.server.common.kv.store import KvStore
from disagg_mesh.server.common.runtime.faults import crash_if_marked
from disagg_mesh.server.common.structured.response_format import DEFAULT_LIMITS
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    PrefillFigures,
    PrefillResult,
    Prompt,
    Sampling,
    StageLimits,
)
from disagg_mesh.server.common.validation import (
    check_format,
    check_served,
    validate_prompt,
    validate_sampling,
)
from disagg_mesh.server.common.wire.kv_wire import encode_state

# The figures the engine reports, passed on as they are (types.PrefillFigures); the node
# adds the rest of PrefillResult (the handle, sizes, fingerprint, TTL, transfer kind).
REPORTED = tuple(f.name for f in dataclasses.fields(PrefillFigures))


class PrefillNode:
    def __init__(
        self,
        *,
        name: str,
        models: list[str],
        engine: Engine,
        store: KvStore,
        max_tokens_limit: int,
        schema_limits: SchemaLimits = DEFAULT_LIMITS,
    ) -> None:
        self.name = name
        self.models = models
        self.engine = engine
        self.store = store
        self.max_tokens_limit = max_tokens_limit
        self.schema_limits = schema_limits

    async def prefill(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillResult:
        """Evaluate the prompt (and a continuation's tokens) and keep the KV state for the
        decode node to fetch. limits: the caller's bounds on the wait for a turn and on the
        work (engines/limits.py)."""
        check_served(model, self.name, self.models)
        validate_prompt(prompt)
        await check_format(sampling, self.schema_limits)
        validate_sampling(sampling, self.max_tokens_limit, self.schema_limits)
        crash_if_marked(prompt)
        out = await self.engine.prefill(prompt, sampling, candidates, continuation, limits)
        fingerprint = self.engine.fingerprint
        # Serialized off the event loop, once: FetchKv then only hands the messages out.
        messages = await asyncio.to_thread(encode_state, out.kv_state, out.kv_sha256, fingerprint)
        # The store is only touched from the event loop, so it needs no lock.
        handle = self.store.put(messages, len(out.kv_state))
        reported = {name: getattr(out, name) for name in REPORTED}
        reported["kv_state_bytes"] = out.kv_state_bytes or len(out.kv_state)
        return PrefillResult(
            **reported,
            kv_handle=handle,
            kv_size_bytes=len(out.kv_state),
            fingerprint=fingerprint,
            kv_ttl_seconds=self.store.ttl_s,
            kv_transfer=self.engine.kv_transfer,
        )

    def fetch(self, kv_handle: str) -> list[bytes]:
        """The state's serialized FetchKv messages; the handle is gone once this is called."""
        return self.store.take(kv_handle).messages
