"""The simulated engine (`engine = "sim"`): a node with no weights that takes as long as a
hardware profile says its machine would (profile.py), and hands over KV states of the real
size. It serves the same RPCs as a real node, so the real router, its chain, migrations and
the clients run over it unchanged.

- **Tokens.** A prompt is one token per 4 bytes of its text (or the profile's
  `bytes_per_token`; chat turns as `role: content` lines, tools and calls written as the
  generic format writes them); the answer is picked from the prompt's hash (answers.py), so
  the same request gets the same answer on any node: free text of words that ends by
  itself after 64-511 tokens or at max_tokens; with a response format or tools, a JSON
  value its schema allows (tools as the generic format, their calls read out as the
  embedded engine reads them); cut at the first stop string.
- **Time.** One compute a machine (shared by the sim nodes of one host in one process):
  prompts' evaluation and the decode steps take turns. Prompts go in groups of at most
  `prompts_at_once`, oldest first, their uncached tokens in passes of at most `ubatch`
  tokens shared among them (`prompts_seconds` of the profile: the depth they reach and the
  pass's size set the rate); streams decode together in
  steps of `decode_step_seconds(streams, mean depth)`, continuous batching: a stream joins
  at the next step and leaves when it ends. `speedup` divides every wait; steps shorter
  than MIN_TICK_S of real time are taken several at once (one message a stream for them
  all), so a high speedup does not flood the mesh.
- **Prefix cache** (prefix.py): node-wide blocks as the embedded engine keeps them, or each
  slot's last prompt as Ollama keeps them (the baseline of `disagg simulate`).
- **KV.** A prefill's state holds `kv_bytes(prompt tokens)` bytes (sliding-window layers
  counted as the profile says): a header (the prompt's hash, the real size, the host the
  node stands for) and zeros, with its SHA-256, so the mesh moves, checks and stores the
  real amount; `compact_kv` sends the header alone (a simulation at a speedup, where real
  bytes over loopback would count speedup times). A state from another host costs the
  profile's link time for its real size before its first step.
- **Delta transfer**, as the embedded engine does it: a decode node keeps a handed-over
  prompt's blocks and says so (`kept_prefix_tokens`); when the router's decode candidates
  hold a prompt's first blocks, the prefill node leaves them out of the state (at least
  the last token stays in, and with a sliding window every position the first new token
  attends to), so only `kv_bytes(the rest)` moves; a decode node that let them go answers
  ABORTED and gets the whole state.
- **Slots.** `slots` sequences at once, `max_queue` waiting; more is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.engines.base import (
    BusyTime,
    EngineLoad,
    Generation,
    Placement,
    PrefillOutput,
    TokenRates,
)
from disagg_mesh.server.common.engines.limits import LimitClock
from disagg_mesh.server.common.engines.prefix_keys import leading_blocks
from disagg_mesh.server.common.engines.sim.answers import Answer, answer
from disagg_mesh.server.common.engines.sim.prefix import (
    BLOCK_HASH_BYTES,
    BLOCK_TOKENS,
    BYTES_PER_TOKEN,
    BlockCache,
    Blocks,
    SlotCache,
    prompt_blocks,
)
from disagg_mesh.server.common.engines.sim.profile import (
    HardwareProfile,
    ModelSpeed,
    load_model_facts,
    model_layers,
)
from disagg_mesh.server.common.errors import (
    Aborted,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
)
from disagg_mesh.server.common.tools import formats
from disagg_mesh.server.common.tools.requests import ToolRequest
from disagg_mesh.server.common.tools.stream import with_tool_calls
from disagg_mesh.server.common.types import (
    REASONING_EFFORTS,
    Continuation,
    DecodeCandidate,
    Fingerprint,
    GenerationEnd,
    KvReference,
    KvTransferKind,
    ModelFacts,
    Prompt,
    Sampling,
    StageLimits,
    TextChunk,
    ollama_template,
)
from disagg_mesh.server.common.validation import prompt_too_long

SIM_VERSION = "disagg-sim/2"
# Real seconds: decode steps shorter than this are taken together.
MIN_TICK_S = 0.02
# A state's header (_Header): seed, real size, host, reasoning effort, block count; then
# the blocks.
HEADER_BYTES = 8 + 8 + 64 + 1 + 4
# The header's reasoning effort: none (the model does not think), then REASONING_EFFORTS.
_EFFORTS: tuple[str | None, ...] = (None, *REASONING_EFFORTS)

PrefixCacheKind = Literal["blocks", "per-slot", "off"]
# Each host's compute, for the sim nodes of one host served by one event loop (`disagg
# simulate` runs a host's nodes in one process; the baseline all its machines in one
# loop): their prompts and steps take turns, as a real machine's nodes share its cores.
# Per loop: a lock belongs to the loop it first waited in, and the baseline runs a loop
# of its own each time.
_COMPUTE: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _host_compute(host: str) -> asyncio.Lock:
    """This host's compute in the running loop (its own, for a node standing for no host)."""
    if not host:
        return asyncio.Lock()
    locks = _COMPUTE.setdefault(asyncio.get_running_loop(), {})
    if host not in locks:
        locks[host] = asyncio.Lock()
    return locks[host]


