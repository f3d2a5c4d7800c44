"""One request as the router works on it: what it asks (`Request`: route, prompt, sampling,
its deadline and the attempts that failed so far) and each try at serving it (`Attempt`:
the nodes, what the caller received, and the summary being filled in). Every stage takes
these two instead of their fields one by one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from disagg_mesh.server.common.config.topology import ModelRoute, Node
from disagg_mesh.server.common.errors import MeshError
from disagg_mesh.server.common.types import Prompt, Sampling, StageLimits, TextChunk
from disagg_mesh.server.router.deaths import Death, Deaths
from disagg_mesh.server.router.summary import FailedAttempt, ResumeInfo, RouteMethod, RouteSummary

# A call that failed this close to the caller's deadline ran out of the caller's time.
CLOCK_SLACK_S = 0.01


class Clock:
    """The request's own deadline and each stage's share of it."""

    def __init__(self, time_remaining: float | None) -> None:
        self.started = time.perf_counter()
        self._deadline = None if time_remaining is None else time.monotonic() + time_remaining

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def node_bounds(self, stage_limit_s: float, wait_s: float) -> tuple[StageLimits, float, bool]:
        """A call's bounds that the node counts itself (its wait for a turn, then its work:
        the stage limit), and the call's deadline: the two in turn, or what is left of the
        caller's (True: the caller's deadline is what limits the call)."""
        whole = wait_s + stage_limit_s
        left = self.remaining()
        if left is None or left >= whole:
            return StageLimits(wait_s, stage_limit_s), whole, False
        return StageLimits(min(wait_s, left), min(stage_limit_s, left)), left, True

    def caller_ended(self, limits: StageLimits, stage_limit_s: float) -> bool:
        """Whether a call with these bounds (node_bounds's, where the caller's deadline limits
        the call) that ended with DEADLINE_EXCEEDED ran out of the caller's time: the
        caller's deadline bounded the node's work too, or it has passed (within
        CLOCK_SLACK_S). Else the node's work ran past the stage deadline first: the
        stage's."""
        if limits.work_s is not None and limits.work_s < stage_limit_s:
            return True
        left = self.remaining()
        return left is not None and left <= CLOCK_SLACK_S


@dataclass
class Request:
    route: ModelRoute
    prompt: Prompt
    sampling: Sampling
    clock: Clock
    # The prompt's bytes as the router hashes them, and their text block hashes (which
    # nodes served prompts starting the same way: `prefixes.text_blocks`).
    prompt_chars: int
    blocks: list[bytes]
    # Every attempt and retried call that failed before the one that served.
    failed: list[FailedAttempt] = field(default_factory=list)
    # Model + sampling, hashed (deaths.py), and the nodes that died holding the request.
    fingerprint: str = ""
    deaths: list[Death] = field(default_factory=list)
    ident: int = field(default_factory=Deaths.new_id)
    # Seconds it waited for admission (decode room, free slots) before any work was done for
    # it, on every node tried: the route's queue_budget_s bounds their sum. Once a state was
    # made or text delivered for it (work_done), each wait may take the whole budget again,
    # or as long as the prefill node keeps the state made for it (held_s, its kv_ttl_s),
    # and is never refused at once: room was kept for it, and refusing it then would throw
    # that work away.
    queued_s: float = 0.0
    work_done: bool = False
    held_s: float = 0.0

    def queue_left(self) -> float:
        """What is left of the route's queue budget for this request's next wait."""
        if self.work_done:
            return max(self.route.queue_budget_s, self.held_s)
        return max(0.0, self.route.queue_budget_s - self.queued_s)


@dataclass
class Delivered:
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


@dataclass
class Attempt:
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
    summary: RouteSummary = field(default_factory=RouteSummary)
    sent: Delivered = field(default_factory=Delivered)

    def __post_init__(self) -> None:
        self.summary.method = self.method

    @property
    def label(self) -> str:
        if self.origin:
            return self.origin
        if self.method == RouteMethod.DISAGGREGATED:
            prefill = self.prefill.name if self.prefill else "?"
            decode = self.decode.name if self.decode else "?"
            return f"{prefill} -> {decode}"
        return self.decode.name if self.decode else ""

    @property
    def blamed(self) -> str:
        """The node a failure now is put down to."""
        return self.current.name if self.current else self.label

    def failure(self, exc: MeshError) -> FailedAttempt:
        """This attempt's failure as the summary lists it."""
        seconds = time.perf_counter() - self.started
        return FailedAttempt(self.method, self.blamed, exc.code.name, exc.message, seconds)

    def resume_info(self) -> ResumeInfo:
        """Where the prefill node's pieces of the prompt started: a decode_only node's
        cached count comes with its summary only, so it is not known then."""
        disaggregated = self.method == RouteMethod.DISAGGREGATED
        return ResumeInfo(
            first_token_from_prefill=disaggregated,
            prompt_cached_tokens=self.summary.cached_prompt_tokens if disaggregated else None,
        )
