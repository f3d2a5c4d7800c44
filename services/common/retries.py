"""The retry policy for calls between nodes (tenacity), in one place.

Only codes that say "try again" are retried (AIP-194): UNAVAILABLE (node down or still
loading) and RESOURCE_EXHAUSTED (node busy). Never INVALID_ARGUMENT, NOT_FOUND, CANCELLED
or DATA_LOSS. Attempts and waits stay inside the time the caller gave the stage.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from services.common.errors import UpstreamError

T = TypeVar("T")
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
ATTEMPTS = 3

log = structlog.get_logger("retry")


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, UpstreamError) and exc.code in RETRYABLE


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning("retrying", attempt=state.attempt_number, error=str(exc))


async def call_with_retries(fn: Callable[[float], Awaitable[T]], budget_s: float) -> T:
    """Call fn(timeout_s) until it succeeds, fails for good, or budget_s is spent; each
    attempt gets what is left of the budget as its timeout."""
    loop_start = time.monotonic()
    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(ATTEMPTS) | stop_after_delay(budget_s * 0.9),
        wait=wait_exponential_jitter(initial=0.1, max=1.0, jitter=0.1),
        retry=retry_if_exception(_retryable),
        before_sleep=_log_retry,
        reraise=True,
    ):
        with attempt:
            return await fn(max(budget_s - (time.monotonic() - loop_start), 0.001))
    raise AssertionError("unreachable: tenacity reraises the last error")
