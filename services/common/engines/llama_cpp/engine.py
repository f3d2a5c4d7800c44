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
import dataclasses
import hashlib
import threading
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.engines.base import EngineLoad, Generation, PrefillOutput
from disagg_mesh.server.common.engines.limits import LimitClock
from disagg_mesh.server.common.engines.llama_cpp.context import ContextSettings, SlotContext
from disagg_mesh.server.common.engines.llama_cpp.grammars import Grammars
from disagg_mesh.server.common.engines.llama_cpp.host_threads import HostThreads
from disagg_mesh.server.common.engines.llama_cpp.model import (
    ENGINE_VERSION,
    LlamaModel,
    ModelLoadError,
    attended_from,
)
from disagg_mesh.server.common.engines.llama_cpp.prefix_cache import PrefixCache
from disagg_mesh.server.common.engines.llama_cpp.scheduler import (
    Admitted,
    Event,
    Job,
    JobKind,
    LoadedState,
    Outcome,
    Scheduler,
    SchedulerSettings,
)
from disagg_mesh.server.common.engines.prefix_keys import (
    PREFIX_BLOCK_TOKENS,
    block_hashes,
    leading_blocks,
    reusable_blocks,
)
from disagg_mesh.server.common.errors import InvalidArgument, MeshError
from disagg_mesh.server.common.structured.response_format import DEFAULT_LIMITS
from disagg_mesh.server.common.tools import formats
from disagg_mesh.server.common.tools.stream import with_tool_calls
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    Fingerprint,
    GenerationEnd,
    KvReference,
    KvTransferKind,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
)

# Prefix cache entries (each a sequence of the context): the most recently used prompts.
PREFIX_CACHE_SEQS = 16


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
    # Long prompts evaluated at once (the scheduler's admission, oldest first).
    prompts_at_once: int = 1
    kv_cache_max_bytes: int | None = None
    # None: every layer on the GPU when the build has one; 0: CPU only.
    n_gpu_layers: int | None = None
    type_k: str = "f16"
    type_v: str = "f16"
    # The engine nodes sharing this host's cores at run time (host_threads.py), this one
    # included; fewer than two: n_threads is fixed.
    host_peers: tuple[str, ...] = ()
    swa_full: bool = False
    # Prompt tokens the prefix cache may hold (0: no cache), on top of slots * n_ctx.
    prefix_cache_tokens: int = 0
    # Tests only: fewer KV cells than slots * n_ctx, to fill the cache on purpose.
    kv_cells: int | None = None
    # [mesh.schema_limits]: how big a response format's grammar may be.
    schema_limits: SchemaLimits = DEFAULT_LIMITS