def _prompt_bytes(prompt: Prompt, tools: ToolRequest | None = None) -> bytes:
    """A prompt's text: raw, or its chat turns as `role: content` lines, rendered as the
    generic tool format renders them for a template (the tools in the system turn, calls
    and results as JSON); a fill-in-the-middle prompt's text and suffix, framed."""
    if prompt.suffix:
        return _fim_frame(prompt.text, prompt.suffix).encode()
    if prompt.text:
        return prompt.text.encode()
    turns = formats.turns(prompt.messages, formats.ToolFormat.GENERIC, tools)
    return "".join(_turn_line(t["role"], t["content"]) for t in turns).encode()


def _fim_frame(prefix: str, suffix: str) -> str:
    return f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"


def _turn_line(role: str, content: str) -> str:
    return f"{role}: {content}\n"


def _facts(model: str) -> ModelFacts:
    """What this node says of its model (models.toml), with how it frames an Ollama
    /api/generate prompt (the door's system and user turns, or a suffix) in Ollama's
    template syntax, written with the pieces _prompt_bytes renders it with."""
    facts = load_model_facts(model)
    if facts == ModelFacts():
        return facts
    user = _turn_line("user", "{{ .Prompt }}")
    branches = [(".System", _turn_line("system", "{{ .System }}") + user), ("", user)]
    if facts.inserts:
        branches.insert(0, (".Suffix", _fim_frame("{{ .Prompt }}", "{{ .Suffix }}")))
    return dataclasses.replace(facts, template=ollama_template(branches))


def prompt_tokens(
    prompt: Prompt, bytes_per_token: float = BYTES_PER_TOKEN, tools: ToolRequest | None = None
) -> int:
    """Tokens a prompt counts as: one per bytes_per_token bytes of its text (the profile's
    figure for its model; 4 by default)."""
    return _tokens(_prompt_bytes(prompt, tools), bytes_per_token)


def _tokens(text: bytes, bytes_per_token: float) -> int:
    return max(1, math.ceil(len(text) / bytes_per_token))


def _seed(text: bytes) -> int:
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


@dataclass
class _Stream:
    depth: int
    left: int  # steps until it ends
    started: bool = False  # has had a step (its first token comes from one step alone)
    steps: asyncio.Queue[int] = field(default_factory=asyncio.Queue)


@dataclass(eq=False)
class _PromptJob:
    """A prompt's new tokens waiting for the machine's compute, then evaluated with the
    others of its group (at most `prompts_at_once`, sharing each pass)."""

    tokens: int
    cached: int
    started: asyncio.Future[None]
    done: asyncio.Future[float]  # its seconds of evaluation (simulated)
    abandoned: bool = False  # its caller stopped waiting (a deadline, a cancel)


