"""What the router does after a failure, in one table: per gRPC status code, whether the
chain stops, the node is set aside, the prefill call is retried, and a generation that
already sent text moves to another decode node.

Two deadlines differ: a stage's own (`StageDeadlineExceeded`: that node is slow or hung,
another may answer) and the caller's (`CallerDeadlineExceeded`: nothing further is tried).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog

from disagg_mesh.server.common.config.topology import ModelRoute, Node
from disagg_mesh.server.common.errors import (
    DeadlineExceeded,
    MeshError,
    ResourceExhausted,
    UpstreamError,
)
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.runtime.server import retrieved
from disagg_mesh.server.common.types import StageLimits
from disagg_mesh.server.router.deaths import QueryOfDeath, dropped
from disagg_mesh.server.router.node_health import (
    CHECK_TIMEOUT_S,
    STAGE_SHARE,
    NodeHealth,
    Overloaded,
)
from disagg_mesh.server.router.request import Attempt, Request
from disagg_mesh.server.router.summary import FailedAttempt

log = structlog.get_logger("router")
T = TypeVar("T")
E = TypeVar("E")
# The least a node may hold a call before its turn (node_wait_s): an engine admits between
# passes, and a pass of a long prompt's piece takes about a second on a small CPU.
MIN_NODE_WAIT_S = 1.0


@dataclass(frozen=True)
class FailureClass:
    # The request itself is wrong, or the caller gave up: another node would answer the
    # same, so the chain stops there.
    final: bool = False
    # The node itself is in trouble: it is skipped for a cool-down.
    node_trouble: bool = False
    # Worth calling again (the prefill stage, with tenacity; AIP-194).
    retry: bool = False
    # After text was delivered, another decode node takes the generation over.
    migrate: bool = False


FINAL = FailureClass(final=True)
NODE_TROUBLE = FailureClass(node_trouble=True, migrate=True)
# Codes not listed: the next attempt, with no blame (NOT_FOUND, FAILED_PRECONDITION,
# ABORTED (the prefill is redone first), UNIMPLEMENTED, ...).
OTHER = FailureClass()

TABLE: dict[grpc.StatusCode, FailureClass] = {
    grpc.StatusCode.INVALID_ARGUMENT: FINAL,
    grpc.StatusCode.CANCELLED: FINAL,
    grpc.StatusCode.OUT_OF_RANGE: FINAL,
    grpc.StatusCode.UNAUTHENTICATED: FINAL,
    grpc.StatusCode.PERMISSION_DENIED: FINAL,
    # Down or still loading: retried, and the node cools down.
    grpc.StatusCode.UNAVAILABLE: FailureClass(node_trouble=True, retry=True, migrate=True),
    # A stage's own deadline: retried on another node only (the prefill stage decides).
    grpc.StatusCode.DEADLINE_EXCEEDED: NODE_TROUBLE,
    grpc.StatusCode.INTERNAL: NODE_TROUBLE,
    grpc.StatusCode.UNKNOWN: NODE_TROUBLE,
    grpc.StatusCode.DATA_LOSS: NODE_TROUBLE,
    # Busy (queue full, out of KV cells): retried, no blame.
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureClass(retry=True, migrate=True),
}


def classify(exc: MeshError) -> FailureClass:
    return TABLE.get(exc.code, OTHER)


class StageDeadlineExceeded(DeadlineExceeded):
    """A stage's own deadline passed: the node is slow or hung; another may answer."""


class CallerDeadlineExceeded(DeadlineExceeded):
    """The caller's own deadline ran out: nothing further is tried."""


def is_final(exc: MeshError) -> bool:
    """The chain stops: another node would answer the same, or no time is left, or two
    nodes died holding the request."""
    return classify(exc).final or isinstance(exc, CallerDeadlineExceeded | QueryOfDeath)


def blames_node(exc: MeshError) -> bool:
    """The node that answered so is set aside for a cool-down (not for the caller's
    deadline: the node was not at fault)."""
    return classify(exc).node_trouble and not isinstance(exc, CallerDeadlineExceeded)


def can_migrate(exc: MeshError) -> bool:
    return classify(exc).migrate and not isinstance(exc, CallerDeadlineExceeded)


def is_retryable(exc: BaseException) -> bool:
    """A node's answer that says "try again" (never a deadline: the stage decides those)."""
    return isinstance(exc, UpstreamError) and classify(exc).retry


