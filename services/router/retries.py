"""The retry policy for the router's calls to nodes (tenacity), in one place.

Only codes that say "try again" are retried (AIP-194; failures.py's table): UNAVAILABLE
(node down or still loading) and RESOURCE_EXHAUSTED (node busy); a caller may add its own
(the prefill stage adds its own DEADLINE_EXCEEDED when another node can take the retry).
Never INVALID_ARGUMENT, NOT_FOUND, CANCELLED or DATA_LOSS. Attempts and waits stay inside
the budget the caller gives, itself inside the request's deadline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
    wait_exponential_jitter,
)

from disagg_mesh.server.router.failures import is_retryable

T = TypeVar("T")
ATTEMPTS = 3

log = structlog.get_logger("retry")


async def call_with_retries(
    fn: Callable[[int], Awaitable[T]],
    budget_s: float | None,
    retryable: Callable[[BaseException], bool] = is_retryable,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Call fn(attempt_number) (1, 2, …) until it succeeds, fails for good, ATTEMPTS are
    made or budget_s (None: no limit but the attempts) is spent. on_retry(error) is called
    for each failure that is retried, before the backoff."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("retrying", attempt=state.attempt_number, error=str(exc))
        if on_retry is not None and exc is not None:
            on_retry(exc)

    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(ATTEMPTS)
        | (stop_never if budget_s is None else stop_after_delay(budget_s * 0.9)),
        wait=wait_exponential_jitter(multiplier=0.1, max=1.0, jitter=0.1),
        retry=retry_if_exception(retryable),
        before_sleep=before_sleep,
        reraise=True,
    ):
        with attempt:
            return await fn(attempt.retry_state.attempt_number)
    raise AssertionError("unreachable: tenacity reraises the last error")
