"""Embedded llama.cpp (llama-cpp-python): the engine that runs anywhere.

KV handoff uses llama.cpp's per-sequence state API: the prefill node evaluates the prompt,
samples the first token and copies sequence 0's KV cache out as raw bytes; the decode node
copies those bytes into its own context and continues by evaluating that first token. A
restored state carries no logits, so nothing is sampled before that evaluation: sampling
without logits aborts the whole process inside llama.cpp. For the same reason every check
on a state (size, checksum, fingerprint) happens before it reaches llama.cpp.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from services.common.engines.base import GeneratedToken, PrefillOutput
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.models import file_sha256
from services.common.types import Fingerprint, KvTransferKind, Prompt, Sampling

SEQ_ID = 0
ENGINE_VERSION = f"llama-cpp-python/{llama_cpp.__version__}"


class LlamaCppEngine:
    kv_transfer = KvTransferKind.STATE

    def __init__(self, model_path: Path, n_ctx: int, n_threads: int | None = None) -> None:
        self._llm = llama_cpp.Llama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            # llama-cpp-python's default is half the cores; a node owns its machine's.
            n_threads=n_threads or os.cpu_count() or 1,
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

    def prefill(self, tokens: list[int], sampling: Sampling) -> PrefillOutput:
        started = time.perf_counter()
        self._llm.reset()
        self._llm.eval(tokens)
        self._start_sampler(sampling, seed_offset=0)
        first = self._token(self._llm.sample())
        state = self._export_state()
        return PrefillOutput(
            kv_state=state,
            first_token=first,
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