def stage_error(
    exc: UpstreamError, stage: str, node: Node, timeout: float, caller_bound: bool
) -> MeshError:
    """A stage's failed call, its deadline told apart: the stage's or the caller's."""
    if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        return exc
    where = f"{stage} stage on node {node.name} ({node.address})"
    if caller_bound:
        return CallerDeadlineExceeded(
            f"{where} ran out of time: the caller's deadline passed "
            f"({timeout:.3f} s were left when the stage began)"
        )
    return StageDeadlineExceeded(
        f"{where} ran out of time: its {timeout:g} s stage deadline passed"
    )


async def free_slot(health: NodeHealth, request: Request, node: Node) -> None:
    """Wait, within the request's queue budget and the caller's deadline, until the node has
    a free slot: the stage deadline then covers the node's work only. RESOURCE_EXHAUSTED
    past the budget (retried elsewhere, no blame), or at once where the node's pace says it
    would pass (not once work was done for the request: see Request.queued_s); the caller's
    deadline is final."""
    remaining = request.clock.remaining()
    budget = request.queue_left()
    with _queued(request):
        if remaining is not None and remaining < budget:
            try:
                await health.free_slot(node, remaining, and_serve=True)
            except Overloaded:  # refused at once: the caller may try again later
                raise
            except ResourceExhausted:
                raise CallerDeadlineExceeded(
                    f"the caller's deadline passed while waiting for a free slot of node "
                    f"{node.name} ({remaining:.3f} s were left)"
                ) from None
            return
        await health.free_slot(
            node,
            budget,
            refuse_early=not request.work_done,
            queue_budget_s=request.route.queue_budget_s,
            stage_s=request.route.prefill_deadline_s
            if node.role == "prefill"
            else request.route.decode_deadline_s,
        )


def node_wait_s(request: Request, ahead_s: float, stage_s: float) -> float:
    """How long a node may hold a call before its work begins (the node counts it: a call
    sent once the node had a slot free of this router's calls may still wait there for other
    routers' calls): what is left of the request's queue budget, plus the wait for this
    router's own calls on the node at its pace (ahead_s: it sent the call to wait for them,
    `NodeHealth._open`), twice over for prompts slower than the pace (1 / STAGE_SHARE); at
    least the stage deadline (never stricter than when the stage deadline covered the wait
    too: a busy answer sends the request on down its chain) and MIN_NODE_WAIT_S. A node
    whose engine hangs answers its work bound itself; one that cannot answer at all,
    `watched` finds."""
    return max(MIN_NODE_WAIT_S, stage_s, request.queue_left() + ahead_s / STAGE_SHARE)


def failed_call(
    exc: UpstreamError,
    request: Request,
    stage: str,
    node: Node,
    sent: float,
    bounds: tuple[StageLimits, float, bool],
    stage_s: float,
) -> MeshError:
    """A stage's node call that failed (sent at `sent`, with node_bounds's `bounds`): a
    busy answer's wait is drawn from the queue budget (nothing was done), and the error
    says whose deadline passed (stage_error)."""
    limits, timeout, caller_bound = bounds
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not request.work_done:
        request.queued_s += time.monotonic() - sent
    caller_bound = caller_bound and request.clock.caller_ended(limits, stage_s)
    return stage_error(exc, stage, node, timeout, caller_bound)


async def watched(
    health: NodeHealth, node: Node, stage: str, stage_s: float, call: Awaitable[T]
) -> T:
    """The call's result. The node counts the call's wait and its work itself, and answers
    when either bound passes, so the call's own deadline (the two in turn) may be long: from
    CHECK_TIMEOUT_S before the stage deadline, and every stage deadline after, the node is
    asked whether it answers at all. One that does not answer a health check within
    CHECK_TIMEOUT_S is hung, and the call ends then (StageDeadlineExceeded), as it did when
    the stage deadline was the call's."""
    task = asyncio.ensure_future(call)
    try:
        delay = max(stage_s - CHECK_TIMEOUT_S, 0.0)
        while True:
            done, _ = await asyncio.wait({task}, timeout=delay)
            if done:
                return task.result()
            if not await health.answers(node):
                raise _hung(stage, node, stage_s)
            delay = stage_s
    finally:
        if not task.done():
            task.cancel()
        # Let go, however it ends (it may have ended as this call was cancelled).
        task.add_done_callback(retrieved)


