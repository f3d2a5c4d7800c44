"""What the router reports of one request: how it was served (`RouteSummary`), the attempts
that failed before it, and the migrations during it. Plain Python; the servicer and the HTTP
front doors turn it into their own fields."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.types import DecodeStats, FinishReason, KvTransferKind


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

    def add_decode_stats(self, stats: DecodeStats) -> None:
        """Take in a decode stage's summary (a node's, or Ollama's through the router)."""
        self.prompt_tokens = self.prompt_tokens or stats.prompt_tokens
        self.completion_tokens = stats.completion_tokens
        self.finish_reason = stats.finish_reason
        self.kv_transfer = stats.kv_transfer
        self.kv_transfer_seconds = stats.kv_fetch_seconds
        self.kv_transfer_bytes = stats.kv_fetch_bytes
        self.kv_load_seconds = stats.kv_load_seconds
        self.decode_prompt_eval_seconds = stats.prompt_eval_seconds
        if self.method != RouteMethod.DISAGGREGATED:  # the prompt was evaluated there
            self.prefill_seconds = stats.prompt_eval_seconds
            self.cached_prompt_tokens = stats.cached_prompt_tokens
        else:
            self.decode_cached_prompt_tokens = stats.cached_prompt_tokens
        self.decode_seconds = stats.decode_seconds
        if self.prefill_seconds > 0:
            self.prefill_tokens_per_second = self.prompt_tokens / self.prefill_seconds
        if self.decode_seconds > 0:
            self.decode_tokens_per_second = self.completion_tokens / self.decode_seconds

    def add_resumed_stats(self, stats: DecodeStats) -> None:
        """Take in the summary of the node that took a generation over: its counts are the
        whole answer's; the prompt evaluations add up."""
        self.completion_tokens = stats.completion_tokens
        self.finish_reason = stats.finish_reason
        self.decode_prompt_eval_seconds += stats.prompt_eval_seconds
        self.decode_seconds = stats.decode_seconds
        if stats.decode_seconds > 0:
            self.decode_tokens_per_second = stats.completion_tokens / stats.decode_seconds


def count_served(model: str, s: RouteSummary) -> None:
    """The request's figures into the router's Prometheus metrics."""
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
