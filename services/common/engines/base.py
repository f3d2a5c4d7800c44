"""The engine interface: what a prefill or decode node needs from a model runtime.

Nodes see one asynchronous interface. Blocking runtimes (embedded llama.cpp) run on one
worker thread behind it (see `services/common/worker.py`); Ollama is asynchronous HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from services.common.types import (
    Fingerprint,
    GenerationEnd,
    KvSource,
    KvTransferKind,
    Prompt,
    Sampling,
    TextChunk,
)


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    # The token's bytes: a piece of UTF-8 that can end inside a character.
    piece: bytes
    # True for an end-of-generation token (its piece is not part of the text).
    is_end: bool


@dataclass
class PrefillOutput:
    # What the decode node needs to continue: real KV state bytes, or token ids as bytes.
    kv_state: memoryview
    kv_sha256: str
    first_token_id: int
    # Set by engines that report text rather than token bytes (Ollama).
    first_token_text: str
    prompt_tokens: int
    seconds: float


Generation = AsyncGenerator[TextChunk | GenerationEnd, None]


class Engine(Protocol):
    """A loaded model behind a node."""

    fingerprint: Fingerprint
    kv_transfer: KvTransferKind
    # Whether the model sits in memory now (Ollama unloads idle models).
    loaded_in_memory: bool

    async def prefill(self, prompt: Prompt, sampling: Sampling) -> PrefillOutput:
        """Evaluate the prompt, sample the first token, export what decode needs."""
        ...

    def continue_from_state(
        self, kv_state: memoryview, source: KvSource, sampling: Sampling
    ) -> Generation:
        """Continue a prefill node's work: text chunks from the first token on, then the end."""
        ...

    def generate(self, prompt: Prompt, sampling: Sampling) -> Generation:
        """Whole generation on this engine: text chunks, then the end."""
        ...

    async def problem(self) -> str | None:
        """None while the engine can serve; otherwise why not (for health checks)."""
        ...

    async def close(self) -> None: ...
