"""The engine interface: what a prefill or decode node needs from a model runtime.

Engine calls block (they run the model): nodes call them from one worker thread per engine
(see `services/common/worker.py`), never from the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from services.common.types import Fingerprint, KvTransferKind, Prompt, Sampling


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    # The token's bytes: a piece of UTF-8 that can end inside a character.
    piece: bytes
    # True for an end-of-generation token (its piece is not part of the text).
    is_end: bool


@dataclass
class PrefillOutput:
    # The engine's KV state after the prompt: a bytes-like object the engine wrote.
    kv_state: memoryview
    first_token: GeneratedToken
    prompt_tokens: int
    seconds: float


class Engine(Protocol):
    """A loaded model. Not thread-safe: one call at a time."""

    fingerprint: Fingerprint
    n_ctx: int
    kv_transfer: KvTransferKind

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Prompt tokens, chat template applied; raises InvalidArgument if too long."""
        ...

    def prefill(self, tokens: list[int], sampling: Sampling) -> PrefillOutput:
        """Evaluate the prompt, sample the first token, export the KV state."""
        ...

    def continue_from_state(
        self,
        kv_state: memoryview,
        prompt_tokens: int,
        first_token: int,
        sampling: Sampling,
        cancel: threading.Event,
    ) -> Iterator[GeneratedToken]:
        """Load a prefill node's KV state and yield the first token, then new ones."""
        ...

    def generate(
        self, tokens: list[int], sampling: Sampling, cancel: threading.Event
    ) -> Iterator[GeneratedToken]:
        """Whole generation on this engine: evaluate the prompt, then yield new tokens."""
        ...

    def close(self) -> None: ...
