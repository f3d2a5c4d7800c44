"""The metrics of one request, with the names the grader's tooling already reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from disagg_mesh.proto.v1 import router_pb2, types_pb2


@dataclass(frozen=True)
class Migration:
    failed_node: str
    code: str
    tokens_delivered: int
    resumed_on: str
    resume_time: float  # seconds
    # The prefill node that evaluated the prompt and the delivered tokens for resumed_on
    # ("" when resumed_on did), and why.
    via_prefill_node: str = ""
    reason: str = ""


@dataclass(frozen=True)
class FailedAttempt:
    method: str
    node: str
    code: str
    message: str
    duration: float  # seconds


@dataclass(frozen=True)
class Metrics:
    """Times in seconds, speeds in tokens per second."""

    prefill_time: float
    decode_time: float
    total_time: float
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prefill_speed: float
    decode_speed: float
    method: str  # "disaggregated", "decode_only" or "direct_ollama"
    prefill_server: str  # "host:port", empty if no prefill node was used
    decode_server: str
    ttft: float  # time to first token, as the router saw it
    kv_transfer: str  # "state" (real KV), "token_ids" (Ollama: prefill done again), "none"
    kv_bytes: int
    kv_transfer_time: float
    kv_load_time: float
    decode_prompt_eval_time: float
    finish_reason: str  # "stop", "length" or "tool_calls"
    prefill_node: str
    decode_node: str
    failed_attempts: tuple[FailedAttempt, ...] = field(default=())
    migrations: tuple[Migration, ...] = field(default=())
    cached_prompt_tokens: int = 0  # taken from a node's prefix cache
    decode_cached_prompt_tokens: int = 0  # KV the decode node held: it did not move
    kv_state_bytes: int = 0  # the whole KV state (kv_bytes moved may be less)
    route_reason: str = ""  # why the first step tried was chosen (chain order, or auto's estimate)

    @classmethod
    def from_summary(cls, s: router_pb2.GenerateSummary) -> Metrics:
        def secs(d: Any) -> float:
            return float(d.ToNanoseconds()) / 1e9

        return cls(
            prefill_time=secs(s.prefill_duration),
            decode_time=secs(s.decode_duration),
            total_time=secs(s.total_duration),
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens,
            total_tokens=s.prompt_tokens + s.completion_tokens,
            cached_prompt_tokens=s.cached_prompt_tokens,
            decode_cached_prompt_tokens=s.decode_cached_prompt_tokens,
            kv_state_bytes=s.kv_state_bytes,
            route_reason=s.route_reason,
            prefill_speed=s.prefill_tokens_per_second,
            decode_speed=s.decode_tokens_per_second,
            method=_enum_name(router_pb2.RouteMethod.Name(s.method), "ROUTE_METHOD_"),
            prefill_server=s.prefill_address,
            decode_server=s.decode_address,
            ttft=secs(s.time_to_first_token),
            kv_transfer=_enum_name(types_pb2.KvTransfer.Name(s.kv_transfer), "KV_TRANSFER_"),
            kv_bytes=s.kv_transfer_bytes,
            kv_transfer_time=secs(s.kv_transfer_duration),
            kv_load_time=secs(s.kv_load_duration),
            decode_prompt_eval_time=secs(s.decode_prompt_eval_duration),
            finish_reason=_enum_name(
                types_pb2.FinishReason.Name(s.finish_reason), "FINISH_REASON_"
            ),
            prefill_node=s.prefill_node,
            decode_node=s.decode_node,
            failed_attempts=tuple(
                FailedAttempt(
                    method=_enum_name(router_pb2.RouteMethod.Name(f.method), "ROUTE_METHOD_"),
                    node=f.node,
                    code=f.code,
                    message=f.message,
                    duration=secs(f.duration),
                )
                for f in s.failed_attempts
            ),
            migrations=tuple(
                Migration(
                    failed_node=m.failed_node,
                    code=m.code,
                    tokens_delivered=m.tokens_delivered,
                    resumed_on=m.resumed_on,
                    resume_time=secs(m.resume_duration),
                    via_prefill_node=m.via_prefill_node,
                    reason=m.reason,
                )
                for m in s.migrations
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def one_line(self) -> str:
        via = (
            f"{self.prefill_node} -> {self.decode_node}" if self.prefill_node else self.decode_node
        )
        parts = [
            f"{self.method} via {via}",
            f"prompt {self.prompt_tokens} tok in {self.prefill_time:.2f} s "
            f"({self.prefill_speed:.0f} tok/s)",
            f"kv {self.kv_transfer} {self.kv_bytes / 1e6:.1f} MB "
            f"in {self.kv_transfer_time * 1000:.0f} ms",
            f"{self.completion_tokens} tok in {self.decode_time:.2f} s "
            f"({self.decode_speed:.0f} tok/s)",
            f"TTFT {self.ttft:.2f} s",
            f"total {self.total_time:.2f} s",
        ]
        if self.failed_attempts:
            parts.append(f"{len(self.failed_attempts)} failed attempt(s)")
        for m in self.migrations:
            via = f" via {m.via_prefill_node}" if m.via_prefill_node else ""
            parts.append(
                f"moved {m.failed_node} -> {m.resumed_on}{via} after {m.tokens_delivered} tok "
                f"({m.code}, resumed in {m.resume_time:.2f} s)"
            )
        return " | ".join(parts)


def _enum_name(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()
