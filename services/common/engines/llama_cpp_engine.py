"""Embedded llama.cpp (llama-cpp-python): the engine that runs anywhere.

KV handoff uses llama.cpp's per-sequence state API: the prefill node evaluates the prompt,
samples the first token and copies sequence 0's KV cache out as raw bytes; the decode node
copies those bytes into its own context and continues by evaluating that first token. A
restored state carries no logits, so nothing is sampled before that evaluation: sampling
without logits aborts the whole process inside llama.cpp. For the same reason every check
on a state (size, checksum, fingerprint) happens before it reaches llama.cpp.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from services.common.engines.base import GeneratedToken, Generation, PrefillOutput
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.models import file_sha256
from services.common.text import assemble
from services.common.types import (
    Fingerprint,
    GenerationEnd,
    KvSource,
    KvTransferKind,
    Prompt,
    Sampling,
    TextChunk,
)
from services.common.worker import EngineWorker

SEQ_ID = 0
ENGINE_VERSION = f"llama-cpp-python/{llama_cpp.__version__}"


class LlamaCppModel:
    """The blocking core: one llama.cpp context. Not thread-safe: one call at a time."""

    def __init__(self, model_path: Path, n_ctx: int, n_threads: int) -> None:
        self._llm = llama_cpp.Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            # Prompt evaluation too: its default is every core, whatever n_threads says.
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=512,
            verbose=False,
        )
        self.n_ctx = self._llm.n_ctx()
        self.fingerprint = Fingerprint(
            model_sha256=file_sha256(model_path),
            n_ctx_tokens=self.n_ctx,
            engine_version=ENGINE_VERSION,
        )
        self._n_vocab = self._llm.n_vocab()
        template = self._llm.metadata.get("tokenizer.chat_template")
        self._chat: Jinja2ChatFormatter | None = None
        if template:
            self._chat = Jinja2ChatFormatter(
                template=template,
                eos_token=self._special_text(self._llm.token_eos()),
                bos_token=self._special_text(self._llm.token_bos()),
            )

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llm.detokenize([token], special=True).decode("utf-8", "replace")

    # -- prompts ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.messages:
            if self._chat is None:
                raise FailedPrecondition("this model has no chat template: send prompt text")
            turns: Any = [{"role": m.role, "content": m.content} for m in prompt.messages]
            rendered = self._chat(messages=turns)
            tokens = self._llm.tokenize(rendered.prompt.encode(), add_bos=False, special=True)
        else:
            # As Llama.create_completion does, so output matches single-process generation.
            tokens = self._llm.tokenize(prompt.text.encode(), add_bos=True, special=True)
        if not tokens:
            raise InvalidArgument("prompt", "has no tokens")
        if len(tokens) >= self.n_ctx:
            raise InvalidArgument(
                "prompt",
                f"is {len(tokens)} tokens; the context holds {self.n_ctx} "
                "including at least one generated token",
            )
        return tokens

    # -- prefill ---------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, sampling: Sampling) -> PrefillOutput:
        started = time.perf_counter()
        tokens = self.tokenize(prompt)
        self._llm.reset()
        self._llm.eval(tokens)
        self._start_sampler(sampling, seed_offset=0)
        first = self._llm.sample()
        state = self._export_state()
        return PrefillOutput(
            kv_state=state,
            kv_sha256=hashlib.sha256(state).hexdigest(),
            first_token_id=first,
            first_token_text="",
            prompt_tokens=len(tokens),
            seconds=time.perf_counter() - started,
        )

    def _export_state(self) -> memoryview:
        ctx = self._llm.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, SEQ_ID)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, SEQ_ID)
        if written == 0 or written > size:
            raise RuntimeError(f"llama.cpp wrote {written} bytes of a {size}-byte KV state")
        return memoryview(buffer).cast("B")[:written]

    # -- decode ----------------------------------------------------------------------------

    def continue_from_state(
        self,
        kv_state: memoryview,
        prompt_tokens: int,
        first_token: int,
        sampling: Sampling,
        cancel: threading.Event,
    ) -> Iterator[GeneratedToken]:
        if not 0 < prompt_tokens < self.n_ctx:
            raise InvalidArgument(
                "kv.prompt_tokens", f"must be in 1..{self.n_ctx - 1}, got {prompt_tokens}"
            )
        if not 0 <= first_token < self._n_vocab:
            raise InvalidArgument(
                "kv.first_token_id", f"must be in 0..{self._n_vocab - 1}, got {first_token}"
            )
        self._llm.reset()
        self._llm._ctx.kv_cache_clear()
        buffer = (ctypes.c_uint8 * len(kv_state)).from_buffer(kv_state)
        read = llama_cpp.llama_state_seq_set_data(self._llm.ctx, buffer, len(kv_state), SEQ_ID)
        if read != len(kv_state):
            self._llm._ctx.kv_cache_clear()
            raise FailedPrecondition(
                f"llama.cpp refused the KV state ({read} of {len(kv_state)} bytes read)"
            )
        self._llm.n_tokens = prompt_tokens
        self._start_sampler(sampling, seed_offset=1)
        yield from self._continue(self._token(first_token), cancel)

    def generate(
        self, tokens: list[int], sampling: Sampling, cancel: threading.Event
    ) -> Iterator[GeneratedToken]:
        self._llm.reset()
        self._llm.eval(tokens)
        self._start_sampler(sampling, seed_offset=0)
        yield from self._continue(self._token(self._llm.sample()), cancel)

    def _continue(self, token: GeneratedToken, cancel: threading.Event) -> Iterator[GeneratedToken]:
        """Yield token, then evaluate it and sample the next, until the end or a full context."""
        while True:
            yield token
            if token.is_end or cancel.is_set() or self._llm.n_tokens >= self.n_ctx:
                return
            self._llm.eval([token.token_id])
            token = self._token(self._llm.sample())

    # -- helpers ---------------------------------------------------------------------------

    def _start_sampler(self, sampling: Sampling, seed_offset: int) -> None:
        # The same sampler chain as Llama.generate builds (greedy when temperature is 0).
        if sampling.seed is not None:
            self._llm.set_seed((sampling.seed + seed_offset) & 0xFFFFFFFF)
        else:
            self._llm.set_seed(llama_cpp.LLAMA_DEFAULT_SEED)
        self._llm._sampler = self._llm._init_sampler(
            temp=sampling.temperature, top_p=sampling.top_p, repeat_penalty=1.0
        )

    def _token(self, token_id: int) -> GeneratedToken:
        return GeneratedToken(
            token_id=token_id,
            piece=self._llm.detokenize([token_id]),
            is_end=bool(llama_cpp.llama_vocab_is_eog(self._llm._model.vocab, token_id)),
        )

    def close(self) -> None:
        self._llm.close()


class LlamaCppEngine:
    """The asynchronous engine nodes use: a LlamaCppModel on its own worker thread."""

    kv_transfer = KvTransferKind.STATE
    loaded_in_memory = True

    def __init__(self, model: LlamaCppModel, worker: EngineWorker) -> None:
        self._model = model
        self._worker = worker
        self.fingerprint = model.fingerprint

    @classmethod
    async def open(
        cls, model_path: Path, n_ctx: int, n_threads: int, worker: EngineWorker
    ) -> LlamaCppEngine:
        model = await worker.call(lambda: LlamaCppModel(model_path, n_ctx, n_threads))
        return cls(model, worker)

    async def prefill(self, prompt: Prompt, sampling: Sampling) -> PrefillOutput:
        return await self._worker.call(lambda: self._model.prefill(prompt, sampling))

    def continue_from_state(
        self, kv_state: memoryview, source: KvSource, sampling: Sampling
    ) -> Generation:
        model = self._model

        def tokens(cancel: threading.Event) -> tuple[int, Iterator[GeneratedToken]]:
            return source.prompt_tokens, model.continue_from_state(
                kv_state, source.prompt_tokens, source.first_token_id, sampling, cancel
            )

        return self._run(tokens, sampling, loads_state=True)

    def generate(self, prompt: Prompt, sampling: Sampling) -> Generation:
        model = self._model

        def tokens(cancel: threading.Event) -> tuple[int, Iterator[GeneratedToken]]:
            prompt_tokens = model.tokenize(prompt)
            return len(prompt_tokens), model.generate(prompt_tokens, sampling, cancel)

        return self._run(tokens, sampling, loads_state=False)

    async def _run(
        self,
        tokens: Callable[[threading.Event], tuple[int, Iterator[GeneratedToken]]],
        sampling: Sampling,
        loads_state: bool,
    ) -> Generation:
        def job(cancel: threading.Event) -> Iterator[TextChunk | GenerationEnd]:
            started = time.perf_counter()
            prompt_tokens, stream = tokens(cancel)
            first_at: list[float] = []  # when the first token came out: the state was ready

            def timed() -> Iterator[GeneratedToken]:
                for token in stream:
                    if not first_at:
                        first_at.append(time.perf_counter())
                    yield token

            for item in assemble(timed(), sampling.max_tokens, sampling.stop):
                if isinstance(item, GenerationEnd):
                    ended = time.perf_counter()
                    ready = first_at[0] if first_at else ended
                    item = dataclasses.replace(
                        item,
                        prompt_tokens=prompt_tokens,
                        kv_load_seconds=ready - started if loads_state else 0.0,
                        prompt_eval_seconds=0.0 if loads_state else ready - started,
                        decode_seconds=ended - ready,
                    )
                yield item

        # Closed as soon as this generator is: that releases the engine at once.
        async with aclosing(self._worker.stream(job)) as items:
            async for item in items:
                yield item

    async def problem(self) -> str | None:
        return None

    async def close(self) -> None:
        await self._worker.call(self._model.close)
        await asyncio.to_thread(self._worker.shutdown)