def plan_slots(settings: EngineSettings, bytes_per_token: int) -> int:
    """How many slots the node runs: every slot holds n_ctx tokens of KV, so slots * n_ctx *
    bytes_per_token, and the prefix cache's tokens, must fit in kv_cache_max_bytes when that
    is set."""
    per_slot = settings.n_ctx * bytes_per_token
    if settings.kv_cache_max_bytes is None:
        return settings.slots or settings.default_slots
    limit = settings.kv_cache_max_bytes - settings.prefix_cache_tokens * bytes_per_token
    fits = max(limit, 0) // per_slot
    if settings.slots is None:
        if fits < 1:
            raise ModelLoadError(
                f"kv_cache_max_bytes = {settings.kv_cache_max_bytes} holds no slot: one slot "
                f"of n_ctx = {settings.n_ctx} tokens needs {per_slot} bytes of KV cache, "
                f"besides the prefix cache's {settings.prefix_cache_tokens} tokens"
            )
        return min(settings.default_slots, fits)
    if settings.slots > fits:
        raise ModelLoadError(
            f"slots = {settings.slots} of n_ctx = {settings.n_ctx} tokens need "
            f"{settings.slots * per_slot} bytes of KV cache, over kv_cache_max_bytes = "
            f"{settings.kv_cache_max_bytes} less the prefix cache's "
            f"{settings.prefix_cache_tokens} tokens (room for {fits} slots)"
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
        schema_limits: SchemaLimits = DEFAULT_LIMITS,
    ) -> None:
        self._model = model
        self._context = context
        self._scheduler = scheduler
        self.fingerprint = fingerprint
        self.placement = model.placement
        self.model_facts = model.facts
        self.n_ctx = context.n_ctx
        self._handoff: _Handoff | None = None
        self._grammars = Grammars(model.vocab, model.harmony, schema_limits)
        # Prefix cache keys start from the fingerprint: equal only for the same model file
        # and KV settings, on this node or another.
        self._salt = repr(fingerprint)

    @classmethod
    async def open(
        cls, name: str, model_path: Path, settings: EngineSettings, model_sha256: str
    ) -> LlamaCppEngine:
        """Load the model and its context; model_sha256 is the file's SHA-256 (known from
        Ollama's store or a cache: a large file is never hashed at every start)."""

        def build() -> tuple[LlamaModel, SlotContext, Fingerprint, int]:
            model = LlamaModel(model_path, settings.n_gpu_layers)
            bytes_per_token = model.kv_bytes_per_token(settings.type_k, settings.type_v)
            try:
                slots = plan_slots(settings, bytes_per_token)
                context = SlotContext(
                    model,
                    ContextSettings(
                        slots=slots,
                        n_ctx=settings.n_ctx,
                        n_batch=settings.n_batch,
                        n_ubatch=settings.n_ubatch,
                        n_threads=settings.n_threads,
                        flash_attn=settings.flash_attn,
                        type_k=settings.type_k,
                        type_v=settings.type_v,
                        swa_full=settings.swa_full,
                        op_offload=model.placement.gpu_layers > 0,
                        cpu_attention=model.placement.gpu_layers < model.placement.layers,
                        prefix_cache_tokens=settings.prefix_cache_tokens,
                        prefix_cache_seqs=PREFIX_CACHE_SEQS if settings.prefix_cache_tokens else 0,
                        kv_cells=settings.kv_cells,
                    ),
                )
            except BaseException:
                model.close()
                raise
            fingerprint = Fingerprint(
                model_sha256=model_sha256,
                n_ctx_tokens=settings.n_ctx,
                engine_version=ENGINE_VERSION,
                type_k=settings.type_k,
                type_v=settings.type_v,
                flash_attn=settings.flash_attn,
                kv_unified=True,
                swa_full=settings.swa_full,
            )
            return model, context, fingerprint, bytes_per_token

        model, context, fingerprint, bytes_per_token = await asyncio.to_thread(build)
        cache = None
        if settings.prefix_cache_tokens:
            cache = PrefixCache(
                context, context.cache_seqs, settings.prefix_cache_tokens, window=model.window
            )
        threads = None
        if len(settings.host_peers) > 1:
            threads = HostThreads(list(settings.host_peers), name, settings.n_threads)
        scheduler = Scheduler(
            name,
            model,
            context,
            SchedulerSettings(
                settings.max_queue, settings.max_itl_slowdown, settings.prompts_at_once
            ),
            kv_bytes_per_token=bytes_per_token,
            prefix_cache=cache,
            threads=threads,
        )
        scheduler.start()
        return cls(model, context, scheduler, fingerprint, settings.schema_limits)

    async def prefill(
        self,
        prompt: Prompt,
        sampling: Sampling,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillOutput:
        sampling = self._for_model(sampling)
        tokens, hashes = await asyncio.to_thread(self._tokenize, prompt, sampling)
        job = Job(JobKind.PREFILL, sampling, tokens=tokens, hashes=hashes)
        if continuation is not None:
            job.replay = self._replay_ids(continuation, len(tokens))
            job.piece_origin = _piece_origin(continuation, len(tokens))
        holder, blocks = _best_holder(hashes, len(tokens), candidates)
        if self._model.window:
            # The state holds every position the decode node's first token attends to: the
            # window layers of the decode node's copy of the prefix may have lost them.
            state_tokens = len(tokens) + max(len(job.replay) - 1, 0)
            reach = attended_from(state_tokens, self._model.window) // PREFIX_BLOCK_TOKENS
            blocks = min(blocks, reach)
            holder = holder if blocks else ""
        job.prefix_tokens = blocks * PREFIX_BLOCK_TOKENS
        clock = LimitClock(limits, "prefill", self._scheduler.name)
        async with aclosing(self._events(job, clock)) as events:
            output = await anext(events)
        assert isinstance(output, PrefillOutput)
        return dataclasses.replace(
            output,
            kv_prefix_node=holder,
            open_message=self._model.open_message(tokens),
            kv_sha256=await asyncio.to_thread(_sha256, output.kv_state),
        )

    def _tokenize(self, prompt: Prompt, sampling: Sampling) -> tuple[list[int], tuple[bytes, ...]]:
        tokens = self._model.tokenize(prompt, self.n_ctx, sampling.tools)
        return tokens, tuple(block_hashes(self._salt, tokens))

    def _for_model(self, sampling: Sampling) -> Sampling:
        """The sampling as this model runs it: the grammar its tool format holds the answer
        to, where it has one."""
        fmt = self._model.tool_format
        grammar = formats.response_format(fmt, sampling.tools)
        if grammar is None:
            return sampling
        # validate_sampling refused tools beside a response_format of the request's own.
        return dataclasses.replace(sampling, response_format=grammar)

    def _tool_calls(
        self, events: Generation, sampling: Sampling, replay: Sequence[int]
    ) -> Generation:
        """The events with the calls read out of the text (replay: tokens delivered before)."""
        parser = formats.parser(self._model.tool_format, sampling.tools)
        if parser is None:
            return events
        delivered = b"".join(self._model.piece(t) for t in replay).decode("utf-8", "replace")
        return with_tool_calls(events, parser, delivered)

    async def continue_from_state(
        self,
        kv_state: memoryview,
        reference: KvReference,
        sampling: Sampling,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> Generation:
        replay: list[int] = []
        if continuation is not None:
            replay = self._replay_ids(continuation, reference.prompt_tokens)
            if reference.first_token_id != replay[-1]:
                raise InvalidArgument(
                    "kv.first_token_id",
                    f"must be the continuation's last generated token {replay[-1]} (a prefill "
                    f"node's continuation), got {reference.first_token_id}",
                )
        if not 0 < reference.prompt_tokens < self.n_ctx:
            raise InvalidArgument(
                "kv.prompt_tokens", f"must be in 1..{self.n_ctx - 1}, got {reference.prompt_tokens}"
            )
        if not 0 <= reference.first_token_id < self._model.n_vocab:
            raise InvalidArgument(
                "kv.first_token_id",
                f"must be in 0..{self._model.n_vocab - 1}, got {reference.first_token_id}",
            )
        if len(reference.block_hashes) > reference.prompt_tokens // PREFIX_BLOCK_TOKENS:
            raise InvalidArgument(
                "kv.block_hashes",
                f"{len(reference.block_hashes)} hashes for {reference.prompt_tokens} prompt tokens "
                f"(one per whole block of {PREFIX_BLOCK_TOKENS})",
            )
        prefix = reference.kv_prefix_tokens
        if prefix and (
            prefix % PREFIX_BLOCK_TOKENS
            or not 0 < prefix < reference.prompt_tokens
            or prefix // PREFIX_BLOCK_TOKENS > len(reference.block_hashes)
        ):
            raise InvalidArgument(
                "kv.prefix_tokens",
                f"must be whole blocks of {PREFIX_BLOCK_TOKENS} covered by kv.block_hashes "
                f"and under kv.prompt_tokens, got {prefix}",
            )
        penalty_tokens = reference.penalty_token_ids
        if len(penalty_tokens) > reference.prompt_tokens or not all(
            0 <= t < self._model.n_vocab for t in penalty_tokens
        ):
            raise InvalidArgument(
                "kv.penalty_token_ids",
                f"must be at most kv.prompt_tokens ({reference.prompt_tokens}) token ids in "
                f"0..{self._model.n_vocab - 1}, got {len(penalty_tokens)}",
            )
        sampling = self._for_model(sampling)
        job = Job(
            JobKind.CONTINUE,
            sampling,
            loaded=LoadedState(
                kv_state,
                reference.prompt_tokens,
                reference.first_token_id,
                reference.open_message,
                penalty_tokens,
                reference.first_token_logprobs[:1],
            ),
            hashes=reference.block_hashes,
            prefix_tokens=prefix,
            replay=replay,
            first_token_from_prefill=continuation is None or continuation.first_token_from_prefill,
        )
        clock = LimitClock(limits, "generation", self._scheduler.name)
        generation = self._tool_calls(self._generation(job, clock), sampling, replay)
        async with aclosing(generation) as events:
            async for event in events:
                yield event

    async def generate(
        self,
        prompt: Prompt,
        sampling: Sampling,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> Generation:
        sampling = self._for_model(sampling)
        tokens, hashes = await asyncio.to_thread(self._tokenize, prompt, sampling)
        job = Job(JobKind.GENERATE, sampling, tokens=tokens, hashes=hashes)
        if continuation is not None:
            if not continuation.generated_token_ids and continuation.generated_text:
                # An Ollama node's: text only, tokenized here.
                ids = await asyncio.to_thread(
                    self._model.tokenize_text, continuation.generated_text
                )
                continuation = dataclasses.replace(continuation, generated_token_ids=tuple(ids))
            job.replay = self._replay_ids(continuation, len(tokens), required=False)
            job.first_token_from_prefill = continuation.first_token_from_prefill
            job.piece_origin = _piece_origin(continuation, len(tokens))
        clock = LimitClock(limits, "generation", self._scheduler.name)
        generation = self._tool_calls(self._generation(job, clock), sampling, job.replay)
        async with aclosing(generation) as events:
            async for event in events:
                yield event

    async def _generation(self, job: Job, clock: LimitClock | None = None) -> Generation:
        async with aclosing(self._events(job, clock)) as events:
            async for event in events:
                assert isinstance(event, TextChunk | GenerationEnd)
                yield event

    def _replay_ids(
        self, continuation: Continuation, prompt_tokens: int, required: bool = True
    ) -> list[int]:
        """A continuation's token ids, checked: in the vocabulary, with room for them and
        at least one more after the prompt (and at least one, where a state is involved:
        its last is the first token of the decode node)."""
        ids = list(continuation.generated_token_ids)
        field_name = "continuation.generated_token_ids"
        if required and not ids:
            raise InvalidArgument(
                field_name, "must be set: a continuation through a KV state needs token ids"
            )
        if any(not 0 <= t < self._model.n_vocab for t in ids):
            raise InvalidArgument(field_name, f"every id must be in 0..{self._model.n_vocab - 1}")
        if prompt_tokens + len(ids) >= self.n_ctx:
            raise InvalidArgument(
                field_name,
                f"the prompt's {prompt_tokens} tokens and {len(ids)} generated ones leave no "
                f"room in a context of {self.n_ctx}",
            )
        return ids

    async def _events(
        self, job: Job, clock: LimitClock | None = None
    ) -> AsyncGenerator[Outcome, None]:
        """Run the job on the step loop and hand its events over as they come. If the caller
        stops early (its RPC was cancelled), or the clock's bound passes (its wait for a slot,
        then its work: the clock's error), the job is cancelled and its slot freed (a prompt
        cut short keeps its evaluated blocks in the prefix cache).

        Text that piled up while the caller was busy goes out as one chunk: at GPU speed a
        node with many streams makes tokens faster than one message per token can leave."""
        if self._handoff is None:
            self._handoff = _Handoff(asyncio.get_running_loop())
        queue: asyncio.Queue[Event] = asyncio.Queue()
        handoff = self._handoff
        job.emit = lambda event: handoff.put(queue, event)
        job.grammar = await self._grammars.get(job.sampling.response_format)
        job.tell_admitted = clock is not None and clock.bounded
        self._scheduler.submit(job)
        finished = False
        held: Event | None = None
        # The wait's bound, then the work's, as an event in the queue (one timer a bound).
        alarm = clock.alarm(queue.put_nowait) if clock is not None and job.tell_admitted else None
        if alarm is not None:
            alarm.arm()
        try:
            while True:
                if held is not None:
                    event, held = held, None
                else:
                    event = await queue.get()
                if alarm is not None and alarm.stale(event):
                    continue
                if isinstance(event, Admitted):
                    assert clock is not None and alarm is not None
                    clock.admitted()
                    alarm.arm()
                    continue
                while isinstance(event, TextChunk) and not queue.empty():
                    after = queue.get_nowait()
                    if not isinstance(after, TextChunk):
                        held = after
                        break
                    event = event + after
                if alarm is not None and alarm.passed(event):
                    raise event  # the job still waits or runs: cancelled below
                if isinstance(event, MeshError):
                    finished = True
                    raise event
                finished = isinstance(event, GenerationEnd | PrefillOutput)
                yield event
                if finished:
                    return
        finally:
            if alarm is not None:
                alarm.cancel()
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


def _best_holder(
    hashes: Sequence[bytes], prompt_tokens: int, candidates: Sequence[DecodeCandidate]
) -> tuple[str, int]:
    """The candidate holding the most of the prompt's first blocks, and how many (the
    first in the given order on a tie; ("", 0) when none holds any). At least the prompt's
    last token is always left in the state."""
    usable = reusable_blocks(hashes, prompt_tokens)
    best, best_blocks = "", 0
    for candidate in candidates:
        blocks = leading_blocks(usable, candidate.block_hashes)
        if blocks > best_blocks:
            best, best_blocks = candidate.node, blocks
    return best, best_blocks


def _piece_origin(continuation: Continuation, prompt_tokens: int) -> int | None:
    origin = continuation.prompt_cached_tokens
    if origin is not None and not 0 <= origin < prompt_tokens:
        raise InvalidArgument(
            "continuation.prompt_cached_tokens",
            f"must be in 0..{prompt_tokens - 1} (the prompt has {prompt_tokens} tokens), "
            f"got {origin}",
        )
    return origin


def _sha256(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class _Handoff:
    """Events from the engine thread to the event loop's queues, with at most one wake-up
    of the loop pending however many events a step makes (one per token per stream would
    wake it 16 times a step with 16 streams, each wake-up a write to the loop's pipe)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Event], Event]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue[Event], event: Event) -> None:
        with self._lock:
            self._items.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for queue, event in items:
            queue.put_nowait(event)
