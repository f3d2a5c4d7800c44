"""The prefill stage: a prefill node evaluates the prompt, samples the first token and keeps
the KV state for the decode node it chose (or the router planned)."""

from __future__ import annotations

import time

from disagg_mesh.server.common.config.topology import Node
from disagg_mesh.server.common.errors import MeshError, UpstreamError
from disagg_mesh.server.common.types import (
    Continuation,
    DecodeCandidate,
    KvSource,
    PrefillResult,
)
from disagg_mesh.server.router.failures import (
    StageDeadlineExceeded,
    attempt_failed,
    failed_call,
    free_slot,
    is_retryable,
    node_wait_s,
    watched,
)
from disagg_mesh.server.router.node_health import NodeHealth
from disagg_mesh.server.router.request import Attempt, Request
from disagg_mesh.server.router.retries import call_with_retries
from disagg_mesh.server.router.stages import NodeClients


class PrefillStage:
    def __init__(self, clients: NodeClients, health: NodeHealth) -> None:
        self._clients = clients
        self._health = health

    async def run(
        self, request: Request, attempt: Attempt, candidates: list[DecodeCandidate]
    ) -> PrefillResult:
        """The prefill stage with retries (tenacity): each call gets the stage deadline (or
        what is left of the caller's), and moves to the next of the attempt's prefill nodes.
        UNAVAILABLE and RESOURCE_EXHAUSTED are retried; so is the stage's own deadline, but
        only on a node that has not timed out in this request (a hung node would hang
        again). Every retried call is listed in request.failed; the summary gets the
        serving node's figures."""
        nodes = attempt.prefill_candidates
        timed_out: set[str] = set()

        async def call(number: int) -> PrefillResult:
            node = nodes[(number - 1) % len(nodes)]
            attempt.prefill = attempt.current = node
            attempt.started = time.perf_counter()
            try:
                return await self.call(request, node, candidates)
            except StageDeadlineExceeded:
                timed_out.add(node.name)
                raise

        def retryable(exc: BaseException) -> bool:
            if is_retryable(exc):
                return True
            if not isinstance(exc, StageDeadlineExceeded):  # the caller's own is final
                return False
            after = attempt.prefill
            following = nodes[(nodes.index(after) + 1) % len(nodes)] if after else None
            return following is not None and following.name not in timed_out

        def on_retry(exc: BaseException) -> None:
            assert isinstance(exc, MeshError)
            attempt_failed(self._health, request, attempt, exc)

        result = await call_with_retries(call, request.clock.remaining(), retryable, on_retry)
        node = attempt.prefill
        assert node is not None
        s = attempt.summary
        s.prefill_node, s.prefill_address = node.name, node.address
        s.prefill_seconds = result.prefill_seconds
        s.prompt_tokens = result.prompt_tokens
        s.cached_prompt_tokens = result.cached_prompt_tokens
        s.kv_state_bytes = result.kv_state_bytes
        return result

    async def call(
        self,
        request: Request,
        node: Node,
        candidates: list[DecodeCandidate],
        continuation: Continuation | None = None,
    ) -> PrefillResult:
        """One prefill call, once the node has a slot free of this router's calls
        (queue_budget_s). The node counts the stage deadline from when the prompt's turn
        comes, and answers busy (RESOURCE_EXHAUSTED, no blame) if other callers keep it from
        coming within node_wait_s; the call's own deadline is the two in turn (or what is
        left of the caller's)."""
        route = request.route
        await free_slot(self._health, request, node)
        stage_s = route.prefill_deadline_s
        bounds = request.clock.node_bounds(
            stage_s, node_wait_s(request, self._health.ahead_s(node), stage_s)
        )
        limits, timeout, _ = bounds
        client = self._clients.prefill(node.address)
        sent = time.monotonic()
        try:
            with self._health.busy(node, request.ident):
                call = client.prefill(
                    route.name,
                    request.prompt,
                    request.sampling,
                    timeout,
                    candidates,
                    continuation,
                    limits,
                )
                return await watched(self._health, node, "prefill", limits.work_s or timeout, call)
        except UpstreamError as exc:
            raise failed_call(exc, request, "prefill", node, sent, bounds, stage_s) from exc


def kv_source(prefill: Node, result: PrefillResult) -> KvSource:
    """Where the decode node pulls the state the prefill node kept."""
    return KvSource(prefill.address, result.reference)
