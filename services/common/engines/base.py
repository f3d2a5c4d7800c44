"""The engine interface: what a prefill or decode node needs from a model runtime.

Nodes see one asynchronous interface. Embedded llama.cpp runs its own step-loop thread
behind it (`engines/llama_cpp/`); Ollama is asynchronous HTTP.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    Fingerprint,
    GenerationEnd,
    KvReference,
    KvTransferKind,
    ModelFacts,
    PrefillFigures,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
)


@dataclass(frozen=True, kw_only=True)
class PrefillOutput(PrefillFigures):
    """A prefill engine's result: its figures, and what the decode node needs to continue:
    real KV state bytes, or token ids as bytes (Ollama), with their SHA-256."""

    kv_state: memoryview
    kv_sha256: str


Generation = AsyncGenerator[TextChunk | GenerationEnd, None]


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is now."""

    # Sequences the engine runs at once, and how many are in use.
    slots: int
    slots_busy: int
    # Requests waiting for a slot, and how many may wait before RESOURCE_EXHAUSTED.
    queue_depth: int
    max_queue: int
    # Tokens per second over the last RATE_WINDOW_S, all slots together.
    prompt_tokens_per_second: float
    decode_tokens_per_second: float
    # Memory of the KV cache the engine holds, and how much of it holds tokens now (0 when
    # it is not ours to know: Ollama).
    kv_cache_bytes: int = 0
    kv_cache_used_bytes: int = 0
    # Prompt tokens the prefix cache holds, and the most it may hold.
    prefix_cache_tokens: int = 0
    prefix_cache_max_tokens: int = 0
    # Of prefix_cache_tokens, those kept outside the KV cache as states' bytes (host memory).
    prefix_cache_stored_tokens: int = 0
    # Since the engine started: seconds with a slot in use, and slot-seconds in use (BusyTime).
    busy_seconds: float = 0.0
    slot_busy_seconds: float = 0.0


@dataclass(frozen=True)
class Placement:
    """Where a loaded model runs: the backend ("CPU", "CUDA", "Metal"; "" when the engine
    does not say) and how many of its layers are on the GPU, counted as llama.cpp counts
    them (the repeating layers plus the output layer)."""

    backend: str = ""
    gpu_layers: int = 0
    layers: int = 0


RATE_WINDOW_S = 10.0


class TokenRates:
    """Prompt and generated tokens per second over the last RATE_WINDOW_S; thread-safe (an
    engine thread adds, the event loop reads)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._events: deque[tuple[float, int, int]] = deque()
        self._lock = threading.Lock()

    def add(self, prompt_tokens: int, decode_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, prompt_tokens, decode_tokens))
            self._prune(now)

    def per_second(self) -> tuple[float, float]:
        with self._lock:
            self._prune(time.monotonic())
            prompt = sum(e[1] for e in self._events)
            decode = sum(e[2] for e in self._events)
        return prompt / self._window_s, decode / self._window_s

    def _prune(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window_s:
            self._events.popleft()


class BusyTime:
    """How long an engine's slots have been in use since it started, counted as they are
    taken and given back (not sampled, so a run of any length reads it exactly):
    seconds with at least one slot in use, and slot-seconds (their sum over the slots).
    Thread-safe (an engine thread takes and frees slots, the event loop reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = 0
        self._since = time.monotonic()
        self._any_s = 0.0
        self._slot_s = 0.0

    def set(self, busy: int) -> None:
        """The engine's own count of slots in use, as it changes."""
        with self._lock:
            self._advance()
            self._busy = busy

    def totals(self) -> tuple[float, float]:
        """Seconds with a slot in use, and slot-seconds in use, up to now."""
        with self._lock:
            self._advance()
            return self._any_s, self._slot_s

    def _advance(self) -> None:
        now = time.monotonic()
        if self._busy > 0:
            self._any_s += now - self._since
            self._slot_s += self._busy * (now - self._since)
        self._since = now


class Engine(Protocol):
    """A loaded model behind a node."""

    fingerprint: Fingerprint
    placement: Placement
    # What the model is (its file's architecture, size, quantization), as far as known.
    model_facts: ModelFacts
    kv_transfer: KvTransferKind
    # Whether the model sits in memory now (Ollama unloads idle models).
    loaded_in_memory: bool

    async def prefill(
        self,
        prompt: Prompt,
        sampling: Sampling,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillOutput:
        """Evaluate the prompt, sample the first token, export what decode needs (leaving
        out what the candidate decode node holding most of the prompt already has). With a
        continuation (engines with KvTransferKind.STATE), evaluate its tokens but the last
        after the prompt instead of sampling, the last being the first token. limits: the
        wait for a turn and the work after it, each bounded (limits.py; an engine that cannot
        tell them apart leaves both to the call's deadline)."""
        ...

    def continue_from_state(
        self,
        kv_state: memoryview,
        reference: KvReference,
        sampling: Sampling,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> Generation:
        """Continue a prefill node's work (`kv_state`, fetched by what `reference` says):
        text chunks from the first token on, then the end.
        With a continuation, the state holds its tokens but the last (a prefill node's
        continuation): they are taken in, not sent, and generation goes on after them.
        limits: the wait for a slot and the generation after it, each bounded (as
        prefill's)."""
        ...

    def generate(
        self,
        prompt: Prompt,
        sampling: Sampling,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> Generation:
        """Whole generation on this engine: text chunks, then the end. With a continuation,
        it resumes after the tokens another node generated, without sending them again;
        the end counts them in its completion tokens. limits: as continue_from_state's."""
        ...

    async def problem(self) -> str | None:
        """None while the engine can serve; otherwise why not (for health checks)."""
        ...

    def load(self) -> EngineLoad:
        """Slots, queue and recent throughput (GetNodeInfo, metrics, disagg status)."""
        ...

    async def close(self) -> None: ...