@dataclass(frozen=True)
class _Header:
    """What a simulated state carries before its zeros: the prompt's seed, the state's real
    size, the host it was made on, the reasoning effort its answer thinks at (None: the
    model does not think), and the prompt's blocks (the decode node keeps them in its
    prefix cache, as the embedded engine keeps a handed-over prompt)."""

    seed: int
    real_bytes: int
    host: str
    effort: str | None = None
    blocks: Blocks = ()

    def encode(self) -> bytes:
        host = self.host.encode()[:64]
        return b"".join(
            (
                self.seed.to_bytes(8, "big"),
                self.real_bytes.to_bytes(8, "big"),
                host + bytes(64 - len(host)),
                _EFFORTS.index(self.effort).to_bytes(1, "big"),
                len(self.blocks).to_bytes(4, "big"),
                *self.blocks,
            )
        )

    @classmethod
    def decode(cls, state: memoryview) -> _Header:
        raw = bytes(state[:HEADER_BYTES])
        count = int.from_bytes(raw[81:85], "big")
        blocks = bytes(state[HEADER_BYTES : HEADER_BYTES + count * BLOCK_HASH_BYTES])
        return cls(
            int.from_bytes(raw[:8], "big"),
            int.from_bytes(raw[8:16], "big"),
            raw[16:80].rstrip(b"\0").decode(errors="replace"),
            _EFFORTS[raw[80]],
            tuple(
                blocks[i : i + BLOCK_HASH_BYTES] for i in range(0, len(blocks), BLOCK_HASH_BYTES)
            ),
        )


@dataclass(frozen=True)
class SimSettings:
    slots: int
    max_queue: int
    speedup: float = 1.0
    prefix_cache: PrefixCacheKind = "blocks"
    prefix_cache_tokens: int = 0
    # The machine this node stands for (states from another one pay the link).
    host: str = ""
    compact_kv: bool = False
    # A response format's schema is read within these (as the router and node checked it).
    schema_limits: SchemaLimits = field(default_factory=SchemaLimits)
    # Prompts evaluated together, oldest first (the node's prompts_at_once), in passes of
    # at most this many tokens (its n_ubatch; 0: a pass takes them all).
    prompts_at_once: int = 1
    ubatch_tokens: int = 0


