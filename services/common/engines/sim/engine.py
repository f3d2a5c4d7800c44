"""The simulated engine (`engine = "sim"`): a node with no weights that takes as long as a
hardware profile says its machine would (profile.py), and hands over KV states of the real
size. It serves the same RPCs as a real node, so the real router, its chain, migrations and
the clients run over it unchanged.

- **Tokens.** A prompt is one token per 4 bytes of its text (chat turns as `role: content`
  lines); generated tokens are words picked from the prompt's hash, so the same request gets
  the same answer on any node. An answer ends by itself after 64-511 tokens (from the same
  hash), or at max_tokens; `ignore_eos` runs it to max_tokens.
- **Time.** One prompt evaluates at a time (`prefill_seconds` of the profile at the depth it
  reaches); streams decode together in steps of `decode_step_seconds(streams, mean depth)`,
  continuous batching: a stream joins at the next step and leaves when it ends. `speedup`
  divides every wait.
- **KV.** A prefill's state holds `kv_bytes(prompt tokens)` bytes (sliding-window layers
  counted as the profile says), zeros after a header naming the prompt's hash, with its
  SHA-256: the mesh moves, checks and stores the real amount.
- **Slots.** `slots` sequences at once, `max_queue` waiting; more is RESOURCE_EXHAUSTED.
- Not simulated (yet): a prefix cache, grammars (response_format and tools are answered as
  free text), stop strings.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from disagg_mesh.server.common.engines.base import (
    EngineLoad,
    Generation,
    Placement,
    PrefillOutput,
    TokenRates,
)
from disagg_mesh.server.common.engines.sim.profile import HardwareProfile, ModelSpeed
from disagg_mesh.server.common.errors import InvalidArgument, ResourceExhausted
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    Fingerprint,
    FinishReason,
    GenerationEnd,
    KvReference,
    KvTransferKind,
    Prompt,
    Sampling,
    TextChunk,
)

SIM_VERSION = "disagg-sim/1"
BYTES_PER_TOKEN = 4
VOCAB = 50_000
WORDS = (
    "the function returns a value for every input and the tests cover the edge cases "
    "style is clear names are good a docstring says what it takes and returns correctness "
    "points total fix first loop list empty negative large"
).split()
SHORTEST_ANSWER, LONGEST_ANSWER = 64, 511


def _prompt_bytes(prompt: Prompt) -> bytes:
    """A prompt's text: raw, or its chat turns as `role: content` lines."""
    text = prompt.text or "".join(f"{m.role}: {m.content}\n" for m in prompt.messages)
    return text.encode()


def prompt_tokens(prompt: Prompt) -> int:
    """Tokens a prompt counts as: one per 4 bytes of its text."""
    return max(1, math.ceil(len(_prompt_bytes(prompt)) / BYTES_PER_TOKEN))


def prompt_seed(prompt: Prompt) -> int:
    return int.from_bytes(hashlib.sha256(_prompt_bytes(prompt)).digest()[:8], "big")


