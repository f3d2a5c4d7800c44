"""The asynchronous engine nodes use: a model, its slot context and the step loop.

KV handoff uses llama.cpp's per-sequence state API: a prefill node evaluates the prompt in
a slot, samples the first token and copies that slot's KV cells out as raw bytes; a decode
node loads those bytes into a free slot and continues by evaluating that first token. A
restored state carries no logits, which is why the prefill side samples the first token
(sampling without logits aborts the whole process inside llama.cpp). For the same reason
every check on a state (size, checksum, fingerprint, positions) happens before it reaches
llama.cpp, and sequence ids are checked in Python (`context.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

from services.common.engines.base import EngineLoad, Generation, PrefillOutput
from services.common.engines.llama_cpp.context import ContextSettings, SlotContext
from services.common.engines.llama_cpp.model import ENGINE_VERSION, LlamaModel, ModelLoadError
from services.common.engines.llama_cpp.scheduler import (
    Event,
    Job,
    JobKind,
    Scheduler,
    SchedulerSettings,
)
from services.common.errors import InvalidArgument, MeshError
from services.common.models import file_sha256
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
class EngineSettings:
    """A node's engine settings from the topology (see topology.Node)."""

    n_ctx: int
    n_threads: int
    max_queue: int
    # None: the role's default, or as many as kv_cache_max_bytes holds.
    slots: int | None = None
    default_slots: int = 8
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = True
    max_itl_slowdown: float = 2.0
    kv_cache_max_bytes: int | None = None
    # Tests only: fewer KV cells than slots * n_ctx, to fill the cache on purpose.
    kv_cells: int | None = None


def plan_slots(settings: EngineSettings, bytes_per_token: int) -> int:
    """How many slots the node runs: every slot holds n_ctx tokens of KV, so slots * n_ctx *
    bytes_per_token must fit in kv_cache_max_bytes when that is set."""
    per_slot = settings.n_ctx * bytes_per_token
    limit = settings.kv_cache_max_bytes
    if limit is None:
        return settings.slots or settings.default_slots
    fits = limit // per_slot
    if settings.slots is None:
        if fits < 1:
            raise ModelLoadError(
                f"kv_cache_max_bytes = {limit} holds no slot: one slot of n_ctx = "
                f"{settings.n_ctx} tokens needs {per_slot} bytes of KV cache"
            )
        return min(settings.default_slots, fits)
    if settings.slots > fits:
        raise ModelLoadError(
            f"slots = {settings.slots} of n_ctx = {settings.n_ctx} tokens need "
            f"{settings.slots * per_slot} bytes of KV cache, over kv_cache_max_bytes = {limit} "
            f"(it holds {fits} slots)"
        )
    return settings.slots


class LlamaCppEngine:
    kv_transfer = KvTransferKind.STATE
    loaded_in_memory = True

    def __init__(
        self,
        model: LlamaModel,
        context: SlotContext,
        scheduler: Scheduler,
        fingerprint: Fingerprint,
    ) -> None:
        self._model = model
        self._context = context
        self._scheduler = scheduler
        self.fingerprint = fingerprint
        self.n_ctx = context.n_ctx

    @classmethod
    async def open(cls, name: str, model_path: Path, settings: EngineSettings) -> LlamaCppEngine:
        def build() -> tuple[LlamaModel, SlotContext, Fingerprint]:
            model = LlamaModel(model_path)
            try:
                slots = plan_slots(settings, model.kv_bytes_per_token)
                context = SlotContext(
                    model,
                    ContextSettings(
                        slots=slots,
                        n_ctx=settings.n_ctx,
                        n_batch=settings.n_batch,
                        n_ubatch=settings.n_ubatch,
                        n_threads=settings.n_threads,
                        flash_attn=settings.flash_attn,
                        kv_cells=settings.kv_cells,
                    ),
                )
            except BaseException:
                model.close()
                raise
            fingerprint = Fingerprint(
                model_sha256=file_sha256(model_path),
                n_ctx_tokens=settings.n_ctx,
                engine_version=ENGINE_VERSION,
            )
            return model, context, fingerprint

        model, context, fingerprint = await asyncio.to_thread(build)
        scheduler = Scheduler(
            name,
            model,
            context,
            SchedulerSettings(settings.max_queue, settings.max_itl_slowdown),
            kv_bytes_per_token=model.kv_bytes_per_token,
        )
        scheduler.start()
        return cls(model, context, scheduler, fingerprint)

    async def prefill(self, prompt: Prompt, sampling: Sampling) -> PrefillOutput:
        tokens = await asyncio.to_thread(self._model.tokenize, prompt, self.n_ctx)
        job = Job(JobKind.PREFILL, sampling, tokens=tokens)
        async with aclosing(self._events(job)) as events:
            output = await anext(events)
        assert isinstance(output, PrefillOutput)
        output.kv_sha256 = await asyncio.to_thread(_sha256, output.kv_state)
        return output

    async def continue_from_state(
        self, kv_state: memoryview, source: KvSource, sampling: Sampling
    ) -> Generation:
        if not 0 < source.prompt_tokens < self.n_ctx:
            raise InvalidArgument(
                "kv.prompt_tokens", f"must be in 1..{self.n_ctx - 1}, got {source.prompt_tokens}"
            )
        if not 0 <= source.first_token_id < self._model.n_vocab:
            raise InvalidArgument(
                "kv.first_token_id",
                f"must be in 0..{self._model.n_vocab - 1}, got {source.first_token_id}",
            )
        job = Job(
            JobKind.CONTINUE,
            sampling,
            state=kv_state,
            prompt_tokens=source.prompt_tokens,
            first_token=source.first_token_id,
        )
        async with aclosing(self._events(job)) as events:
            async for event in events:
                assert isinstance(event, TextChunk | GenerationEnd)
                yield event

    async def generate(self, prompt: Prompt, sampling: Sampling) -> Generation:
        tokens = await asyncio.to_thread(self._model.tokenize, prompt, self.n_ctx)
        job = Job(JobKind.GENERATE, sampling, tokens=tokens)
        async with aclosing(self._events(job)) as events:
            async for event in events:
                assert isinstance(event, TextChunk | GenerationEnd)
                yield event

    async def _events(self, job: Job) -> AsyncGenerator[Event, None]:
        """Run the job on the step loop and hand its events over as they come. If the caller
        stops early (its RPC was cancelled), the job is cancelled and its slot freed."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        job.emit = emit
        self._scheduler.submit(job)
        finished = False
        try:
            while True:
                event = await queue.get()
                if isinstance(event, MeshError):
                    finished = True
                    raise event
                finished = isinstance(event, GenerationEnd | PrefillOutput)
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self._scheduler.cancel(job)

    def load(self) -> EngineLoad:
        return self._scheduler.load()

    async def problem(self) -> str | None:
        return self._scheduler.problem

    async def close(self) -> None:
        await asyncio.to_thread(self._scheduler.stop)
        self._context.close()
        self._model.close()


def _sha256(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
