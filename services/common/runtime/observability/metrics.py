"""Prometheus metrics, served over HTTP on the node's `metrics_port` (prometheus-client).

Every process: calls served by method and status code, and calls in flight. The router:
requests by logical model, serving method (chain step) and code; histograms of time to first
token, prefill, KV transfer, decode and total time; tokens. Prefill nodes: KV states and bytes
held. Prefill and decode nodes: their engine's slots, queue, tokens and step times, and
the same load under vLLM's names for llm-d's model-server protocol (`vllm:...`). Plain
Python: callers pass plain values.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

if TYPE_CHECKING:
    from disagg_mesh.server.common.engines.base import EngineLoad

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180)

RPCS = Counter(
    "disagg_rpcs_total", "gRPC calls served, by method and status code", ["method", "code"]
)
IN_FLIGHT = Gauge("disagg_rpcs_in_flight", "gRPC calls being served now", ["method"])
HTTP_REQUESTS = Counter(
    "disagg_http_requests_total",
    "Router's HTTP front doors: requests by API (ollama, openai), path and HTTP status",
    ["api", "path", "status"],
)
HTTP_IN_FLIGHT = Gauge(
    "disagg_http_requests_in_flight", "Router's HTTP front doors: requests being served", ["api"]
)
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
KV_BYTES = Counter(
    "disagg_kv_bytes_total",
    "Router: KV state bytes of disaggregated requests, moved and whole (moved is less when "
    "the decode node held the prompt's prefix)",
    ["model", "kind"],
)
ROUTE_DECISIONS = Counter(
    "disagg_route_decisions_total",
    "Router: the first step chosen per request, by method and basis (chain: the chain's "
    "order; cost: mode auto's estimate; measuring: mode auto lacking figures)",
    ["model", "method", "basis"],
)
MIGRATIONS = Counter(
    "disagg_migrations_total",
    "Router: generations moved to another decode node mid-answer, by the failure's code",
    ["model", "code"],
)
FAILED_ATTEMPTS = Counter(
    "disagg_failed_attempts_total",
    "Router: attempts that failed before a request was served or gave up",
    ["model", "method", "code"],
)
QUERIES_OF_DEATH = Counter(
    "disagg_router_queries_of_death_total",
    "Router: nodes that died holding a request before it sent text (node_died), requests "
    "failed after a second such death (failed, or quarantined: its fingerprint refused), and "
    "requests refused for a quarantined fingerprint (refused)",
    ["outcome"],
)
KV_STORE_BYTES = Gauge("disagg_kv_store_bytes", "Prefill: bytes of KV states held")
KV_STORE_HANDLES = Gauge("disagg_kv_store_handles", "Prefill: KV states held, not yet fetched")
ENGINE_SLOTS = Gauge("disagg_engine_slots", "Engine: sequences it serves at once")
ENGINE_SLOTS_BUSY = Gauge("disagg_engine_slots_busy", "Engine: slots in use now")
ENGINE_QUEUE = Gauge("disagg_engine_queue_depth", "Engine: requests waiting for a slot")
ENGINE_TOKENS_PER_SECOND = Gauge(
    "disagg_engine_tokens_per_second",
    "Engine: prompt and generated tokens per second over the last 10 s, all slots together",
    ["kind"],
)
ENGINE_KV_CACHE_BYTES = Gauge(
    "disagg_engine_kv_cache_bytes",
    "Embedded engine: KV cache bytes, in all and holding tokens now",
    ["state"],
)
ENGINE_TOKENS = Counter(
    "disagg_engine_tokens_total",
    "Embedded engine: tokens evaluated (prompt, decode), and prompt tokens taken from the "
    "prefix cache instead (cached)",
    ["kind"],
)
# Its series, looked up once: the engine counts every step (labels() costs ~1 us a call).
ENGINE_PROMPT_TOKENS = ENGINE_TOKENS.labels("prompt")
ENGINE_DECODE_TOKENS = ENGINE_TOKENS.labels("decode")
ENGINE_CACHED_TOKENS = ENGINE_TOKENS.labels("cached")
ENGINE_PREFIX_CACHE_TOKENS = Gauge(
    "disagg_engine_prefix_cache_tokens",
    "Embedded engine: prompt tokens the prefix cache holds (held), of them those kept "
    "outside the KV cache as states' bytes in host memory (stored), and the most it may "
    "hold (max)",
    ["state"],
)
ENGINE_STEP_SECONDS = Histogram(
    "disagg_engine_step_seconds",
    "Embedded engine: seconds per step of the batch loop (one llama_decode)",
    buckets=_SECONDS,
)

ENGINE_CORE_WAIT_SECONDS = Histogram(
    "disagg_engine_core_wait_seconds",
    "Embedded engine on a host shared with other engine nodes: seconds a step waited for "
    "the host's cores",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
)

# llm-d's model-server protocol reads these under vLLM's names (its endpoint picker weighs a
# node by them; vLLM's dashboards select by model_name): one series a logical model the node
# serves (a node listed under two models shows the same load under both).
VLLM_RUNNING = Gauge(
    "vllm:num_requests_running", "Requests in the engine's slots now", ["model_name"]
)
VLLM_WAITING = Gauge(
    "vllm:num_requests_waiting", "Requests waiting for an engine slot", ["model_name"]
)
VLLM_KV_CACHE_USAGE = Gauge(
    "vllm:kv_cache_usage_perc",
    "Share of the engine's KV cache holding tokens now (0-1; 0 where the engine cannot tell)",
    ["model_name"],
)


HEALTH_WATCHERS = Gauge(
    "disagg_health_watchers",
    "grpc.health.v1 Watch streams open on this node (each router holds one per node)",
)
HEALTH_CHECKS = Counter(
    "disagg_health_checks_total", "grpc.health.v1 Check calls answered by this node"
)
NODE_RESTARTS = Gauge(
    "disagg_node_restarts",
    "Times the launcher (make run) started this node again after it exited unasked",
)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(host: str, port: int, restarts: int) -> None:
    """/metrics on a thread of its own, always in Prometheus's text format: asked for
    OpenMetrics (as Prometheus 2 asks), prometheus-client writes vLLM's names with an
    underscore for the colon (vllm_num_requests_running), which llm-d and vLLM's dashboards
    would not find."""
    NODE_RESTARTS.set(restarts)  # the launcher's count (processes.restarts)
    app = make_wsgi_app()

    def text_format(environ: dict[str, Any], start_response: Any) -> Any:
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("_Server", (_Server,), {"address_family": family})
    server: WSGIServer = make_server(host, port, text_format, server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()


def watch_kv_store(size_bytes: Callable[[], float], handles: Callable[[], float]) -> None:
    KV_STORE_BYTES.set_function(size_bytes)
    KV_STORE_HANDLES.set_function(handles)


def watch_engine(load: Callable[[], EngineLoad | None], models: list[str]) -> None:
    """Read the engine's load (None while it is loading) whenever metrics are scraped;
    models: the logical models the node serves (vLLM's names carry them)."""

    def field(name: str) -> Callable[[], float]:
        return lambda: float(getattr(load(), name, 0.0))

    def kv_usage() -> float:
        now = load()
        if now is None or now.kv_cache_bytes <= 0:
            return 0.0
        return min(1.0, now.kv_cache_used_bytes / now.kv_cache_bytes)

    for model in models:
        VLLM_RUNNING.labels(model).set_function(field("slots_busy"))
        VLLM_WAITING.labels(model).set_function(field("queue_depth"))
        VLLM_KV_CACHE_USAGE.labels(model).set_function(kv_usage)

    ENGINE_SLOTS.set_function(field("slots"))
    ENGINE_SLOTS_BUSY.set_function(field("slots_busy"))
    ENGINE_QUEUE.set_function(field("queue_depth"))
    ENGINE_TOKENS_PER_SECOND.labels("prompt").set_function(field("prompt_tokens_per_second"))
    ENGINE_TOKENS_PER_SECOND.labels("decode").set_function(field("decode_tokens_per_second"))
    ENGINE_KV_CACHE_BYTES.labels("total").set_function(field("kv_cache_bytes"))
    ENGINE_KV_CACHE_BYTES.labels("used").set_function(field("kv_cache_used_bytes"))
    ENGINE_PREFIX_CACHE_TOKENS.labels("held").set_function(field("prefix_cache_tokens"))
    ENGINE_PREFIX_CACHE_TOKENS.labels("max").set_function(field("prefix_cache_max_tokens"))
    ENGINE_PREFIX_CACHE_TOKENS.labels("stored").set_function(field("prefix_cache_stored_tokens"))


def engine_cached(prompt_tokens: int) -> None:
    ENGINE_CACHED_TOKENS.inc(prompt_tokens)


def engine_core_wait(seconds: float) -> None:
    ENGINE_CORE_WAIT_SECONDS.observe(seconds)


def engine_step(seconds: float, prompt_tokens: int, decode_tokens: int) -> None:
    ENGINE_STEP_SECONDS.observe(seconds)
    if prompt_tokens:
        ENGINE_PROMPT_TOKENS.inc(prompt_tokens)
    if decode_tokens:
        ENGINE_DECODE_TOKENS.inc(decode_tokens)


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


def route_decision(model: str, method: str, basis: str) -> None:
    ROUTE_DECISIONS.labels(model, method, basis).inc()


def kv_bytes(model: str, moved: int, whole: int) -> None:
    KV_BYTES.labels(model, "moved").inc(moved)
    KV_BYTES.labels(model, "whole").inc(whole)


def request_failed(model: str, code: str) -> None:
    REQUESTS.labels(model, "none", code).inc()


def migration(model: str, code: str) -> None:
    MIGRATIONS.labels(model, code).inc()


def query_of_death(outcome: str) -> None:
    QUERIES_OF_DEATH.labels(outcome).inc()


def attempt_failed(model: str, method: str, code: str) -> None:
    FAILED_ATTEMPTS.labels(model, method, code).inc()