async def watched_events(
    health: NodeHealth, node: Node, stage: str, stage_s: float, events: AsyncIterator[E]
) -> AsyncGenerator[E, None]:
    """A stream's events, relayed, watched as `watched` watches a call: while the stream
    waits for the node's next event, from CHECK_TIMEOUT_S before the stage deadline and
    every stage deadline after, the node is asked whether it answers at all; one that does
    not is hung, and the wait ends (StageDeadlineExceeded). No task an event: the watch is
    one task for the stream, which cancels the wait it found hung."""
    waiting: asyncio.Task[Any] | None = None
    hung = False

    async def watch() -> None:
        nonlocal hung
        delay = max(stage_s - CHECK_TIMEOUT_S, 0.0)
        while True:
            await asyncio.sleep(delay)
            delay = stage_s
            if waiting is not None and not await health.answers(node) and waiting is not None:
                hung = True
                waiting.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        while True:
            waiting = asyncio.current_task()
            try:
                event = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if hung and task is not None and task.uncancel() == 0:
                    raise _hung(stage, node, stage_s) from None
                raise
            finally:
                waiting = None
            yield event
    finally:
        watcher.cancel()


def _hung(stage: str, node: Node, stage_s: float) -> StageDeadlineExceeded:
    return StageDeadlineExceeded(
        f"{stage} stage on node {node.name} ({node.address}) ran out of time: its {stage_s:g} s "
        f"stage deadline passed and the node did not answer a health check within "
        f"{CHECK_TIMEOUT_S:g} s (hung)"
    )


@asynccontextmanager
async def decode_room(health: NodeHealth, request: Request, node: Node) -> AsyncIterator[None]:
    """Room on the decode node for the state the prefill stage makes (NodeHealth's
    wait_for_room), within the request's queue budget and the caller's deadline."""
    remaining = request.clock.remaining()
    budget = request.queue_left() if remaining is None else min(request.queue_left(), remaining)
    with _queued(request):
        await health.wait_for_room(node, budget, request.route.queue_budget_s)
    try:
        yield
    finally:
        health.leave_room(node)


@contextmanager
def _queued(request: Request) -> Iterator[None]:
    """Count the time waited against the request's queue budget (before work was done)."""
    started, counts = time.monotonic(), not request.work_done
    try:
        yield
    finally:
        if counts:
            request.queued_s += time.monotonic() - started


def midstream_error(exc: MeshError, node: str, delivered: int, migrations: int) -> MeshError:
    """A generation that sent text and that no node could take over."""
    moved = f" after {migrations} migrations" if migrations else ""
    return UpstreamError(
        exc.code,
        f"{exc.message} — failed on {node}{moved} after {delivered} text deltas were "
        "delivered; no node could take the generation over, and no text is sent twice",
    )


def blame(health: NodeHealth, attempt: Attempt, exc: MeshError) -> None:
    """Set the node the attempt was calling aside for a cool-down, if it was at fault."""
    if attempt.current is not None and blames_node(exc):
        health.failed(attempt.current)


def attempt_failed(health: NodeHealth, request: Request, attempt: Attempt, exc: MeshError) -> None:
    """A failure before any text was sent: blame the node, count it, list it. A node that
    died holding the request for the second time ends it (QueryOfDeath, deaths.py)."""
    blame(health, attempt, exc)
    request.failed.append(attempt.failure(exc))
    if dropped(exc) and attempt.current is not None:
        health.deaths.died(request.deaths, attempt.current.name, request.ident, request.fingerprint)
    metrics.attempt_failed(request.route.name, attempt.method.value, exc.code.name)
    log.warning(
        "attempt failed, trying the next",
        method=attempt.method.value,
        node=attempt.blamed,
        code=exc.code.name,
        error=exc.message,
    )


def exhausted(route: ModelRoute, failed: list[FailedAttempt], last: MeshError | None) -> MeshError:
    """Every step of the chain failed before sending text: each attempt, in one message."""
    tried = "; ".join(
        f"{f.method.value}{' on ' + f.node if f.node else ''}: {f.code} {f.message}" for f in failed
    )
    code = last.code if last is not None else grpc.StatusCode.UNAVAILABLE
    error = UpstreamError(code, f"every step of {route.name}'s chain failed: {tried}")
    error.retry_after_s = last.retry_after_s if last is not None else None
    return error