class SimEngine:
    """One simulated model on one simulated machine (made inside the event loop that runs
    it)."""

    def __init__(
        self, model: str, profile: HardwareProfile, n_ctx: int, settings: SimSettings
    ) -> None:
        self._speed: ModelSpeed = profile.model(model)
        self._link = profile.link
        self._n_ctx = n_ctx
        self._settings = settings
        self._speedup = settings.speedup
        # The same for every machine: a state made on one loads on any other of the model.
        model_hash = hashlib.sha256(f"{SIM_VERSION} {model}".encode()).hexdigest()
        self.fingerprint = Fingerprint(
            model_sha256=model_hash, n_ctx_tokens=n_ctx, engine_version=SIM_VERSION
        )
        layers = model_layers(model)
        self.placement = Placement(
            backend=f"sim ({profile.name})", gpu_layers=layers if profile.gpu else 0, layers=layers
        )
        self.model_facts = _facts(model)
        self.kv_transfer = KvTransferKind.STATE
        self.loaded_in_memory = True
        self._free = list(range(settings.slots))
        self._busy_time = BusyTime()
        self._waiting: deque[asyncio.Future[int]] = deque()
        # One compute per machine: the sim nodes of one host in this loop share it.
        self._compute = _host_compute(settings.host)
        self._streams: list[_Stream] = []
        self._stepper: asyncio.Task[None] | None = None
        self._prompts: deque[_PromptJob] = deque()
        self._prompter: asyncio.Task[None] | None = None
        self._group: list[_PromptJob] = []  # the prompts on the compute now
        # Set when none of the group's callers waits any more: its evaluation stops there.
        self._group_dropped = asyncio.Event()
        self._rates = TokenRates()
        self._blocks = BlockCache(
            settings.prefix_cache_tokens if settings.prefix_cache == "blocks" else 0
        )
        self._slot_prompts = SlotCache(settings.slots)
        # Simulated seconds the machine computed prompts and decode steps (where the time
        # went).
        self.prompt_seconds = 0.0
        self.decode_seconds = 0.0

    # -- the engine interface ------------------------------------------------------------

    async def prefill(
        self,
        prompt: Prompt,
        sampling: Sampling,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillOutput:
        sampling = self._with_tools(sampling)
        text, n = self._checked(prompt, sampling, continuation)
        # A continuation's tokens but the last (the decode node's first) go into the state.
        replayed = max(len(continuation.generated_token_ids) - 1, 0) if continuation else 0
        blocks = prompt_blocks(text, self._speed.bytes_per_token)
        seed, effort = _seed(text), self._effort(prompt)
        reply = self._answer(seed, sampling, effort)
        clock = LimitClock(limits, "prefill")
        async with self._slot(blocks, clock) as slot:
            cached = self._cached(slot, blocks, n)
            seconds = await self._evaluate(n + replayed - cached, cached, clock)
            self._keep(slot, blocks)
        first_id, first_text = reply.token_ids[0], reply.text(1)
        if continuation is not None and continuation.generated_token_ids:
            first_id, first_text = continuation.generated_token_ids[-1], ""
        holder, prefix = self._best_holder(blocks, n + replayed, candidates)
        state = self._state(seed, effort, n + replayed - prefix, blocks)
        return PrefillOutput(
            first_token_id=first_id,
            first_token_text=first_text,
            prompt_tokens=n,
            prefill_seconds=seconds,
            cached_prompt_tokens=cached,
            block_hashes=blocks,
            kv_prefix_tokens=prefix,
            kv_prefix_node=holder,
            kv_state_bytes=self._state_bytes(n + replayed, blocks),
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
        limits: StageLimits | None = None,
    ) -> Generation:
        header = _Header.decode(kv_state)
        sampling = self._with_tools(sampling)
        reply = self._answer(header.seed, sampling, header.effort)
        done = len(continuation.generated_token_ids) if continuation is not None else 0
        clock = LimitClock(limits, "generation")
        events = self._continued(header, reference, reply, done, clock)
        async with aclosing(self._tool_calls(events, sampling, reply.text(done))) as stream:
            async for event in stream:
                yield event

    async def _continued(
        self, header: _Header, reference: KvReference, reply: Answer, done: int, clock: LimitClock
    ) -> Generation:
        depth = reference.prompt_tokens + max(done - 1, 0)
        prefix = reference.kv_prefix_tokens
        async with self._slot(header.blocks, clock):
            clock.admitted()
            held = self._blocks.cached_tokens(header.blocks[: prefix // BLOCK_TOKENS])
            if held < prefix:
                raise Aborted(
                    f"this decode node no longer holds the prompt's first {prefix} tokens (its "
                    "prefix cache let them go): the whole KV state is needed"
                )
            if header.host != self._settings.host:  # over the link between the machines
                await asyncio.sleep(self._link.seconds(header.real_bytes) / self._speedup)
            self._blocks.keep(header.blocks)
            kept = min(self._blocks.cached_tokens(header.blocks), reference.prompt_tokens - 1)
            if not done:  # the prefill node's first token goes out first
                for chunk in reply.chunks(0, 1):
                    yield chunk
                done = 1
            async for event in self._decode(reply, depth + 1, done, 0.0, prefix, kept, clock):
                yield event

    async def generate(
        self,
        prompt: Prompt,
        sampling: Sampling,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> Generation:
        sampling = self._with_tools(sampling)
        text, n = self._checked(prompt, sampling, continuation)
        done = len(continuation.generated_token_ids) if continuation is not None else 0
        if continuation is not None and not done:
            done = continuation.generated_tokens
        reply = self._answer(_seed(text), sampling, self._effort(prompt))
        events = self._generated(text, n, reply, done, LimitClock(limits, "generation"))
        async with aclosing(self._tool_calls(events, sampling, reply.text(done))) as stream:
            async for event in stream:
                yield event

    async def _generated(
        self, text: bytes, n: int, reply: Answer, done: int, clock: LimitClock
    ) -> Generation:
        blocks = prompt_blocks(text, self._speed.bytes_per_token)
        async with self._slot(blocks, clock) as slot:
            cached = self._cached(slot, blocks, n)
            seconds = await self._evaluate(n + done - cached, cached, clock)
            self._keep(slot, blocks)
            async for event in self._decode(reply, n + done, done, seconds, cached, 0, clock):
                yield event

    async def problem(self) -> str | None:
        return None

    def load(self) -> EngineLoad:
        prompt_tps, decode_tps = self._rates.per_second()
        busy_s, slot_busy_s = self._busy_time.totals()
        return EngineLoad(
            slots=self._settings.slots,
            slots_busy=self._slots_busy,
            queue_depth=len(self._waiting),
            max_queue=self._settings.max_queue,
            prompt_tokens_per_second=prompt_tps,
            decode_tokens_per_second=decode_tps,
            prefix_cache_tokens=self._blocks.tokens,
            prefix_cache_max_tokens=self._settings.prefix_cache_tokens
            if self._settings.prefix_cache == "blocks"
            else 0,
            busy_seconds=busy_s,
            slot_busy_seconds=slot_busy_s,
        )

    async def close(self) -> None:
        for task in (self._stepper, self._prompter):
            if task is not None:
                task.cancel()

    # -- answers -------------------------------------------------------------------------

    def _with_tools(self, sampling: Sampling) -> Sampling:
        """Tools as the generic format holds the answer to them (a call, or a reply).
        InvalidArgument for log probabilities: a sim node computes no model."""
        if sampling.logprobs is not None:
            raise InvalidArgument(
                "sampling.logprobs",
                "a sim node computes no model, so no log probabilities; route the model to "
                "embedded llama.cpp nodes",
            )
        fmt = formats.response_format(formats.ToolFormat.GENERIC, sampling.tools)
        # validate_sampling refused tools beside a response_format of the request's own.
        return sampling if fmt is None else dataclasses.replace(sampling, response_format=fmt)

    def _answer(self, seed: int, sampling: Sampling, effort: str | None) -> Answer:
        limits = self._settings.schema_limits
        return answer(seed, sampling, self._speed.bytes_per_token, limits, effort)

    def _effort(self, prompt: Prompt) -> str | None:
        """The effort this model reasons at for the prompt (None: it does not think)."""
        return (prompt.reasoning_effort or "medium") if self.model_facts.reasons else None

    async def _tool_calls(
        self, events: Generation, sampling: Sampling, delivered: str
    ) -> Generation:
        """The events with the calls read out of the text where tools were offered
        (delivered: the text sent before); `events` closed with it."""
        parser = formats.parser(formats.ToolFormat.GENERIC, sampling.tools)
        async with aclosing(events):
            if parser is not None:
                events = with_tool_calls(events, parser, delivered)
            async for event in events:
                yield event

    # -- time ----------------------------------------------------------------------------

    def _checked(
        self, prompt: Prompt, sampling: Sampling, continuation: Continuation | None
    ) -> tuple[bytes, int]:
        """The prompt's text and tokens, its oldest turns left out where it asks for that
        and does not fit (as a llama.cpp node's)."""
        done = len(continuation.generated_token_ids) if continuation is not None else 0
        per_token = self._speed.bytes_per_token
        # Fitted as the original request was, whatever a continuation adds after it, so a
        # migrated generation goes on from the same prompt.
        text, _ = prompt.fitted(
            lambda p: _prompt_bytes(p, sampling.tools),
            lambda t: _tokens(t, per_token) < self._n_ctx,
        )
        n = _tokens(text, per_token)
        if 0 < prompt.truncate_prompt_tokens < n:  # its last tokens' bytes
            text = text[-math.ceil(prompt.truncate_prompt_tokens * per_token) :]
            n = _tokens(text, per_token)
        if n + done >= self._n_ctx:
            raise prompt_too_long(n + done, self._n_ctx, f"simulated: {per_token:g} bytes a token")
        return text, n

    def _cached(self, slot: int, blocks: Blocks, n: int) -> int:
        """Prompt tokens the cache holds (at least the last one is evaluated)."""
        if self._settings.prefix_cache == "blocks":
            cached = self._blocks.cached_tokens(blocks)
        elif self._settings.prefix_cache == "per-slot":
            cached = self._slot_prompts.cached_tokens(slot, blocks)
        else:
            cached = 0
        return min(cached, n - 1)

    def _best_holder(
        self, blocks: Blocks, state_tokens: int, candidates: Sequence[DecodeCandidate]
    ) -> tuple[str, int]:
        """The decode candidate holding the most of the prompt's first blocks, and the
        tokens it holds ("", 0: none), as the embedded engine picks it: the state's last
        token always moves, and with a sliding window so does every position the first new
        token attends to."""
        usable = (state_tokens - 1) // BLOCK_TOKENS
        window = self._speed.window_tokens
        if window:
            usable = min(usable, max(0, state_tokens - window + 1) // BLOCK_TOKENS)
        best, most = "", 0
        for candidate in candidates:
            held = leading_blocks(blocks[:usable], set(candidate.block_hashes))
            if held > most:
                best, most = candidate.node, held
        return best, most * BLOCK_TOKENS

    def _keep(self, slot: int, blocks: Blocks) -> None:
        self._blocks.keep(blocks)
        self._slot_prompts.keep(slot, blocks)

    async def _evaluate(self, tokens: int, cached: int, clock: LimitClock | None = None) -> float:
        """Evaluate a prompt's new tokens on the machine's compute: the seconds it took. The
        clock's work begins with its group's turn (the wait for it, behind other prompts and
        steps, is the request's wait for its turn, as on an embedded node)."""
        clock = clock or LimitClock(None, "prompt")
        loop = asyncio.get_running_loop()
        job = _PromptJob(tokens, cached, loop.create_future(), loop.create_future())
        self._prompts.append(job)
        if self._prompter is None or self._prompter.done():
            self._prompter = asyncio.create_task(self._prompt_loop())
        try:
            async with clock.bound():
                await asyncio.shield(job.started)
            clock.admitted()
            async with clock.bound():
                seconds = await asyncio.shield(job.done)
        except BaseException:
            self._abandon(job)
            raise
        self._rates.add(tokens, 0)
        return seconds

    def _abandon(self, job: _PromptJob) -> None:
        """Its caller stopped waiting: out of the queue, or, once its group runs, the group
        stops when none of its callers waits any more."""
        job.abandoned = True
        if job in self._prompts:
            self._prompts.remove(job)
        elif job in self._group and all(j.abandoned or j.done.done() for j in self._group):
            self._group_dropped.set()

    async def _prompt_loop(self) -> None:
        """Prompts in groups of at most prompts_at_once, oldest first, each group on the
        compute for as long as the profile gives for them together (prompts_seconds); a
        prompt's result comes when its last pass ends."""
        loop = asyncio.get_running_loop()
        try:
            while self._prompts:
                async with self._compute:
                    group = self._group = []
                    while self._prompts and len(group) < self._settings.prompts_at_once:
                        group.append(self._prompts.popleft())
                    if not group:
                        break
                    self._group_dropped.clear()
                    for job in group:
                        job.started.set_result(None)
                    ends = self._speed.prompts_seconds(
                        [(job.tokens, job.cached) for job in group],
                        self._settings.ubatch_tokens or None,
                    )
                    began, elapsed = loop.time(), 0.0
                    for end, job in sorted(zip(ends, group, strict=True), key=lambda p: p[0]):
                        try:
                            async with asyncio.timeout((end - elapsed) / self._speedup):
                                await self._group_dropped.wait()
                        except TimeoutError:
                            elapsed = end
                            job.done.set_result(end)
                        else:  # none of the group's callers waits: the rest is not computed
                            elapsed = (loop.time() - began) * self._speedup
                            break
                    self.prompt_seconds += elapsed
                    self._group = []
        finally:
            for job in [*self._group, *self._prompts]:
                for future in (job.started, job.done):
                    if not future.done() and not job.abandoned:
                        future.set_exception(Aborted("the simulated node is closing"))
            self._group = []

    async def _decode(
        self,
        reply: Answer,
        depth: int,
        done: int,
        prompt_seconds: float,
        cached: int = 0,
        kept: int = 0,
        clock: LimitClock | None = None,
    ) -> AsyncGenerator[TextChunk | GenerationEnd, None]:
        """Tokens from position `done` on, in the shared steps, to the answer's end (within
        the clock's work bound)."""
        clock = clock or LimitClock(None, "generation")
        last = len(reply)
        loop = asyncio.get_running_loop()
        started = loop.time()
        if done < last:
            stream = _Stream(depth, last - done)
            self._streams.append(stream)
            if self._stepper is None or self._stepper.done():
                self._stepper = asyncio.create_task(self._step_loop())
            try:
                while done < last:
                    async with clock.bound():
                        step = await stream.steps.get()
                    steps = min(step, last - done)
                    for chunk in reply.chunks(done, done + steps):
                        yield chunk
                    done += steps
            finally:
                if stream in self._streams:
                    self._streams.remove(stream)
        yield GenerationEnd(
            completion_tokens=done,
            finish_reason=reply.finish,
            prompt_tokens=depth,
            cached_prompt_tokens=cached,
            kept_prefix_tokens=kept,
            prompt_eval_seconds=prompt_seconds,
            decode_seconds=(loop.time() - started) * self._speedup,
        )

    async def _step_loop(self) -> None:
        """Decode steps while streams run, each as long as the profile says; steps shorter
        than MIN_TICK_S (real) go together, up to the first stream's end (a stream's first
        step alone, so its first token comes on time)."""
        while self._streams:
            async with self._compute:
                streams = list(self._streams)
                if not streams:
                    break
                depth = sum(s.depth for s in streams) / len(streams)
                # Up to the first stream's end; one step when a stream waits for its first.
                most = 1 if not all(s.started for s in streams) else min(s.left for s in streams)
                seconds, steps = 0.0, 0
                while steps < most and (steps == 0 or seconds / self._speedup < MIN_TICK_S):
                    seconds += self._speed.decode_step_seconds(len(streams), depth + steps)
                    steps += 1
                await asyncio.sleep(seconds / self._speedup)
                self.decode_seconds += seconds
            for stream in streams:
                stream.depth += steps
                stream.left -= steps
                stream.started = True
                stream.steps.put_nowait(steps)
                if stream.left <= 0 and stream in self._streams:
                    self._streams.remove(stream)
            self._rates.add(0, steps * len(streams))

    # -- slots and states ----------------------------------------------------------------

    @asynccontextmanager
    async def _slot(
        self, blocks: Blocks, clock: LimitClock | None = None
    ) -> AsyncGenerator[int, None]:
        """A slot, in turn (within the clock's wait bound)."""
        if self._free:
            slot = self._slot_prompts.best(self._free, blocks)
            self._free.remove(slot)
            self._busy_time.set(self._slots_busy)
        else:
            if len(self._waiting) >= self._settings.max_queue:
                raise ResourceExhausted(
                    f"all {self._settings.slots} simulated slots busy and "
                    f"{len(self._waiting)} requests waiting"
                )
            turn: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            try:
                async with clock.bound() if clock is not None else nullcontext():
                    slot = await turn
            except (asyncio.CancelledError, MeshError):
                if turn in self._waiting:
                    self._waiting.remove(turn)
                elif not turn.cancelled():
                    self._release(turn.result())  # the slot was ours already: pass it on
                raise
        try:
            yield slot
        finally:
            self._release(slot)

    @property
    def _slots_busy(self) -> int:
        return self._settings.slots - len(self._free)

    def _release(self, slot: int) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(slot)  # the slot goes to the next caller as it is
                return
        self._free.append(slot)
        self._busy_time.set(self._slots_busy)

    def _state(self, seed: int, effort: str | None, tokens: int, blocks: Blocks) -> bytes:
        """A KV state of `tokens` positions at the real size (or its header alone,
        compact_kv)."""
        real = self._speed.kv_bytes(tokens)
        header = _Header(seed, real, self._settings.host, effort, blocks).encode()
        return header + bytes(self._state_bytes(tokens, blocks) - len(header))

    def _state_bytes(self, tokens: int, blocks: Blocks) -> int:
        """The length of _state(., tokens, blocks)."""
        header = HEADER_BYTES + len(blocks) * BLOCK_HASH_BYTES
        return header if self._settings.compact_kv else max(self._speed.kv_bytes(tokens), header)
