"""The router's logic: walk a logical model's fallback chain, run prefill then decode (or a
whole generation), relay the text, and add up the metrics. Plain Python; the servicer does
the protobuf.

A failure before any text reached the caller moves on to the next attempt (logged, and listed
in the summary). A failure after text was sent is never retried: that would send duplicated
text. The stream ends with the error, whose message says how much was delivered.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.engines.ollama_engine import OllamaEngine
from services.common.engines.prefix_keys import PREFIX_BLOCK_TOKENS
from services.common.errors import (
    DeadlineExceeded,
    MeshError,
    NotFound,
    Unavailable,
    UpstreamError,
)
from services.common.node_clients import ChannelPool, DecodeClient, PrefillClient
from services.common.observability import metrics
from services.common.retries import call_with_retries, is_retryable
from services.common.topology import ModelRoute, Node, Step, Topology
from services.common.types import (
    Continuation,
    DecodeCandidate,
    DecodeStats,
    FinishReason,
    GenerationEnd,
    KvSource,
    KvTransferKind,
    PrefillResult,
    Prompt,
    Sampling,
    TextChunk,
)
from services.common.validation import validate_prompt, validate_sampling
from services.router.costs import Candidate, Costs, Observation
from services.router.node_health import NodeHealth
from services.router.prefixes import TEXT_BLOCK_CHARS, PrefixTable, prompt_bytes, text_blocks

log = structlog.get_logger("router")

# Errors that say the request itself is wrong, or that the caller gave up: another node
# would answer the same, so the chain stops there.
FINAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
# Errors that say a node itself is in trouble: it is skipped for a cool-down.
NODE_TROUBLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
    }
)
DIRECT_OLLAMA_MAX_IN_FLIGHT = 64
# A decode stage that fails this way after text was delivered moves to another decode node:
# the node is gone, hung past its stage deadline, broke its stream or ran out of KV cells.
MIGRATABLE_CODES = NODE_TROUBLE_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED}


class RouteMethod(enum.Enum):
    DISAGGREGATED = "disaggregated"
    DECODE_ONLY = "decode_only"
    DIRECT_OLLAMA = "direct_ollama"


@dataclass(frozen=True)
class ResumeInfo:
    """What a client needs to resume a generation through another router if this one fails
    mid-stream (its Continuation's fields that only the router knows). Router.generate
    yields it once, before the first chunk, when asked to."""

    first_token_from_prefill: bool
    prompt_cached_tokens: int | None


@dataclass
class FailedAttempt:
    method: RouteMethod
    node: str
    code: str
    message: str
    seconds: float


@dataclass
class Migration:
    """A decode node failed after text was delivered and another node took over."""

    failed_node: str
    code: str
    tokens_delivered: int
    resumed_on: str = ""
    resume_seconds: float = 0.0
    # The prefill node that evaluated the prompt and the delivered tokens for resumed_on
    # ("": resumed_on did), and why.
    via_prefill_node: str = ""
    reason: str = ""


@dataclass
class RouteSummary:
    """Metrics of one request; durations in seconds."""

    prompt_tokens: int = 0
    # Prompt tokens a node took from its prefix cache (the prefill node's, or the decode
    # node's for decode_only), and those whose KV the decode node held (disaggregated).
    cached_prompt_tokens: int = 0
    decode_cached_prompt_tokens: int = 0
    # The prompt's whole KV state (kv_transfer_bytes is less when only a delta moved).
    kv_state_bytes: int = 0
    # Why the first step tried was chosen (the chain's order, or mode auto's estimate).
    route_reason: str = ""
    completion_tokens: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    method: RouteMethod = RouteMethod.DISAGGREGATED
    kv_transfer: KvTransferKind = KvTransferKind.NONE
    prefill_seconds: float = 0.0
    prefill_tokens_per_second: float = 0.0
    kv_transfer_seconds: float = 0.0
    kv_transfer_bytes: int = 0
    kv_load_seconds: float = 0.0
    decode_prompt_eval_seconds: float = 0.0
    time_to_first_token_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    total_seconds: float = 0.0
    prefill_node: str = ""
    prefill_address: str = ""
    decode_node: str = ""
    decode_address: str = ""
    failed_attempts: list[FailedAttempt] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)


@dataclass
class _Delivered:
    """What the caller has received so far: a migration resumes from exactly there."""

    deltas: int = 0
    # Tokens: their ids where the node sent them (llama.cpp), one per chunk otherwise
    # (Ollama streams a token per message, as text).
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    # False once a chunk came without ids: the ids then do not cover the text.
    ids_complete: bool = True
    text: list[str] = field(default_factory=list)
    failed_nodes: set[str] = field(default_factory=set)

    def add(self, chunk: TextChunk) -> None:
        self.deltas += 1
        self.tokens += len(chunk.token_ids) or 1
        self.ids_complete &= bool(chunk.token_ids)
        self.token_ids.extend(chunk.token_ids)
        self.text.append(chunk.text)


class _Clock:
    """The request's own deadline and each stage's share of it."""

    def __init__(self, time_remaining: float | None) -> None:
        self.started = time.perf_counter()
        self._deadline = None if time_remaining is None else time.monotonic() + time_remaining

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def stage_timeout(self, stage_limit_s: float) -> tuple[float, bool]:
        """(timeout, True if the caller's deadline is what limits it)."""
        if self._deadline is None:
            return stage_limit_s, False
        left = self._deadline - time.monotonic()
        return (left, True) if left < stage_limit_s else (stage_limit_s, False)


class CallerDeadlineExceeded(DeadlineExceeded):
    """The caller's own deadline ran out: nothing further is tried."""


@dataclass
class _Attempt:
    method: RouteMethod
    # The prefill nodes a disaggregated attempt may use, in order (retries move along).
    prefill_candidates: list[Node] = field(default_factory=list)
    # The prefill node that served (or, before that, the first candidate).
    prefill: Node | None = None
    decode: Node | None = None
    # The node being called when a failure happens, to blame it, and when that call began.
    current: Node | None = None
    started: float = 0.0
    # A generation a client resumes here: the router that was serving it ("router h:p").
    origin: str = ""

    @property
    def label(self) -> str:
        if self.origin:
            return self.origin
        if self.method == RouteMethod.DISAGGREGATED:
            prefill = self.prefill.name if self.prefill else "?"
            decode = self.decode.name if self.decode else "?"
            return f"{prefill} -> {decode}"
        return self.decode.name if self.decode else ""


class Router:
    def __init__(self, topology: Topology, pool: ChannelPool, health: NodeHealth) -> None:
        self.topology = topology
        self.pool = pool
        self.health = health
        # Token block hashes each decode node holds (from prefill replies), and text block
        # hashes of the prompts each node served (any method).
        self.prefixes = PrefixTable()
        self.text_prefixes = PrefixTable()
        self.costs = Costs()
        self._direct: dict[str, OllamaEngine] = {}

    @property
    def max_tokens_limit(self) -> int:
        return self.topology.mesh.max_tokens_limit

    def n_ctx(self, model: str) -> int:
        """The context a request to this logical model gets: the smallest of its nodes'."""
        route = self._route(model)
        nodes = [self.topology.node(n) for n in (*route.prefill, *route.decode)]
        return min((n.n_ctx for n in nodes), default=0)

    def routes(self) -> list[tuple[ModelRoute, list[Node], list[Node]]]:
        t = self.topology
        return [
            (m, [t.node(n) for n in m.prefill], [t.node(n) for n in m.decode]) for m in t.models
        ]

    def check(self, model: str, prompt: Prompt, sampling: Sampling) -> ModelRoute:
        """What a generation checks before it runs (NOT_FOUND for a model not served here,
        INVALID_ARGUMENT naming the field): the route it would take."""
        route = self._route(model)
        validate_prompt(prompt)
        validate_sampling(sampling, self.topology.mesh.max_tokens_limit)
        return route

    async def generate(
        self, model: str, prompt: Prompt, sampling: Sampling, time_remaining: float | None
    ) -> AsyncGenerator[TextChunk | RouteSummary, None]:
        """Text chunks as they are made, then one RouteSummary."""
        items = self.generate_resumable(model, prompt, sampling, time_remaining)
        async with aclosing(items) as stream:
            async for item in stream:
                if not isinstance(item, ResumeInfo):
                    yield item

    async def generate_resumable(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        time_remaining: float | None,
        resume: Continuation | None = None,
        resumed_from: str = "",
    ) -> AsyncGenerator[TextChunk | RouteSummary | ResumeInfo, None]:
        """As generate, with a ResumeInfo before the first chunk, for a client that can
        resume through another router (gRPC). resume: go on with a generation the router
        `resumed_from` was streaming when it failed, as a migration does."""
        try:
            items = self._generate(model, prompt, sampling, time_remaining, resume, resumed_from)
            async with aclosing(items) as stream:
                async for item in stream:
                    if isinstance(item, RouteSummary):
                        _count_served(model, item)
                    yield item
        except MeshError as exc:
            metrics.request_failed(model, exc.code.name)
            raise

    async def _generate(
        self,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        time_remaining: float | None,
        resume: Continuation | None,
        resumed_from: str,
    ) -> AsyncGenerator[TextChunk | RouteSummary | ResumeInfo, None]:
        clock = _Clock(time_remaining)
        route = self.check(model, prompt, sampling)
        data = prompt_bytes(prompt)
        blocks = text_blocks(route.name, data)
        if resume is not None:
            resumed = self._resume(route, prompt, sampling, clock, blocks, resume, resumed_from)
            async with aclosing(resumed) as stream:
                async for item in stream:
                    yield item
            return
        chain, reason = self._order(route, len(data), blocks)
        failed: list[FailedAttempt] = []
        last_error: MeshError | None = None
        for step in chain:
            for attempt in self._attempts(step, route, blocks):
                attempt.started = time.perf_counter()
                summary = RouteSummary(method=attempt.method, route_reason=reason)
                sent = _Delivered()
                try:
                    events = self._run(attempt, route, prompt, sampling, clock, summary, failed)
                    async with aclosing(events) as stream:
                        async for chunk in stream:
                            if not sent.deltas:
                                summary.time_to_first_token_seconds = clock.elapsed()
                                yield _resume_info(attempt, summary)
                            sent.add(chunk)
                            yield chunk
                except MeshError as exc:
                    if sent.deltas:
                        self._blame(attempt, exc)
                        resumed = self._migrate(
                            route, attempt, prompt, sampling, clock, summary, sent, exc, blocks
                        )
                        async with aclosing(resumed) as stream:
                            async for chunk in stream:
                                yield chunk
                    elif exc.code in FINAL_CODES or isinstance(exc, CallerDeadlineExceeded):
                        raise
                    else:
                        self._attempt_failed(route, attempt, exc, failed)
                        last_error = exc
                        continue
                for node in (attempt.prefill, attempt.decode):
                    if node is not None and node.name not in sent.failed_nodes:
                        self.health.succeeded(node)
                        self.text_prefixes.learn(node.name, blocks)
                summary.failed_attempts = failed
                summary.total_seconds = clock.elapsed()
                if not summary.migrations and attempt.decode is not None:
                    self.costs.learn_steps(
                        attempt.decode.name, summary.completion_tokens, summary.decode_seconds
                    )
                self._learn_costs(route, len(data), summary)
                yield summary
                return
        raise _exhausted(route, failed, last_error)

    async def _resume(
        self,
        route: ModelRoute,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        blocks: list[bytes],
        resume: Continuation,
        resumed_from: str,
    ) -> AsyncGenerator[TextChunk | RouteSummary | ResumeInfo, None]:
        """A client resuming, through this router, a generation another router was serving
        when it failed: the rest of it on a decode node, as a migration (the failed router
        in the failed node's place)."""
        disaggregated = resume.first_token_from_prefill
        prefill = [self.topology.node(n) for n in route.prefill]
        decode = [self.topology.node(n) for n in route.decode]
        attempt = _Attempt(
            RouteMethod.DISAGGREGATED if disaggregated and prefill else RouteMethod.DECODE_ONLY,
            # The nodes that would have rendered the prompt, as the first router's did.
            prefill=prefill[0] if prefill else None,
            decode=decode[0] if decode else None,
            origin=f"router {resumed_from or '(unnamed)'}",
        )
        summary = RouteSummary(
            method=attempt.method,
            route_reason=f"resumed after router {resumed_from or '(unnamed)'} failed mid-answer",
            cached_prompt_tokens=resume.prompt_cached_tokens or 0,
        )
        ids = list(resume.generated_token_ids)
        sent = _Delivered(
            deltas=1,
            tokens=max(resume.generated_tokens, len(ids)),
            token_ids=ids,
            ids_complete=bool(ids),
            text=[resume.generated_text],
        )
        yield _resume_info(attempt, summary)
        error = Unavailable(f"{attempt.origin} failed mid-answer")
        events = self._migrate(
            route, attempt, prompt, sampling, clock, summary, sent, error, blocks
        )
        async with aclosing(events) as stream:
            async for chunk in stream:
                yield chunk
        summary.total_seconds = clock.elapsed()
        yield summary

    def _route(self, model: str) -> ModelRoute:
        route = self.topology.route(model)
        if route is None:
            known = ", ".join(m.name for m in self.topology.models)
            raise NotFound(f"model {model!r} is not served here; models: {known}")
        return route

    def _attempts(self, step: Step, route: ModelRoute, blocks: list[bytes]) -> Iterator[_Attempt]:
        """The attempts of one step, healthy nodes first (topology validation guarantees
        each step has the nodes it needs)."""
        prefill = self._by_prefix([self.topology.node(n) for n in route.prefill], blocks)
        decode = self._by_prefix([self.topology.node(n) for n in route.decode], blocks)
        if step == "direct_ollama":
            yield _Attempt(RouteMethod.DIRECT_OLLAMA)
        elif step == "disaggregated":
            yield _Attempt(
                RouteMethod.DISAGGREGATED,
                prefill_candidates=prefill,
                prefill=prefill[0],
                decode=decode[0],
            )
        else:
            for node in decode:
                yield _Attempt(RouteMethod.DECODE_ONLY, decode=node)

    def _order(
        self, route: ModelRoute, prompt_chars: int, blocks: list[bytes]
    ) -> tuple[list[Step], str]:
        """The steps to try, in order, and why the first: the chain as listed, or (mode
        auto) disaggregated or decode_only first by estimated time to first token."""
        if route.mode != "auto":
            metrics.route_decision(route.name, route.chain[0], "chain")
            return list(route.chain), f"chain: {route.chain[0]} is the chain's first step"
        prefill = self._by_prefix([self.topology.node(n) for n in route.prefill], blocks)[0]
        decode = self._by_prefix([self.topology.node(n) for n in route.decode], blocks)[0]
        decision = self.costs.decide(
            route.name,
            prompt_chars,
            self._candidate(prefill, blocks),
            self._candidate(decode, blocks),
        )
        metrics.route_decision(route.name, decision.method, decision.basis)
        first: Step = "disaggregated" if decision.method == "disaggregated" else "decode_only"
        return [first, *(s for s in route.chain if s != first)], decision.reason

    def _candidate(self, node: Node, blocks: list[bytes], held: int | None = None) -> Candidate:
        """What the estimate needs of a node: the prompt's characters it is believed to
        hold (`held`, else from the prompts it served) and its load."""
        if held is None:
            held = self.text_prefixes.overlap(node.name, blocks) * TEXT_BLOCK_CHARS
        return Candidate(node.name, held, self.health.load(node))

    def _learn_costs(self, route: ModelRoute, prompt_chars: int, s: RouteSummary) -> None:
        """A request served at the first try, without migrating, by the embedded engine's
        KV handoff or on a decode node alone: its figures say what each mode costs."""
        if s.failed_attempts or s.migrations:
            return
        handoff = s.method == RouteMethod.DISAGGREGATED and s.kv_transfer == KvTransferKind.STATE
        if not handoff and s.method != RouteMethod.DECODE_ONLY:
            return
        self.costs.learn(
            route.name,
            Observation(
                method=s.method.value,
                prefill_node=s.prefill_node,
                decode_node=s.decode_node,
                prompt_chars=prompt_chars,
                prompt_tokens=s.prompt_tokens,
                cached_prompt_tokens=s.cached_prompt_tokens,
                prompt_seconds=s.prefill_seconds,
                handoff_seconds=s.kv_transfer_seconds + s.kv_load_seconds,
                kv_transfer_bytes=s.kv_transfer_bytes,
                kv_state_bytes=s.kv_state_bytes,
                time_to_first_token_seconds=s.time_to_first_token_seconds,
            ),
        )

    def _by_prefix(self, nodes: list[Node], blocks: list[bytes]) -> list[Node]:
        """Health first, then among the nodes with a free slot, those that served prompts
        starting like this one the longest first (their prefix caches likely hold it), then
        the busy ones by load; the topology's order breaks ties."""
        picked = self.health.pick(nodes)
        free = [n for n in picked if self.health.has_free_slot(n)]
        busy = [n for n in picked if not self.health.has_free_slot(n)]
        free.sort(key=lambda n: -self.text_prefixes.overlap(n.name, blocks))
        return free + busy

    def _blame(self, attempt: _Attempt, exc: MeshError) -> None:
        if attempt.current is not None and exc.code in NODE_TROUBLE_CODES:
            if not isinstance(exc, CallerDeadlineExceeded):
                self.health.failed(attempt.current)

    def _attempt_failed(
        self,
        route: ModelRoute,
        attempt: _Attempt,
        exc: MeshError,
        failed: list[FailedAttempt],
    ) -> None:
        """A failure before any text was sent: blame the node, count it, list it."""
        self._blame(attempt, exc)
        failed.append(_failure(attempt, exc, time.perf_counter() - attempt.started))
        metrics.attempt_failed(route.name, attempt.method.value, exc.code.name)
        log.warning(
            "attempt failed, trying the next",
            method=attempt.method.value,
            node=attempt.current.name if attempt.current else attempt.label,
            code=exc.code.name,
            error=exc.message,
        )

    async def _run(
        self,
        attempt: _Attempt,
        route: ModelRoute,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        summary: RouteSummary,
        failed: list[FailedAttempt],
    ) -> AsyncGenerator[TextChunk, None]:
        """One attempt: relays its text and fills in summary (and failed, with the prefill
        calls that were retried)."""
        if attempt.method == RouteMethod.DIRECT_OLLAMA:
            async for chunk in self._direct_ollama(route, prompt, sampling, clock, summary):
                yield chunk
            return
        while True:  # again only when a decode node had let the prefix go (ABORTED)
            source: KvSource | Prompt = prompt
            result: PrefillResult | None = None
            if attempt.prefill_candidates:
                candidates = self._decode_candidates(route)
                result = await self._prefill(
                    route, attempt, prompt, sampling, clock, failed, candidates
                )
                assert attempt.prefill is not None
                summary.prefill_node = attempt.prefill.name
                summary.prefill_address = attempt.prefill.address
                summary.prefill_seconds = result.prefill_seconds
                summary.prompt_tokens = result.prompt_tokens
                summary.cached_prompt_tokens = result.cached_prompt_tokens
                summary.kv_state_bytes = result.kv_state_bytes
                if result.kv_prefix_node in route.decode:  # it holds the prompt's prefix
                    attempt.decode = self.topology.node(result.kv_prefix_node)
                source = _kv_source(attempt.prefill, result)
            assert attempt.decode is not None
            attempt.current = decode = attempt.decode
            summary.decode_node, summary.decode_address = decode.name, decode.address
            stats: DecodeStats | None = None
            streamed = False
            try:
                async for event in self._decode(route, decode, source, sampling, clock):
                    if isinstance(event, DecodeStats):
                        stats = event
                    else:
                        streamed = True
                        yield event
            except MeshError as exc:
                if exc.code != grpc.StatusCode.ABORTED or streamed or result is None:
                    raise
                # What the router believed of the node is stale: forget it, prefill again
                # (the prefill node's own cache makes that cheap) for the whole state.
                self.prefixes.forget(decode.name)
                self._attempt_failed(route, attempt, exc, failed)
                attempt.started = time.perf_counter()
                continue
            stats = _required(stats, decode)
            _add_decode_stats(summary, stats)
            if result is not None:  # what the decode node says it keeps
                kept = stats.kept_prefix_tokens // PREFIX_BLOCK_TOKENS
                self.prefixes.learn(decode.name, result.block_hashes[:kept])
            return

    def _decode_candidates(self, route: ModelRoute) -> list[DecodeCandidate]:
        """The decode nodes a prefill node may choose from by the prefixes they hold: the
        available ones with a free slot (all of them, in order of preference and load, or
        the least loaded when none is free), each with what the router believes it holds."""
        nodes = self.health.pick([self.topology.node(n) for n in route.decode])
        chosen = [n for n in nodes if self.health.has_free_slot(n)] or nodes[:1]
        return [DecodeCandidate(n.name, frozenset(self.prefixes.held(n.name))) for n in chosen]

    async def _prefill(
        self,
        route: ModelRoute,
        attempt: _Attempt,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        failed: list[FailedAttempt],
        candidates: list[DecodeCandidate],
    ) -> PrefillResult:
        """The prefill stage with retries (tenacity): each call gets the stage deadline (or
        what is left of the caller's), and moves to the next candidate node. UNAVAILABLE and
        RESOURCE_EXHAUSTED are retried; so is the stage's own DEADLINE_EXCEEDED, but only on
        a node that has not timed out in this request (a hung node would hang again).
        Every retried call is listed in failed."""
        nodes = attempt.prefill_candidates
        timed_out: set[str] = set()

        async def call(number: int) -> PrefillResult:
            node = nodes[(number - 1) % len(nodes)]
            attempt.prefill = attempt.current = node
            attempt.started = time.perf_counter()
            try:
                return await self._prefill_on(route, node, prompt, sampling, clock, candidates)
            except DeadlineExceeded as error:
                if type(error) is DeadlineExceeded:  # the stage's own, not the caller's
                    timed_out.add(node.name)
                raise

        def retryable(exc: BaseException) -> bool:
            if is_retryable(exc):
                return True
            if type(exc) is not DeadlineExceeded:  # the caller's own deadline is final
                return False
            after = attempt.prefill
            following = nodes[(nodes.index(after) + 1) % len(nodes)] if after else None
            return following is not None and following.name not in timed_out

        def on_retry(exc: BaseException) -> None:
            assert isinstance(exc, MeshError)
            self._attempt_failed(route, attempt, exc, failed)

        return await call_with_retries(call, clock.remaining(), retryable, on_retry)

    async def _prefill_on(
        self,
        route: ModelRoute,
        node: Node,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        candidates: list[DecodeCandidate],
        continuation: Continuation | None = None,
    ) -> PrefillResult:
        """One prefill call, with the stage deadline (or what is left of the caller's)."""
        timeout, caller_bound = clock.stage_timeout(route.prefill_deadline_s)
        client = PrefillClient(self.pool, node.address)
        try:
            with self.health.busy(node):
                return await client.prefill(
                    route.name, prompt, sampling, timeout, candidates, continuation
                )
        except UpstreamError as exc:
            raise _stage_error(exc, "prefill", node, timeout, caller_bound) from exc

    async def _migrate(
        self,
        route: ModelRoute,
        attempt: _Attempt,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        summary: RouteSummary,
        sent: _Delivered,
        error: MeshError,
        blocks: list[bytes],
    ) -> AsyncGenerator[TextChunk, None]:
        """A decode node failed after text was delivered: go on with the same generation on
        another decode node of the route (or, last, the route's direct_ollama step), from
        the prompt and the tokens delivered, up to route.max_migrations times. The node
        taking over evaluates those itself, or a prefill node does and hands their KV
        state over (route.migrate_via; `_resume_via`). Nothing is sent twice and nothing is
        skipped; max_tokens, stop strings and the caller's deadline count across the whole
        answer. Raises the mid-stream error (saying how much was delivered) when no node
        can take over."""
        failed_name = attempt.current.name if attempt.current else attempt.label
        # How the original request rendered its prompt: an Ollama continuation renders it
        # the same way.
        disaggregated = attempt.method == RouteMethod.DISAGGREGATED
        renderer = attempt.prefill if disaggregated else attempt.decode
        raw_prompt = not prompt.messages and renderer is not None and renderer.engine == "llama_cpp"
        # The prefill node that evaluated this prompt: its prefix cache holds it.
        prefilled = attempt.prefill.name if disaggregated and attempt.prefill else ""
        info = _resume_info(attempt, summary)
        while True:
            sent.failed_nodes.add(failed_name)
            done = len(summary.migrations)
            targets = self._takeover_targets(route, sent.failed_nodes)
            if (
                not route.migrate
                or error.code not in MIGRATABLE_CODES
                or isinstance(error, CallerDeadlineExceeded)
                or done >= route.max_migrations
                or not targets
            ):
                raise _midstream_error(error, failed_name, sent.deltas, done)
            target = targets[0]
            name = target.name if isinstance(target, Node) else target
            migration = Migration(failed_name, error.code.name, sent.tokens, name)
            summary.migrations.append(migration)
            metrics.migration(route.name, error.code.name)
            log.warning(
                "decode node failed mid-answer, resuming on another",
                failed_node=failed_name,
                code=error.code.name,
                tokens_delivered=sent.tokens,
                resumed_on=name,
            )
            failed_at = time.perf_counter()
            continuation = Continuation(
                # Without every id, a llama.cpp node tokenizes the text instead.
                generated_token_ids=tuple(sent.token_ids) if sent.ids_complete else (),
                generated_text="".join(sent.text),
                first_token_from_prefill=info.first_token_from_prefill,
                raw_prompt=raw_prompt,
                generated_tokens=sent.tokens,
                prompt_cached_tokens=info.prompt_cached_tokens,
            )
            attempt.current = target if isinstance(target, Node) else None
            stats: DecodeStats | None = None
            try:
                if isinstance(target, Node):
                    via, migration.reason = self._resume_via(
                        route, target, prompt, summary, sent, blocks, prefilled
                    )
                    events = self._resume_on(
                        route, target, via, prompt, sampling, clock, continuation, migration
                    )
                else:
                    events = self._direct_events(route, prompt, sampling, continuation)
                async with aclosing(events) as stream:
                    async for event in stream:
                        if isinstance(event, DecodeStats):
                            stats = event
                            continue
                        if not migration.resume_seconds:
                            migration.resume_seconds = time.perf_counter() - failed_at
                        sent.add(event)
                        yield event
                stats = _required(stats, target)
            except MeshError as again:
                self._blame(attempt, again)  # attempt.current is the target (None: Ollama)
                failed_name, error = name, again
                continue
            if not migration.resume_seconds:
                migration.resume_seconds = time.perf_counter() - failed_at
            if isinstance(target, Node):
                attempt.decode = target
                summary.decode_node, summary.decode_address = target.name, target.address
                replayed = 0 if migration.via_prefill_node else sent.tokens
                if replayed:  # it evaluated the prompt and replayed the delivered tokens
                    uncached = stats.prompt_tokens - stats.cached_prompt_tokens
                    self.costs.learn_prompt(target.name, uncached, stats.prompt_eval_seconds)
                generated = stats.completion_tokens - (sent.tokens - replayed)
                self.costs.learn_steps(target.name, generated, stats.decode_seconds)
            else:
                summary.decode_node = summary.decode_address = target
            summary.completion_tokens = stats.completion_tokens
            summary.finish_reason = stats.finish_reason
            summary.decode_prompt_eval_seconds += stats.prompt_eval_seconds
            summary.decode_seconds = stats.decode_seconds
            if stats.decode_seconds > 0:
                summary.decode_tokens_per_second = stats.completion_tokens / stats.decode_seconds
            return

    def _resume_via(
        self,
        route: ModelRoute,
        target: Node,
        prompt: Prompt,
        summary: RouteSummary,
        sent: _Delivered,
        blocks: list[bytes],
        prefilled: str,
    ) -> tuple[Node | None, str]:
        """The prefill node that should evaluate the prompt and the delivered tokens for
        `target` (None: target evaluates them itself), and why. A prefill node can when both
        are llama_cpp nodes and every delivered token's id is known; route.migrate_via
        "auto" weighs both ways (costs.py)."""
        if route.migrate_via == "decode":
            return None, "migrate_via = decode"
        if target.engine != "llama_cpp":
            return None, f"{target.name} is an Ollama node: it continues from the text"
        if not sent.ids_complete or not sent.token_ids:
            return None, "the delivered tokens' ids are not known (Ollama streams text)"
        prefills = [
            n
            for n in self._by_prefix([self.topology.node(n) for n in route.prefill], blocks)
            if n.engine == "llama_cpp" and self.health.available(n)
        ]
        if not prefills:
            return None, f"{route.name} has no available llama_cpp prefill node"
        via = next((n for n in prefills if n.name == prefilled), prefills[0])
        if route.migrate_via == "prefill":
            return via, "migrate_via = prefill"
        data = prompt_bytes(prompt)
        held = len(data) if via.name == prefilled else None
        prefill = self._candidate(via, blocks, held)
        decision = self.costs.resume(
            route.name,
            len(data),
            summary.prompt_tokens,
            sent.tokens,
            prefill,
            self._candidate(target, blocks),
        )
        return (via if decision.via == "prefill" else None), f"auto: {decision.reason}"

    async def _resume_on(
        self,
        route: ModelRoute,
        target: Node,
        via: Node | None,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        continuation: Continuation,
        migration: Migration,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """The generation going on on `target`: from the KV state of the prompt and the
        delivered tokens that `via` evaluated, or from the prompt and the delivered tokens,
        evaluated by target itself. When the prefill node fails, or target no longer holds
        the prefix the state left out (ABORTED), target evaluates them itself."""
        migration.via_prefill_node = via.name if via else ""
        source: KvSource | Prompt = prompt
        if via is not None:
            try:
                source = await self._prefill_continuation(
                    route, via, target, prompt, sampling, clock, continuation
                )
            except MeshError as exc:
                if exc.code in FINAL_CODES or isinstance(exc, CallerDeadlineExceeded):
                    raise
                if exc.code in NODE_TROUBLE_CODES:
                    self.health.failed(via)
                self._resume_alone(migration, target, via, exc)
        streamed = False
        try:
            async for event in self._decode(route, target, source, sampling, clock, continuation):
                streamed |= isinstance(event, TextChunk)
                yield event
            return
        except MeshError as exc:
            if exc.code != grpc.StatusCode.ABORTED or streamed or via is None:
                raise
            self.prefixes.forget(target.name)
            self._resume_alone(migration, target, via, exc)
        async for event in self._decode(route, target, prompt, sampling, clock, continuation):
            yield event

    def _resume_alone(self, migration: Migration, target: Node, via: Node, exc: MeshError) -> None:
        migration.via_prefill_node = ""
        migration.reason += (
            f"; {via.name}'s way failed ({exc.code.name}: {exc.message}), so {target.name} "
            "evaluated them itself"
        )
        log.warning(
            "resuming through the prefill node failed; the decode node evaluates it itself",
            prefill_node=via.name,
            decode_node=target.name,
            code=exc.code.name,
            error=exc.message,
        )

    async def _prefill_continuation(
        self,
        route: ModelRoute,
        via: Node,
        target: Node,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        continuation: Continuation,
    ) -> KvSource:
        """The prefill node evaluates the prompt and the delivered tokens but the last, and
        keeps their KV state for target (less the prefix target holds)."""
        candidates = [DecodeCandidate(target.name, frozenset(self.prefixes.held(target.name)))]
        result = await self._prefill_on(
            route, via, prompt, sampling, clock, candidates, continuation
        )
        self.costs.learn_steps(via.name, result.replayed_tokens, result.replay_seconds)
        self.costs.learn_prompt(
            via.name,
            result.prompt_tokens - result.cached_prompt_tokens,
            result.prefill_seconds - result.replay_seconds,
        )
        return _kv_source(via, result)

    def _takeover_targets(self, route: ModelRoute, failed: set[str]) -> list[Node | str]:
        """Who can take a generation over: the route's healthy decode nodes (by health and
        load), then its direct_ollama step (named by its URL), leaving out those that failed
        in this request."""
        nodes = self.health.pick([self.topology.node(name) for name in route.decode])
        targets: list[Node | str] = [n for n in nodes if n.name not in failed]
        if "direct_ollama" in route.chain and route.ollama_url not in failed:
            assert route.ollama_url is not None
            targets.append(route.ollama_url)
        return targets

    async def _decode(
        self,
        route: ModelRoute,
        node: Node,
        source: KvSource | Prompt,
        sampling: Sampling,
        clock: _Clock,
        continuation: Continuation | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        timeout, caller_bound = clock.stage_timeout(route.decode_deadline_s)
        client = DecodeClient(self.pool, node.address)
        generation = client.generate(route.name, source, sampling, timeout, continuation)
        try:
            with self.health.busy(node):
                async with aclosing(generation) as events:
                    async for event in events:
                        yield event
        except UpstreamError as exc:
            raise _stage_error(exc, "decode", node, timeout, caller_bound) from exc

    async def _direct_ollama(
        self,
        route: ModelRoute,
        prompt: Prompt,
        sampling: Sampling,
        clock: _Clock,
        summary: RouteSummary,
    ) -> AsyncGenerator[TextChunk, None]:
        """The user's old path: the router calls Ollama's HTTP API itself, still streaming."""
        assert route.ollama_url is not None
        summary.decode_node = summary.decode_address = route.ollama_url
        async with aclosing(self._direct_events(route, prompt, sampling)) as items:
            async for item in items:
                if isinstance(item, DecodeStats):
                    _add_decode_stats(summary, item)
                else:
                    yield item

    async def _direct_events(
        self,
        route: ModelRoute,
        prompt: Prompt,
        sampling: Sampling,
        continuation: Continuation | None = None,
    ) -> AsyncGenerator[TextChunk | DecodeStats, None]:
        """Text from the route's Ollama server, then one DecodeStats; bounded by the
        caller's deadline, and by decode_deadline_s between two chunks."""
        assert route.ollama_url is not None
        engine = self._direct.get(route.name)
        if engine is None:
            engine = OllamaEngine(
                url=route.ollama_url,
                model=route.ollama_model or route.name,
                n_ctx=0,
                max_in_flight=DIRECT_OLLAMA_MAX_IN_FLIGHT,
                timeout_s=route.decode_deadline_s,
            )
            self._direct[route.name] = engine
        async with aclosing(engine.generate(prompt, sampling, continuation)) as items:
            async for item in items:
                if isinstance(item, GenerationEnd):
                    stats = DecodeStats()
                    stats.add_end(item)
                    yield stats
                else:
                    yield item

    async def close(self) -> None:
        for engine in self._direct.values():
            await engine.close()


def _resume_info(attempt: _Attempt, summary: RouteSummary) -> ResumeInfo:
    """Where the prefill node's pieces of the prompt started: a decode_only node's cached
    count comes with its summary only, so it is not known then."""
    disaggregated = attempt.method == RouteMethod.DISAGGREGATED
    return ResumeInfo(
        first_token_from_prefill=disaggregated,
        prompt_cached_tokens=summary.cached_prompt_tokens if disaggregated else None,
    )


def _kv_source(prefill: Node, result: PrefillResult) -> KvSource:
    return KvSource(
        prefill_address=prefill.address,
        kv_handle=result.kv_handle,
        first_token_id=result.first_token_id,
        prompt_tokens=result.prompt_tokens,
        fingerprint=result.fingerprint,
        kv_size_bytes=result.kv_size_bytes,
        first_token_text=result.first_token_text,
        block_hashes=result.block_hashes,
        prefix_tokens=result.kv_prefix_tokens,
        open_message=result.open_message,
    )


def _count_served(model: str, s: RouteSummary) -> None:
    metrics.request_served(
        model,
        s.method.value,
        {
            "ttft": s.time_to_first_token_seconds,
            "prefill": s.prefill_seconds,
            "kv_transfer": s.kv_transfer_seconds + s.kv_load_seconds,
            "decode": s.decode_seconds,
            "total": s.total_seconds,
        },
        s.prompt_tokens,
        s.completion_tokens,
    )
    if s.kv_transfer == KvTransferKind.STATE:
        metrics.kv_bytes(model, s.kv_transfer_bytes, s.kv_state_bytes)


def _required(stats: DecodeStats | None, node: Node | str) -> DecodeStats:
    if stats is None:
        where = node.address if isinstance(node, Node) else node
        raise UpstreamError(
            grpc.StatusCode.DATA_LOSS, f"decode node {where} ended the stream without a summary"
        )
    return stats


def _add_decode_stats(summary: RouteSummary, stats: DecodeStats) -> None:
    summary.prompt_tokens = summary.prompt_tokens or stats.prompt_tokens
    summary.completion_tokens = stats.completion_tokens
    summary.finish_reason = stats.finish_reason
    summary.kv_transfer = stats.kv_transfer
    summary.kv_transfer_seconds = stats.kv_fetch_seconds
    summary.kv_transfer_bytes = stats.kv_fetch_bytes
    summary.kv_load_seconds = stats.kv_load_seconds
    summary.decode_prompt_eval_seconds = stats.prompt_eval_seconds
    if summary.method != RouteMethod.DISAGGREGATED:  # the prompt was evaluated there
        summary.prefill_seconds = stats.prompt_eval_seconds
        summary.cached_prompt_tokens = stats.cached_prompt_tokens
    else:
        summary.decode_cached_prompt_tokens = stats.cached_prompt_tokens
    summary.decode_seconds = stats.decode_seconds
    if summary.prefill_seconds > 0:
        summary.prefill_tokens_per_second = summary.prompt_tokens / summary.prefill_seconds
    if summary.decode_seconds > 0:
        summary.decode_tokens_per_second = summary.completion_tokens / summary.decode_seconds


def _stage_error(
    exc: UpstreamError, stage: str, node: Node, timeout: float, caller_bound: bool
) -> MeshError:
    if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return exc
    where = f"{stage} stage on node {node.name} ({node.address})"
    if caller_bound:
        return CallerDeadlineExceeded(
            f"{where} ran out of time: the caller's deadline passed "
            f"({timeout:.3f} s were left when the stage began)"
        )
    return DeadlineExceeded(f"{where} ran out of time: its {timeout:g} s stage deadline passed")


def _failure(attempt: _Attempt, exc: MeshError, seconds: float) -> FailedAttempt:
    node = attempt.current.name if attempt.current else attempt.label
    return FailedAttempt(attempt.method, node, exc.code.name, exc.message, seconds)


def _midstream_error(exc: MeshError, node: str, delivered: int, migrations: int) -> MeshError:
    moved = f" after {migrations} migrations" if migrations else ""
    return UpstreamError(
        exc.code,
        f"{exc.message} — failed on {node}{moved} after {delivered} text deltas were "
        "delivered; no node could take the generation over, and no text is sent twice",
    )


def _exhausted(route: ModelRoute, failed: list[FailedAttempt], last: MeshError | None) -> MeshError:
    tried = "; ".join(
        f"{f.method.value}{' on ' + f.node if f.node else ''}: {f.code} {f.message}" for f in failed
    )
    code = last.code if last is not None else grpc.StatusCode.UNAVAILABLE
    return UpstreamError(code, f"every step of {route.name}'s chain failed: {tried}")
