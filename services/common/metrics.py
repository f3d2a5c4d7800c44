"""Prometheus metrics, served over HTTP on the node's `metrics_port` (prometheus-client).

Every process: calls served by method and status code, and calls in flight. The router:
requests by logical model, serving method (chain step) and code; histograms of time to first
token, prefill, KV transfer, decode and total time; tokens. Prefill nodes: KV states and bytes
held. Plain Python: callers pass plain values.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180)

RPCS = Counter(
    "disagg_rpcs_total", "gRPC calls served, by method and status code", ["method", "code"]
)
IN_FLIGHT = Gauge("disagg_rpcs_in_flight", "gRPC calls being served now", ["method"])
REQUESTS = Counter(
    "disagg_requests_total",
    "Router requests by logical model, the chain step that served them, and status code",
    ["model", "method", "code"],
)
STAGE_SECONDS = Histogram(
    "disagg_request_stage_seconds",
    "Router: seconds per stage (ttft, prefill, kv_transfer, decode, total)",
    ["model", "stage"],
    buckets=_SECONDS,
)
TOKENS = Counter(
    "disagg_tokens_total", "Router: tokens by logical model and kind", ["model", "kind"]
)
FAILED_ATTEMPTS = Counter(
    "disagg_failed_attempts_total",
    "Router: attempts that failed before a request was served or gave up",
    ["model", "method", "code"],
)
KV_STORE_BYTES = Gauge("disagg_kv_store_bytes", "Prefill: bytes of KV states held")
KV_STORE_HANDLES = Gauge("disagg_kv_store_handles", "Prefill: KV states held, not yet fetched")


def serve_metrics(host: str, port: int) -> None:
    start_http_server(port, addr=host)


def watch_kv_store(size_bytes: Callable[[], float], handles: Callable[[], float]) -> None:
    KV_STORE_BYTES.set_function(size_bytes)
    KV_STORE_HANDLES.set_function(handles)


def request_served(
    model: str,
    method: str,
    stages: dict[str, float],
    prompt_tokens: int,
    completion_tokens: int,
) -> None:
    REQUESTS.labels(model, method, "OK").inc()
    for stage, seconds in stages.items():
        STAGE_SECONDS.labels(model, stage).observe(seconds)
    TOKENS.labels(model, "prompt").inc(prompt_tokens)
    TOKENS.labels(model, "completion").inc(completion_tokens)


def request_failed(model: str, code: str) -> None:
    REQUESTS.labels(model, "none", code).inc()


def attempt_failed(model: str, method: str, code: str) -> None:
    FAILED_ATTEMPTS.labels(model, method, code).inc()