def token(seed: int, position: int) -> tuple[int, str]:
    """The generated token at this position of the answer to a prompt of this seed."""
    mixed = (seed ^ (position * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    word = WORDS[mixed % len(WORDS)]
    return mixed % VOCAB, f" {word}"


def answer_tokens(seed: int) -> int:
    """How long the answer to this prompt runs before it ends by itself."""
    return SHORTEST_ANSWER + seed % (LONGEST_ANSWER - SHORTEST_ANSWER + 1)


@dataclass
class _Stream:
    depth: int
    tokens: asyncio.Queue[None] = field(default_factory=asyncio.Queue)


class SimEngine:
    """One simulated model on one simulated machine."""

    def __init__(
        self,
        model: str,
        profile: HardwareProfile,
        n_ctx: int,
        slots: int,
        max_queue: int,
        speedup: float = 1.0,
    ) -> None:
        self._speed: ModelSpeed = profile.model(model)
        self._n_ctx = n_ctx
        self._slots = slots
        self._max_queue = max_queue
        self._speedup = speedup
        # The same for every machine: a state made on one loads on any other of the model.
        model_hash = hashlib.sha256(f"{SIM_VERSION} {model}".encode()).hexdigest()
        self.fingerprint = Fingerprint(
            model_sha256=model_hash, n_ctx_tokens=n_ctx, engine_version=SIM_VERSION
        )
        self.placement = Placement(backend=f"sim ({profile.name})")
        self.kv_transfer = KvTransferKind.STATE
        self.loaded_in_memory = True
        self._busy = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._prompts = asyncio.Lock()
        self._streams: list[_Stream] = []
        self._stepper: asyncio.Task[None] | None = None
        self._rates = TokenRates()

    # -- the engine interface ------------------------------------------------------------

    async def prefill(
        self,
        prompt: Prompt,
        sampling: Sampling,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
    ) -> PrefillOutput:
        n = self._checked(prompt, continuation)
        # A continuation's tokens but the last (the decode node's first) go into the state.
        replayed = max(len(continuation.generated_token_ids) - 1, 0) if continuation else 0
        async with self._slot():
            seconds = await self._evaluate(n + replayed)
        seed = prompt_seed(prompt)
        first_id, first_text = token(seed, 0)
        if continuation is not None and continuation.generated_token_ids:
            first_id, first_text = continuation.generated_token_ids[-1], ""
        state = self._state(seed, n + replayed)
        return PrefillOutput(
            first_token_id=first_id,
            first_token_text=first_text,
            prompt_tokens=n,
            prefill_seconds=seconds,
            kv_state_bytes=len(state),
            replayed_tokens=replayed,
            kv_state=memoryview(state),
            kv_sha256=hashlib.sha256(state).hexdigest(),
        )

    async def continue_from_state(
        self,
        kv_state: memoryview,
        reference: KvReference,
        sampling: Sampling,
        continuation: Continuation | None = None,
    ) -> Generation:
        seed = int.from_bytes(bytes(kv_state[:8]), "big")
        done = len(continuation.generated_token_ids) if continuation is not None else 0
        depth = reference.prompt_tokens + max(done - 1, 0)
        async with self._slot():
            if not done:  # the prefill node's first token goes out first
                yield TextChunk(reference.first_token_text, [reference.first_token_id])
                done = 1
            async for event in self._decode(seed, depth + 1, done, sampling, 0.0):
                yield event

    async def generate(
        self, prompt: Prompt, sampling: Sampling, continuation: Continuation | None = None
    ) -> Generation:
        n = self._checked(prompt, continuation)
        done = len(continuation.generated_token_ids) if continuation is not None else 0
        if continuation is not None and not done:
            done = continuation.generated_tokens
        seed = prompt_seed(prompt)
        async with self._slot():
            seconds = await self._evaluate(n + done)
            async for event in self._decode(seed, n + done, done, sampling, seconds):
                yield event

    async def problem(self) -> str | None:
        return None

    def load(self) -> EngineLoad:
        prompt_tps, decode_tps = self._rates.per_second()
        return EngineLoad(
            slots=self._slots,
            slots_busy=self._busy,
            queue_depth=len(self._waiting),
            max_queue=self._max_queue,
            prompt_tokens_per_second=prompt_tps,
            decode_tokens_per_second=decode_tps,
        )

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()

    # -- time ----------------------------------------------------------------------------

    def _checked(self, prompt: Prompt, continuation: Continuation | None) -> int:
        n = prompt_tokens(prompt)
        done = len(continuation.generated_token_ids) if continuation is not None else 0
        if n + done >= self._n_ctx:
            raise InvalidArgument(
                "prompt",
                f"is {n} tokens (simulated: 4 bytes a token); the context holds {self._n_ctx} "
                "including at least one generated token",
            )
        return n

    async def _evaluate(self, tokens: int) -> float:
        """Evaluate a prompt's tokens, one prompt at a time: the seconds it took."""
        async with self._prompts:
            seconds = self._speed.prefill_seconds(tokens)
            await asyncio.sleep(seconds / self._speedup)
        self._rates.add(tokens, 0)
        return seconds

    async def _decode(
        self, seed: int, depth: int, done: int, sampling: Sampling, prompt_seconds: float
    ) -> AsyncGenerator[TextChunk | GenerationEnd, None]:
        """Tokens from position `done` on, in the shared steps, to the answer's end."""
        natural = sampling.max_tokens if sampling.ignore_eos else answer_tokens(seed)
        last = min(sampling.max_tokens, natural)
        stream = _Stream(depth)
        started = time.perf_counter()
        self._streams.append(stream)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._step_loop())
        try:
            while done < last:
                await stream.tokens.get()
                token_id, text = token(seed, done)
                done += 1
                yield TextChunk(text, [token_id])
        finally:
            self._streams.remove(stream)
        finish = FinishReason.LENGTH if last == sampling.max_tokens else FinishReason.STOP
        yield GenerationEnd(
            completion_tokens=done,
            finish_reason=finish,
            prompt_tokens=depth,
            prompt_eval_seconds=prompt_seconds,
            decode_seconds=time.perf_counter() - started,
        )

    async def _step_loop(self) -> None:
        """Decode steps while streams run: each step's length from the profile."""
        while self._streams:
            depth = sum(s.depth for s in self._streams) / len(self._streams)
            seconds = self._speed.decode_step_seconds(len(self._streams), depth)
            await asyncio.sleep(seconds / self._speedup)
            for stream in self._streams:
                stream.depth += 1
                stream.tokens.put_nowait(None)
            self._rates.add(0, len(self._streams))

    # -- slots and states ----------------------------------------------------------------

    @asynccontextmanager
    async def _slot(self) -> AsyncGenerator[None, None]:
        if self._busy >= self._slots:
            if len(self._waiting) >= self._max_queue:
                raise ResourceExhausted(
                    f"all {self._slots} simulated slots busy and {len(self._waiting)} "
                    "requests waiting"
                )
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn in self._waiting:
                    self._waiting.remove(turn)
                elif not turn.cancelled():
                    self._release()  # the slot was ours already: pass it on
                raise
        else:
            self._busy += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot goes to the next caller as it is
                return
        self._busy -= 1

    def _state(self, seed: int, tokens: int) -> bytes:
        """A KV state of the real size: the prompt's seed, then zeros."""
        size = max(self._speed.kv_bytes(tokens), 8)
        state = bytearray(size)
        state[:8] = seed.to_bytes(8, "big")
        return bytes(state)
