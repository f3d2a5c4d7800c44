"""The step loop: one thread owns the llama.cpp context and serves every slot at once.

Callers hand `Job`s to `Scheduler.submit` from any thread and get their results through
the job's `emit` callback (called on the engine thread; it must not block). Each step:

1. Jobs waiting in the queue take free slots (a decode node's KV state is loaded into its
   slot here); cancelled jobs give theirs back. A finished prefill's state goes first, then
   prompts, oldest first, and at most `prompts_at_once` long ones evaluating at a time (a
   prompt that fits a shared pass is not counted): the first requests of a burst answer
   first instead of every prompt finishing at the end, and a slot stays free for a state.
2. One pass (`llama_decode`) of one token for every slot that is generating; each row is
   sampled with its slot's own sampler chain at once. A generating slot turns its token
   into text and ends on an end token, a stop string, `max_tokens` or a full context,
   freeing its slot at once.
3. Prompt tokens of the slots still evaluating their prompt, each slot in a pass of its
   own (so that a prompt's numbers never depend on another's). With no stream generating,
   each gets its next `n_batch` tokens; while streams generate, they share only what keeps
   the step within `max_itl_slowdown` times a step without them (step_plan.py), so a long
   prompt arriving slows the streams down instead of stalling them for its whole length. A
   finished prompt samples its first token; a prefill then exports its slot's KV state and
   frees the slot.

Why separate passes: llama.cpp's CPU attention computes each row on its own in passes of
fewer than 64 rows (as a decode pass of up to 63 streams is; a lone row is given company,
see context.py), but in larger passes with a
tiled kernel whose rounding depends on every row in the pass. Mixing a prompt's rows with
other sequences' rows would make its text depend on what else runs.

A freed slot's cells are parked (see context.py) and freed all together once no slot is
in use, or when they outgrow the cells in use (`max(in use, n_ctx)`), or when the cache is
full: until then no running sequence gets cells ahead of its earlier ones, so its numbers
are those it would have alone.

A failure is confined to the job it belongs to: a refused KV state, a cancelled caller or a
full KV cache ends that job only (the newest job first when the cache is full), and the
loop goes on serving the others.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from disagg_mesh.server.common.engines.base import (
    BusyTime,
    EngineLoad,
    PrefillOutput,
    TokenRates,
)
from disagg_mesh.server.common.engines.llama_cpp.context import Row, SlotContext
from disagg_mesh.server.common.engines.llama_cpp.grammars import Grammar
from disagg_mesh.server.common.engines.llama_cpp.host_threads import HostThreads, yield_to_io
from disagg_mesh.server.common.engines.llama_cpp.model import LlamaModel, attended_from
from disagg_mesh.server.common.engines.llama_cpp.prefix_cache import Entry, PrefixCache
from disagg_mesh.server.common.engines.llama_cpp.sampling import (
    SlotSampler,
    row_logits,
    token_logprob,
)
from disagg_mesh.server.common.engines.llama_cpp.step_plan import SlotPhase, StepPlan, plan_step
from disagg_mesh.server.common.engines.llama_cpp.text import GeneratedToken, TextStream
from disagg_mesh.server.common.engines.prefix_keys import common_prefix, reusable_blocks
from disagg_mesh.server.common.errors import (
    Aborted,
    FailedPrecondition,
    MeshError,
    ResourceExhausted,
    Unavailable,
)
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.structured.offload import start_on_large_stack
from disagg_mesh.server.common.tools import formats
from disagg_mesh.server.common.types import (
    FinishReason,
    GenerationEnd,
    Sampling,
    TextChunk,
    TokenLogprob,
)

log = structlog.get_logger("engine")
# Leading prompt blocks (64 tokens each) a queued prompt must share with one being evaluated
# to wait for them instead of evaluating them beside it.
SHARED_BLOCKS = 2


class EngineError(MeshError):
    """llama.cpp failed a step for a reason other than a full KV cache."""


class JobKind(enum.Enum):
    PREFILL = "prefill"  # evaluate the prompt, sample the first token, export the state
    GENERATE = "generate"  # evaluate the prompt, then generate
    CONTINUE = "continue"  # load a prefill node's state, then generate from its first token


class Admitted:
    """The job took a slot: its work begins (sent only to jobs that ask, Job.tell_admitted,
    before any other event of theirs)."""


ADMITTED = Admitted()
# What a job's caller is handed: its results, or the one error.
Outcome = TextChunk | GenerationEnd | PrefillOutput | MeshError
Event = Outcome | Admitted


def _no_listener(event: Event) -> None:
    raise RuntimeError("a job was submitted without a listener")


@dataclass(eq=False)
class LoadedState:
    """What a CONTINUE job loads: a prefill node's KV state (let go once in its slot), the
    prompt positions it holds, the first token (sampled by the prefill node, not yet
    evaluated), and the prompt's open harmony message (a gpt-oss prompt's last header),
    which the text stream follows to tell reasoning from answer."""

    state: memoryview | None
    prompt_tokens: int
    first_token: int
    open_message: tuple[int, ...] = ()
    # With repetition penalties: the prompt's last tokens, which they count.
    penalty_tokens: tuple[int, ...] = ()
    # With Sampling.logprobs: the first token's (one entry, from the prefill node).
    first_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(eq=False)
class Job:
    kind: JobKind
    sampling: Sampling
    # The response format's grammar, parsed before the job is submitted (grammars.py).
    grammar: Grammar | None = None
    # Receives the job's events on the engine thread: text chunks then a GenerationEnd, or
    # one PrefillOutput, or one MeshError. Must be thread-safe and must not block.
    emit: Callable[[Event], None] = _no_listener
    # PREFILL and GENERATE: the prompt's tokens.
    tokens: list[int] = field(default_factory=list)
    # CONTINUE, and only CONTINUE: the state it loads.
    loaded: LoadedState | None = None
    # The tokens of an interrupted generation, which the caller has; never sent again.
    # GENERATE evaluates them one step at a time after the prompt (as they were made), its
    # sampler drawing as the interrupted one did, so a seeded sampler's random generator is
    # where it was. PREFILL evaluates all but the last the same way and exports that state,
    # the last as its first token, sampling nothing. CONTINUE loads such a state (positions
    # up to the last but one) and takes them in as its own without evaluating them again,
    # its sampler skipping the draws that made them (SlotSampler.skip).
    replay: list[int] = field(default_factory=list)
    # The first token was sampled by a prefill node (a disaggregated generation): this
    # sampler did not draw it, and has seed offset 1.
    first_token_from_prefill: bool = False
    # PREFILL and GENERATE continuing a generation: where the original evaluation's n_batch
    # pieces of the prompt started (its cached prompt tokens; None: not known). When the
    # prefix cache holds at least that much, it is used only up to a point of that grid, so
    # the pieces cut from there (as after any cache hit) are the original's: the same KV.
    # When it holds less, the positions before the origin were evaluated by an earlier
    # request in pieces nobody knows: the prompt is cut as a new one.
    piece_origin: int | None = None
    # The prompt's block hashes (prefix_keys.block_hashes), the prefix cache's keys.
    hashes: tuple[bytes, ...] = ()
    # PREFILL: positions before this are left out of the exported state (a decode node
    # holds them). CONTINUE: the state starts here; the prefix cache has the positions before.
    prefix_tokens: int = 0
    cancelled: bool = False
    # Hand the caller ADMITTED when the job takes a slot (its own bounds count from there:
    # engines/limits.py).
    tell_admitted: bool = False

    def __post_init__(self) -> None:
        if (self.kind is JobKind.CONTINUE) != (self.loaded is not None):
            raise ValueError(f"a {self.kind.value} job has a loaded state only if it continues")

    @property
    def seed_offset(self) -> int:
        return 1 if self.first_token_from_prefill else 0

    @property
    def history(self) -> Sequence[int]:
        """The prompt's tokens its repetition penalties count: all it has, or those a loaded
        state's prefill node sent."""
        return self.loaded.penalty_tokens if self.loaded is not None else self.tokens

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens: those given, or those a loaded state holds."""
        return self.loaded.prompt_tokens if self.loaded is not None else len(self.tokens)

    @property
    def state_tokens(self) -> int:
        """CONTINUE: the positions its state holds (the prompt, and the replayed tokens but
        the last, which this job evaluates first)."""
        return self.prompt_tokens + max(len(self.replay) - 1, 0)


@dataclass(eq=False)
class Slot:
    index: int
    job: Job
    sampler: SlotSampler
    order: int
    admitted_at: float
    # What the slot does in the next step (step_plan.py); moved on as it goes.
    phase: SlotPhase = SlotPhase.PROMPT
    text: TextStream | None = None
    # Prompt tokens evaluated so far (PREFILL and GENERATE).
    evaluated: int = 0
    # Generating: the last token, sampled and sent, which the next step evaluates.
    next_token: int | None = None
    # Positions held in the KV cache.
    n_past: int = 0
    first_at: float = 0.0
    kv_load_seconds: float = 0.0
    # Seconds per token of this slot's last prompt pass.
    prompt_token_s: float | None = None
    # Tokens of job.replay taken so far.
    replayed: int = 0
    # Prompt tokens taken from the prefix cache (the prompt's pieces start there), and those
    # the cache keeps of this prompt.
    cached: int = 0
    kept: int = 0
    # Sliding-window models: the lowest position from which the window layers hold every
    # position of this slot (prefix_cache.Entry.window_from).
    window_from: int = 0
    # Text made but not sent yet (under the stream interval), and whether any was sent.
    held: TextChunk | None = None
    sent: bool = False
    # With Sampling.logprobs: those of the tokens taken but not yet in a chunk, in order
    # (None: a replayed token's, whose chunk is never sent, or one not of the answer:
    # harmony's control tokens, headers, reasoning).
    logprobs: deque[TokenLogprob | None] = field(default_factory=deque)

    @property
    def prompt_tokens_total(self) -> int:
        return len(self.job.tokens)

    def generate(self, token: int) -> None:
        """The next step evaluates this token (sampled, or taken) and streams what follows."""
        self.next_token = token
        self.phase = SlotPhase.GENERATE

    def replay(self, token: int) -> None:
        """The next step evaluates this replayed token, streaming nothing (a prefill)."""
        self.next_token = token
        self.phase = SlotPhase.REPLAY


@dataclass(frozen=True)
class SchedulerSettings:
    max_queue: int
    # While streams generate, a step with prompt tokens may take this many times a step
    # without them.
    max_itl_slowdown: float = 2.0
    # Prompts evaluating at once, beyond those short enough to share a pass (each prompt's
    # pieces take a pass of their own, so more at once finish no sooner in all: they only
    # finish later each).
    prompts_at_once: int = 1


class Scheduler:
    def __init__(
        self,
        name: str,
        model: LlamaModel,
        context: SlotContext,
        settings: SchedulerSettings,
        kv_bytes_per_token: int = 0,
        prefix_cache: PrefixCache | None = None,
        threads: HostThreads | None = None,
    ) -> None:
        """threads: this host's core budget, shared with the other engine nodes on it (None:
        the context's n_threads, fixed)."""
        self.name = name
        self._threads = threads
        self._model = model
        self._ctx = context
        context.before_pass = self._deliver
        self._settings = settings
        self._kv_bytes_per_token = kv_bytes_per_token
        self._cache = prefix_cache
        # Cells holding tokens (running slots and parked ones), for load(); written by the
        # engine thread only.
        self._cells_used = 0
        self._cv = threading.Condition()
        self._pending: deque[Job] = deque()
        self._slots: list[Slot | None] = [None] * context.slots
        self._busy = 0
        self._busy_time = BusyTime()
        self._stopping = False
        self._order = itertools.count()
        self._rates = TokenRates()
        # Seconds of a decode pass lately (a running average).
        self._decode_pass_s: float | None = None
        # Events made since the last delivery (the engine thread's only).
        self._outbox: list[tuple[Job, Event]] = []
        self.problem: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    # -- the callers' side (any thread) -----------------------------------------------------

    def start(self) -> None:
        start_on_large_stack(self._thread)

    def submit(self, job: Job) -> None:
        """Queue a job; RESOURCE_EXHAUSTED at once when every slot is busy and `max_queue`
        jobs already wait."""
        with self._cv:
            if self._stopping or self.problem:
                why = self.problem or "it is stopping"
                raise Unavailable(f"engine {self.name} is not running: {why}")
            waiting = len(self._pending) + self._busy - self._ctx.slots
            if waiting >= self._settings.max_queue:
                raise ResourceExhausted(
                    f"node {self.name} busy: all {self._ctx.slots} slots in use and "
                    f"{waiting} requests already waiting for one; retry later"
                )
            self._pending.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The caller is gone: drop the job if it waits, free its slot at the next step."""
        with self._cv:
            job.cancelled = True
            if job in self._pending:
                self._pending.remove(job)
            self._cv.notify()

    def load(self) -> EngineLoad:
        prompt_tps, decode_tps = self._rates.per_second()
        with self._cv:
            busy, pending = self._busy, len(self._pending)
        busy_s, slot_busy_s = self._busy_time.totals()
        return EngineLoad(
            slots=self._ctx.slots,
            slots_busy=busy,
            queue_depth=max(0, pending + busy - self._ctx.slots),
            max_queue=self._settings.max_queue,
            prompt_tokens_per_second=prompt_tps,
            decode_tokens_per_second=decode_tps,
            kv_cache_bytes=self._ctx.settings.cells * self._kv_bytes_per_token,
            kv_cache_used_bytes=self._cells_used * self._kv_bytes_per_token,
            prefix_cache_tokens=self._cache.tokens if self._cache else 0,
            prefix_cache_max_tokens=self._cache.budget_tokens if self._cache else 0,
            prefix_cache_stored_tokens=self._cache.stored_tokens if self._cache else 0,
            busy_seconds=busy_s,
            slot_busy_seconds=slot_busy_s,
        )

    def stop(self) -> None:
        """End the loop (jobs still running end with UNAVAILABLE) and wait for it."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join()

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        yield_to_io()
        try:
            while True:
                with self._cv:
                    if self._threads is not None and not self._pending and not self._busy:
                        self._threads.set_busy(False)  # idle: the other nodes' cores
                    while not self._stopping and not self._pending and not self._busy:
                        self._cv.wait()
                    if self._stopping:
                        break
                self._admit()
                self._reap_cancelled()
                if any(self._slots):
                    self._step()
                idle = not any(self._slots)
                if idle and self._ctx.parked_cells:
                    self._ctx.free_parked()
                self._cells_used = self._ctx.parked_cells + sum(
                    s.n_past for s in self._slots if s is not None
                )
                if idle:
                    self._deliver()  # no pass follows soon (see _deliver)
        except BaseException as exc:  # a bug in the loop itself: say so, fail every job
            self.problem = f"the engine loop failed: {type(exc).__name__}: {exc}"
            log.exception("engine loop failed", node=self.name)
        finally:
            if self._threads is not None:
                self._threads.close()
            reason = self.problem or f"engine {self.name} stopped"
            for slot in [s for s in self._slots if s is not None]:
                self._fail(slot, Unavailable(reason))
            with self._cv:
                pending, self._pending = list(self._pending), deque()
            for job in pending:
                self._emit(job, Unavailable(reason))
            self._deliver()

    def _admit(self) -> bool:
        """Queued jobs take free slots and start; whether any did."""
        with self._cv:
            admitted = self._take_pending()
        if any(slot.job.kind is JobKind.CONTINUE for slot in admitted):
            self._deliver()  # a state's load takes milliseconds
        for slot in admitted:
            self._start(slot)
        return bool(admitted)

    def _take_pending(self) -> list[Slot]:
        """Move queued jobs into free slots (under the lock): a finished prefill's state first
        (its decode is never starved by new prompts), then prompts, oldest first, while fewer
        than `prompts_at_once` long prompts evaluate. A prompt whose leading blocks a running
        slot is evaluating now stays queued until they are in the prefix cache, then
        evaluates only the rest (SGLang's in-batch prefix caching: a burst sharing a rubric
        evaluates it once); later jobs go ahead of it meanwhile."""
        if self._busy >= self._ctx.slots:  # no slot free: nothing to look at this step
            return []
        admitted: list[Slot] = []
        free = (i for i, s in enumerate(self._slots) if s is None)
        held: list[Job] = []
        prompting = sum(
            1
            for s in self._slots
            if s is not None and s.phase is SlotPhase.PROMPT and self._long(s)
        )
        queued = sorted(self._pending, key=lambda j: j.kind is not JobKind.CONTINUE)
        self._pending.clear()
        for job in queued:
            if job.cancelled:
                continue
            if self._busy >= self._ctx.slots or self._shares_running_prompt(job):
                held.append(job)
                continue
            long_prompt = job.kind is not JobKind.CONTINUE and self._uncached(job) >= self._short
            if long_prompt and prompting >= self._settings.prompts_at_once:
                held.append(job)
                continue
            try:
                sampler = SlotSampler(
                    job.sampling,
                    job.seed_offset,
                    self._model.end_tokens,
                    self._model.n_vocab,
                    job.grammar,
                    self._ctx.n_ctx,
                    job.history,
                )
            except MeshError as exc:
                self._emit(job, exc)
                continue
            prompting += long_prompt
            index = next(free)
            slot = Slot(
                index=index,
                job=job,
                sampler=sampler,
                order=next(self._order),
                admitted_at=time.perf_counter(),
                phase=SlotPhase.LOAD if job.kind is JobKind.CONTINUE else SlotPhase.PROMPT,
            )
            self._slots[index] = slot
            self._busy += 1
            self._busy_time.set(self._busy)
            admitted.append(slot)
            if job.tell_admitted:
                self._emit(job, ADMITTED)
        self._pending.extend(held)
        return admitted

    @property
    def _short(self) -> int:
        """Prompt tokens few enough to share a pass with others' (context.alike_rows)."""
        return self._ctx.alike_rows

    def _uncached(self, job: Job) -> int:
        """The prompt tokens a job would evaluate: those its prefix cache does not hold."""
        if self._cache is None:
            return len(job.tokens)
        return len(job.tokens) - self._cache.lookup(job.hashes, len(job.tokens))[1]

    def _long(self, slot: Slot) -> bool:
        """Whether the slot's prompt counts against prompts_at_once: until it is done, if
        what it evaluates is too long to share a pass (so the next one starts once it is
        done: on a prefill node, on a cache as empty as it would find it alone)."""
        return slot.prompt_tokens_total - slot.cached >= self._short

    def _shares_running_prompt(self, job: Job) -> bool:
        """Whether a slot evaluating its prompt now holds more of this job's leading blocks
        (at least SHARED_BLOCKS) than the prefix cache does: waiting for them beats
        evaluating them twice."""
        cache = self._cache
        if cache is None or job.kind is JobKind.CONTINUE or not job.hashes:
            return False
        usable = reusable_blocks(job.hashes, len(job.tokens), cache.block_tokens)
        shared = max(
            (
                common_prefix(s.job.hashes, usable)
                for s in self._slots
                if s is not None and s.phase is SlotPhase.PROMPT
            ),
            default=0,
        )
        if shared < SHARED_BLOCKS:
            return False
        _, cached = cache.lookup(job.hashes, len(job.tokens))
        return shared * cache.block_tokens > cached

    def _start(self, slot: Slot) -> None:
        job = slot.job  # its sequence is empty: a freed slot's cells were parked
        if job.kind is JobKind.GENERATE:
            slot.text = self._text_stream(job, job.tokens)
        if job.kind is not JobKind.CONTINUE:
            cache = self._cache
            entry, n = (None, 0) if cache is None else cache.lookup(job.hashes, len(job.tokens))
            origin = job.piece_origin
            if origin is not None and n >= origin:  # back to the original's grid
                n = origin + (n - origin) // self._ctx.n_batch * self._ctx.n_batch
            self._store_unshared(job, entry if n else None)
            if cache is not None and entry is not None and n:
                slot.window_from = cache.window_from(entry)
                if self._cache_use(entry, slot, n):
                    slot.evaluated = slot.n_past = n
            return
        loaded = job.loaded
        assert loaded is not None and loaded.state is not None
        state, loaded.state = loaded.state, None  # the slot holds it now; let the buffer go
        prefix = None
        if job.prefix_tokens:
            prefix = self._cache.find(job.hashes, job.prefix_tokens) if self._cache else None
        self._store_unshared(job, prefix)
        if job.prefix_tokens:
            if prefix is not None and self._cache is not None and not self._cache.restore(prefix):
                prefix = None
            if prefix is None:
                self._fail(
                    slot,
                    Aborted(
                        f"decode node {self.name} no longer holds the prompt's first "
                        f"{job.prefix_tokens} tokens (its prefix cache let them go): the "
                        "whole KV state is needed"
                    ),
                )
                return
        read = self._ctx.import_state(slot.index, state)
        if read != len(state):
            self._fail(
                slot,
                FailedPrecondition(
                    f"llama.cpp refused the KV state ({read} of {len(state)} bytes read)"
                ),
            )
            return
        # The lowest position held in every layer: a sliding-window model's state holds the
        # window layers' last positions only, which is enough when they reach back as far
        # as the next token attends.
        first = self._ctx.pos_min(slot.index)
        held = self._ctx.pos_max(slot.index) + 1
        window = self._model.window
        reach = max(job.prefix_tokens, attended_from(held, window))
        if held != job.state_tokens or not job.prefix_tokens <= first <= reach:
            replayed = f" and {len(job.replay) - 1} generated tokens" if job.replay else ""
            windowed = (
                f" (its {window}-position sliding window must reach back to {reach})"
                if window
                else ""
            )
            self._fail(
                slot,
                FailedPrecondition(
                    f"the KV state holds positions {first}..{held - 1}{windowed}, but "
                    f"kv.prompt_tokens is {job.prompt_tokens}{replayed} and kv.prefix_tokens "
                    f"{job.prefix_tokens}"
                ),
            )
            return
        slot.window_from = first
        if prefix is not None:
            # The positions before kv.prefix_tokens come from this node's cache, whatever
            # the state held there (a window model's check above sees its window layers only).
            self._ctx.forget_prefix(slot.index, job.prefix_tokens)
            self._cache_use(prefix, slot, job.prefix_tokens)
        if self._cache is not None:
            slot.kept = self._cache.keep(slot.index, job.hashes, slot.window_from)
        slot.n_past = held
        slot.first_at = time.perf_counter()
        slot.kv_load_seconds = slot.first_at - slot.admitted_at
        slot.text = self._text_stream(job, loaded.open_message)
        if not job.replay:
            self._take(slot, loaded.first_token, logprob=next(iter(loaded.first_logprobs), None))
            return
        # A generation a prefill node replayed: its tokens are this stream's own, unsent.
        slot.sampler.skip(len(job.replay) - job.seed_offset)
        slot.replayed = len(job.replay)
        for token in job.replay:
            self._take(slot, token, send=False)
            # It ended there: max_tokens, a stop string, or a token its grammar forbids.
            if self._slots[slot.index] is not slot:
                return

    def _text_stream(self, job: Job, prompt: Sequence[int]) -> TextStream:
        tools = formats.active(job.sampling.tools) is not None
        parser = self._model.harmony_parser(prompt, tools)
        return TextStream(job.sampling.max_tokens, job.sampling.stop, parser)

    def _reap_cancelled(self) -> None:
        """Free the slots of jobs whose callers went away (cancelled, or past their
        deadline). A prompt cut short leaves the whole blocks it evaluated in the prefix
        cache, so a retry, or the next prompt starting the same way, starts from them."""
        for slot in self._slots:
            if slot is not None and slot.job.cancelled:
                if self._cache is not None and slot.phase is SlotPhase.PROMPT:
                    done = slot.evaluated // self._cache.block_tokens
                    if done * self._cache.block_tokens > slot.cached:
                        self._cache.keep(slot.index, slot.job.hashes[:done], slot.window_from)
                self._free(slot)

    def _plan(self) -> StepPlan[Slot]:
        active = [s for s in self._slots if s is not None]
        if self._ctx.parked_cells > max(sum(s.n_past for s in active), self._ctx.n_ctx):
            self._ctx.free_parked()
        return plan_step(
            active, self._ctx.n_batch, self._decode_pass_s, self._settings.max_itl_slowdown
        )

    def _step(self) -> None:
        plan = self._plan()
        if self._threads is None:
            self._run_step(plan)
            return
        # The host's cores, shared with the other engine nodes on it (host_threads.py). A
        # step of generated tokens may wait for another node's prompts, when their requests
        # outnumber its streams, as long as prompt work of its own may lengthen a step:
        # (max_itl_slowdown - 1) x its decode pass, times those requests over its streams. A
        # prompt's requests
        # are those evaluated now and those queued behind them (prompts_at_once): all wait
        # for this prompt work before their first token.
        prompts = len(plan.prompts)
        if prompts:
            with self._cv:
                prompts += sum(1 for j in self._pending if j.kind is not JobKind.CONTINUE)
        self._threads.set_prompts(prompts)
        self._deliver()  # the wait for cores may be long
        waited = time.perf_counter()
        max_wait_s = (self._settings.max_itl_slowdown - 1) * (self._decode_pass_s or 0.0)
        self._ctx.set_threads(self._threads.acquire(max_wait_s, len(plan.decode)))
        metrics.engine_core_wait(time.perf_counter() - waited)
        try:
            # Jobs that came while the step waited for cores join it (a burst of requests
            # then shares one prompt pass, instead of a pass for the first one alone).
            if self._admit():
                self._reap_cancelled()
                plan = self._plan()
            self._run_step(plan)
        finally:
            self._threads.release()

    def _run_step(self, plan: StepPlan[Slot]) -> None:
        started = time.perf_counter()
        decoded = self._decode_pass(plan.decode) if plan.decode else []
        if decoded:
            took = time.perf_counter() - started
            last = self._decode_pass_s
            self._decode_pass_s = took if last is None else (last + took) / 2
        # Sample every generated row before the next pass replaces the logits.
        for i, slot in enumerate(decoded):
            slot.n_past += 1
            if slot.phase is SlotPhase.REPLAY:
                self._replay_for_prefill(slot)
                continue
            if slot.replayed < len(slot.job.replay):
                slot.sampler.skip(1)  # keeps a seeded sampler's generator in step
                self._accept_replayed(slot)
            else:
                self._accept(slot, self._sample(slot, i))
        prompt_tokens = sum(self._prompt_pass(group) for group in self._prompt_groups(plan.prompts))
        if not decoded and not prompt_tokens:
            self._deliver()  # no pass ran, so none handed them over
        elapsed = time.perf_counter() - started
        self._rates.add(prompt_tokens, len(decoded))
        metrics.engine_step(elapsed, prompt_tokens, len(decoded))

    def _decode_pass(self, generating: list[Slot]) -> list[Slot]:
        """One pass of one token per generating slot; the slots whose token was evaluated.
        With no free KV cells: free the parked ones, then end the newest stream."""
        while generating:
            code = self._ctx.decode([Row(_next(s), s.n_past, s.index, True) for s in generating])
            if code == 0:
                return generating
            if code == 1 and self._make_room():
                continue
            if code == 1:
                newest = max(generating, key=lambda s: s.order)
                self._fail(newest, ResourceExhausted(self._full_message(newest)))
                generating = [s for s in generating if s is not newest]
                continue
            error = EngineError(f"llama_decode failed with code {code}")
            for slot in generating:
                self._fail(slot, error)
            return []
        return []

    def _prompt_groups(self, prompts: list[tuple[Slot, int]]) -> list[list[tuple[Slot, int]]]:
        """The step's prompt pieces, oldest first, packed into passes: several share one
        while it stays under the context's `alike_rows` (each prompt's numbers are then those
        of a pass of its own: llama.cpp's CPU attention computes every row of such a pass on
        its own, and the matrix products every row alike), else one a pass."""
        groups: list[list[tuple[Slot, int]]] = []
        rows = 0
        for slot, end in prompts:
            n = end - slot.evaluated
            if groups and rows + n < self._ctx.alike_rows:
                groups[-1].append((slot, end))
                rows += n
            else:
                groups.append([(slot, end)])
                rows = n
        return groups

    def _prompt_pass(self, group: list[tuple[Slot, int]]) -> int:
        """Evaluate each slot's prompt up to its `end`, in one pass. The first token is
        sampled when a prompt is done. Returns the tokens evaluated."""
        rows = [
            Row(slot.job.tokens[p], p, slot.index, p == len(slot.job.tokens) - 1)
            for slot, end in group
            for p in range(slot.evaluated, end)
        ]
        started = time.perf_counter()
        code = self._ctx.decode(rows)
        while code == 1 and self._make_room():
            code = self._ctx.decode(rows)
        if code == 1 and len(group) > 1:  # no room for them together: each on its own
            return sum(self._prompt_pass([piece]) for piece in group)
        if code != 0:
            # No room even so (the streams hold every cell), or llama.cpp failed: this
            # prompt, the newest work on the node, ends; the streams go on.
            for slot, _ in group:
                self._fail(
                    slot,
                    ResourceExhausted(self._full_message(slot))
                    if code == 1
                    else EngineError(f"llama_decode failed with code {code}"),
                )
            return 0
        token_s = (time.perf_counter() - started) / len(rows)
        row = 0
        for slot, end in group:
            row += end - slot.evaluated
            slot.prompt_token_s = token_s
            slot.evaluated = slot.n_past = end
            if end == len(slot.job.tokens):
                self._prompt_done(slot, row - 1)
        return len(rows)

    def _prompt_done(self, slot: Slot, row: int) -> None:
        """The slot's prompt is evaluated, its last token at batch row `row`: its prefix
        kept, then its replay, its state exported (a prefill) or its first token."""
        slot.first_at = time.perf_counter()
        if self._cache is not None:
            slot.kept = self._cache.keep(slot.index, slot.job.hashes, slot.window_from)
        if slot.job.kind is JobKind.PREFILL and slot.job.replay:
            self._replay_for_prefill(slot)
            return
        if slot.job.replay:
            if not slot.job.first_token_from_prefill:
                slot.sampler.skip(1)  # the draw that made the first token
            self._accept_replayed(slot)
            return
        token = self._sample(slot, row)
        if slot.job.kind is JobKind.PREFILL:
            self._finish_prefill(slot, token)
        else:
            self._accept(slot, token)

    def _sample(self, slot: Slot, row: int) -> int:
        """The slot's next token, from batch row `row`; with Sampling.logprobs, its log
        probability (and the most likely tokens') kept for its chunk."""
        top = slot.job.sampling.logprobs
        if top is None:
            return slot.sampler.sample(self._ctx.ptr, row)
        logits = row_logits(self._ctx.ptr, row, self._model.n_vocab)
        token = slot.sampler.sample(self._ctx.ptr, row)
        slot.logprobs.append(token_logprob(logits, token, top, self._model.piece))
        return token

    def _accept(self, slot: Slot, token: int, send: bool = True) -> None:
        """A generated token: send its text (unless `send` is false: a replayed token, whose
        text the caller has); end the stream or keep it for the next step."""
        assert slot.text is not None
        is_end = self._model.is_end(token)
        piece = b"" if is_end else self._model.piece(token)
        events = slot.text.push(GeneratedToken(token, piece, is_end))
        if slot.logprobs and not slot.text.answered:  # its own, last: not the answer's
            slot.logprobs[-1] = None
        if not slot.text.done and slot.n_past >= self._ctx.n_ctx:
            events += slot.text.end(FinishReason.LENGTH)  # no room to evaluate it
        for event in events:
            if isinstance(event, GenerationEnd):
                self._finish_generation(slot, event)
                return
            if slot.job.sampling.logprobs is not None:  # its tokens' (a sent chunk's: known)
                taken = [
                    slot.logprobs.popleft() if slot.logprobs else None for _ in event.token_ids
                ]
                answered = taken[: len(taken) - event.stop_tokens]  # not the stop string's
                event.logprobs = [lp for lp in answered if lp is not None]
            if send:
                self._send(slot, event)
        slot.generate(token)

    def _send(self, slot: Slot, chunk: TextChunk) -> None:
        """Text to the caller, or held until the slot's text adds up to its stream interval
        in tokens; the first text goes at once (the time to first token is the same)."""
        if slot.held is not None:
            chunk = slot.held + chunk
        if slot.sent and len(chunk.token_ids) < slot.job.sampling.stream_interval_tokens:
            slot.held = chunk
            return
        slot.held, slot.sent = None, True
        self._emit(slot.job, chunk)

    def _flush(self, slot: Slot) -> None:
        """Send the held text (the stream ends or fails: nothing made is kept back)."""
        if slot.held is not None:
            self._emit(slot.job, slot.held)
            slot.held = None

    def _accept_replayed(self, slot: Slot) -> None:
        """The next token of an interrupted generation: through the slot's text stream, so
        that its UTF-8, stop-string and token-count state is where it was, but its text is
        not sent again (the caller has it). The next step evaluates it."""
        slot.replayed += 1
        self._take(slot, slot.job.replay[slot.replayed - 1], send=False)

    def _take(
        self, slot: Slot, token: int, send: bool = True, logprob: TokenLogprob | None = None
    ) -> None:
        """A token this slot's sampler did not draw (a prefill node's, with its log
        probability there; a replayed one): into its grammar, then as _accept; the slot
        fails when its grammar forbids the token."""
        try:
            slot.sampler.take(token)
        except MeshError as exc:
            self._fail(slot, exc)
            return
        if slot.job.sampling.logprobs is not None:
            slot.logprobs.append(logprob)
        self._accept(slot, token, send)

    def _replay_for_prefill(self, slot: Slot) -> None:
        """A prefill continuing an interrupted generation, its prompt evaluated: its next
        replayed token for the next step, or, once every one but the last is evaluated, the
        state, with the last as the first token the decode node evaluates."""
        replay = slot.job.replay
        if slot.replayed == len(replay) - 1:
            self._finish_prefill(slot, replay[-1])
            return
        slot.replay(replay[slot.replayed])
        slot.replayed += 1

    def _finish_generation(self, slot: Slot, end: GenerationEnd) -> None:
        now = time.perf_counter()
        self._flush(slot)
        loaded = slot.job.kind is JobKind.CONTINUE
        self._emit(
            slot.job,
            dataclasses.replace(
                end,
                prompt_tokens=slot.job.prompt_tokens,
                cached_prompt_tokens=slot.cached,
                kept_prefix_tokens=slot.kept,
                kv_load_seconds=slot.kv_load_seconds,
                prompt_eval_seconds=0.0 if loaded else slot.first_at - slot.admitted_at,
                decode_seconds=now - slot.first_at,
            ),
        )
        self._free(slot)

    def _finish_prefill(self, slot: Slot, first_token: int) -> None:
        evaluated = time.perf_counter() if slot.job.replay else slot.first_at
        whole = self._ctx.state_size(slot.index)
        if slot.job.prefix_tokens:  # the decode node holds these: leave them out
            self._ctx.forget_prefix(slot.index, slot.job.prefix_tokens)
        state = self._ctx.export_state(slot.index)
        self._emit(
            slot.job,
            PrefillOutput(
                kv_state=state,
                kv_sha256="",  # hashed off this thread by the engine
                first_token_id=first_token,
                first_token_text="",
                prompt_tokens=len(slot.job.tokens),
                prefill_seconds=evaluated - slot.admitted_at,
                replayed_tokens=slot.replayed,
                replay_seconds=evaluated - slot.first_at,
                cached_prompt_tokens=slot.cached,
                block_hashes=slot.job.hashes,
                kv_prefix_tokens=slot.job.prefix_tokens,
                kv_state_bytes=whole,
                penalty_token_ids=_penalized_tail(slot.job, self._ctx.n_ctx),
                first_token_logprobs=_first_logprobs(slot),
            ),
        )
        self._free(slot)

    def _fail(self, slot: Slot, error: MeshError) -> None:
        self._flush(slot)
        self._emit(slot.job, error)
        self._free(slot)

    def _free(self, slot: Slot) -> None:
        if self._cache is not None:
            self._cache.release(slot.index)
        self._ctx.park(slot.index)
        slot.sampler.close()
        with self._cv:
            self._slots[slot.index] = None
            self._busy -= 1
            self._busy_time.set(self._busy)

    def _cache_use(self, entry: Entry, slot: Slot, tokens: int) -> bool:
        """The entry's first tokens into the slot; False when it was kept outside the
        context and could not be loaded back (the slot then evaluates them)."""
        assert self._cache is not None
        if not self._cache.use(entry, slot.index, tokens):
            return False
        slot.cached = tokens
        metrics.engine_cached(tokens)
        return True

    def _store_unshared(self, job: Job, keep: Entry | None) -> None:
        """Before a slot places new cells for this job: the prefix cache's entries no slot
        shares (but `keep`, which it is about to use, and those mostly like this job's
        prompt or a running one's) leave the context for its bytes, so that the new work's
        passes do not attend over their cells (prefix_cache.py)."""
        if self._cache is None:
            return
        live = [s.job.hashes for s in self._slots if s is not None and s.job.hashes]
        entries = self._cache.unshared(keep, [job.hashes, *live])
        if entries:
            self._deliver()  # exporting takes milliseconds
            self._cache.store(entries)

    def _make_room(self) -> bool:
        """Free KV cells for a step that found none: the parked cells, else a prefix cache
        entry's (PrefixCache.free_cells). False when there is nothing left to free."""
        if self._ctx.parked_cells:
            self._ctx.free_parked()
            return True
        return self._cache is not None and self._cache.free_cells()

    def _emit(self, job: Job, event: Event) -> None:
        """An event for the job's caller, handed over at the next `_deliver`."""
        self._outbox.append((job, event))

    def _deliver(self) -> None:
        """Hand over the events made since the last delivery, one right after another, just
        before this thread leaves the interpreter's lock for long: a llama.cpp pass (the
        context's `before_pass`), a state's load, a wait for cores or for work. Handing one
        over wakes the event loop, whose thread takes the lock whenever this one lets go of
        it, and this one then waits for it back (services/node.py). Handed over as each row
        was sampled, the loop took the lock turn about with this thread for the rest of the
        step's rows (a 16-row step's Python ~5 ms instead of ~1 ms, 2 cores; one decode node
        at 16 streams on an H200 2,500 -> 3,100 tokens/s); handed over once the rows were
        sampled, it still took the lock during the step's bookkeeping and the next pass's
        (docs/batching.md). Now the loop sends them while the next pass runs."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        for job, event in outbox:
            _hand_over(job, event)

    def _full_message(self, slot: Slot) -> str:
        return (
            f"KV cache full on node {self.name}: this stream was the newest of "
            f"{self._busy} and was ended after {slot.n_past} positions; retry later"
        )


def _penalized_tail(job: Job, n_ctx: int) -> tuple[int, ...]:
    """The prompt's tokens a decode node's repetition penalties count (none without)."""
    window = job.sampling.penalty_window(n_ctx)
    return tuple(job.tokens[-window:]) if window else ()


def _first_logprobs(slot: Slot) -> tuple[TokenLogprob, ...]:
    """A prefill's first token's log probability (sampled last), with Sampling.logprobs."""
    last = slot.logprobs[-1] if slot.logprobs and not slot.job.replay else None
    return (last,) if last is not None else ()


def _next(slot: Slot) -> int:
    assert slot.next_token is not None
    return slot.next_token


def _hand_over(job: Job, event: Event) -> None:
    try:
        job.emit(event)
    except RuntimeError:  # the caller's event loop is gone
        job.cancelled = True
