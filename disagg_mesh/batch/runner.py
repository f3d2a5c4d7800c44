"""Running a batch: every request through a router's HTTP door, so each answer is exactly
what that endpoint answers one request with.

- **Routers.** The doors of every router the client knows (ListModels says where each one's
  is), tried in order; a router that cannot be reached is set aside for the client's
  cooldown and the request goes to the next. A request is whole or nothing (no stream), so
  one cut off with its router is sent again, whole, elsewhere.
- **Retries.** A busy or unreachable mesh (HTTP 429, 502, 503, or no connection) is tried
  again with backoff (tenacity), ATTEMPTS times; any other answer is the request's result,
  errors included.
- **Order.** Requests whose prompts share a long start (the grader's rubric) form a group:
  its first request runs, and the others wait for it, so the prefill node's prefix cache
  holds the shared part when they come (`plan`). Models alternate, so both pipelines work,
  and each model has its own number at once (`model_concurrency`: by default its decode
  nodes' free slots), so the slower model's requests cannot fill every place while the
  other model's nodes idle.
- **Checking first.** `validate` sends every body with the door's dry-run header: the router
  checks it as it would serve it (fields, model, prompt, sampling) and runs nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from itertools import zip_longest
from typing import Any

import aiohttp
import grpc
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from disagg_mesh.batch.requests import BatchInputError, BatchRequest
from disagg_mesh.batch.results import BatchResult
from disagg_mesh.errors import Unavailable
from disagg_mesh.routers import Routers

DRY_RUN_HEADER = "X-Disagg-Dry-Run"  # services/router/http/common.py reads it
ATTEMPTS = 6
RETRIED_STATUSES = frozenset({429, 502, 503})
# Two prompts sharing at least this many characters at their start share a group.
MIN_SHARED_CHARS = 256
VALIDATE_AT_ONCE = 16


class _Retry(Exception):
    """An attempt worth making again; `result` is what is recorded if none is left."""

    def __init__(self, result: BatchResult, retry_after_s: float = 0.0) -> None:
        super().__init__(result.message)
        self.result = result
        # What the router's Retry-After said (0: nothing).
        self.retry_after_s = retry_after_s


_BACKOFF = wait_exponential_jitter(multiplier=0.5, max=8.0, jitter=0.5)


def _wait(state: RetryCallState) -> float:
    """The backoff, or longer when the router's Retry-After says so."""
    exc = state.outcome.exception() if state.outcome else None
    said = exc.retry_after_s if isinstance(exc, _Retry) else 0.0
    return max(_BACKOFF(state), said)


def plan(requests: Sequence[BatchRequest]) -> list[tuple[BatchRequest, str | None]]:
    """The order to send requests in, each with the custom_id of the request it waits for
    (its group's first) or None. Per model, prompts sorted so shared starts sit together;
    then the models' lists interleaved."""
    by_model: dict[str, list[BatchRequest]] = {}
    for r in requests:
        by_model.setdefault(r.model, []).append(r)
    lanes: list[list[tuple[BatchRequest, str | None]]] = []
    for model_requests in by_model.values():
        keyed = sorted(((r.prompt_key(), r) for r in model_requests), key=lambda kr: kr[0])
        lane: list[tuple[BatchRequest, str | None]] = []
        leader_key, leader = "", ""
        for key, r in keyed:
            # Characters in common, as wanted here (these are prompts, not paths).
            shared = len(os.path.commonprefix([key, leader_key]))  # noqa: RUF071
            if leader and shared >= MIN_SHARED_CHARS:
                lane.append((r, leader))
            else:
                leader_key, leader = key, r.custom_id
                lane.append((r, None))
        lanes.append(lane)
    return [item for row in zip_longest(*lanes) for item in row if item is not None]


class Turns:
    """When each request of a plan may go: after the request it waits for (its group's
    first), within its model's number at once (else the shared number). `disagg batch`
    sends by it, and `disagg simulate`'s Ollama baseline sends the same way."""

    def __init__(
        self,
        custom_ids: Iterable[str],
        concurrency: int,
        model_concurrency: Mapping[str, int] | None = None,
    ) -> None:
        self._finished = {custom_id: asyncio.Event() for custom_id in custom_ids}
        self._shared = asyncio.Semaphore(max(concurrency, 1))
        self._gates = {
            m: asyncio.Semaphore(max(n, 1)) for m, n in (model_concurrency or {}).items()
        }

    @asynccontextmanager
    async def turn(self, custom_id: str, model: str, after: str | None) -> AsyncIterator[None]:
        """Its turn, held while inside; the requests waiting for it go once it is over
        (whatever became of it)."""
        try:
            if after is not None:
                await self._finished[after].wait()
            async with self._gates.get(model, self._shared):
                yield
        finally:
            self._finished[custom_id].set()


class BatchRun:
    """One batch through the routers' doors. `in_flight` is how many requests are being
    answered now (for a progress display)."""

    def __init__(
        self,
        requests: Sequence[BatchRequest],
        doors: Routers,
        concurrency: int,
        *,
        headers: dict[str, str],
        ssl_context: ssl.SSLContext | None,
        timeout_s: float,
        group_prefixes: bool = True,
        model_concurrency: Mapping[str, int] | None = None,
    ) -> None:
        self.requests = list(requests)
        self.concurrency = max(concurrency, 1)
        # Requests at once per model (a model not named here shares `concurrency`).
        self.model_concurrency = dict(model_concurrency or {})
        self.in_flight = 0
        self._doors = doors
        self._headers = headers
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._timeout_s = timeout_s
        self._group = group_prefixes

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            timeout=self._timeout,
            connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl),
        )

    async def validate(self) -> None:
        """Every request checked by a router without running (BatchInputError listing each
        line it refused, with the router's message naming the field or model)."""
        problems: list[tuple[int, str]] = []
        gate = asyncio.Semaphore(VALIDATE_AT_ONCE)

        async def check(session: aiohttp.ClientSession, r: BatchRequest) -> None:
            async with gate:
                got = await self._send(session, r, dry_run=True)
            if got.error is not None:
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, got.message, "batch dry run")
            if not got.ok:
                problems.append((r.line, f"{r.where()} ({r.custom_id}): {got.message}"))

        async with self._session() as session:
            await asyncio.gather(*(check(session, r) for r in self.requests))
        if problems:
            raise BatchInputError([p for _, p in sorted(problems)])

    async def results(self) -> AsyncIterator[BatchResult]:
        """Each request's result as it completes. Stopping early (break, cancel) cancels
        what is in flight: those requests have no result."""
        order = plan(self.requests) if self._group else [(r, None) for r in self.requests]
        turns = Turns(
            (r.custom_id for r in self.requests), self.concurrency, self.model_concurrency
        )
        out: asyncio.Queue[BatchResult] = asyncio.Queue()

        async def one(session: aiohttp.ClientSession, r: BatchRequest, after: str | None) -> None:
            async with turns.turn(r.custom_id, r.model, after):
                self.in_flight += 1
                try:
                    out.put_nowait(await self._send(session, r))
                finally:
                    self.in_flight -= 1

        async with self._session() as session:
            tasks = [asyncio.create_task(one(session, r, after)) for r, after in order]
            try:
                for _ in tasks:
                    yield await out.get()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(
        self, session: aiohttp.ClientSession, r: BatchRequest, dry_run: bool = False
    ) -> BatchResult:
        started = time.monotonic()
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(ATTEMPTS),
                wait=_wait,
                retry=retry_if_exception_type(_Retry),
                reraise=True,
            ):
                with attempt:
                    return await self._post(session, r, started, dry_run)
        except _Retry as exc:
            return exc.result
        raise AssertionError("unreachable: tenacity returns or raises")

    async def _post(
        self, session: aiohttp.ClientSession, r: BatchRequest, started: float, dry_run: bool
    ) -> BatchResult:
        url = self._doors.order()[0]
        headers = {**self._headers, **({DRY_RUN_HEADER: "1"} if dry_run else {})}

        def result(status: int, body: Any, request_id: str = "", **error: str) -> BatchResult:
            return BatchResult(
                custom_id=r.custom_id,
                model=r.model,
                status_code=status,
                body=body,
                request_id=request_id,
                error=error or None,
                latency_s=time.monotonic() - started,
            )

        try:
            async with session.post(url + r.url, json=r.http_body(), headers=headers) as got:
                text = await got.text()
                request_id = got.headers.get("X-Request-Id", "")
                status = got.status
                retry_after = got.headers.get("Retry-After", "")
        except TimeoutError:
            return result(
                0,
                None,
                code="deadline_exceeded",
                message=f"no answer from {url} within {self._timeout_s:g} s (--timeout)",
            )
        except aiohttp.ClientError as exc:  # cannot connect, or the router went away
            self._doors.failed(url)
            raise _Retry(
                result(0, None, code="unavailable", message=f"router {url}: {exc}")
            ) from None
        self._doors.succeeded(url)
        try:
            body = json.loads(text)
        except ValueError:
            body = {"error": text[:500]}
        if not isinstance(body, dict):
            body = {"error": f"not a JSON object: {text[:200]}"}
        answer = result(status, body, request_id)
        if status in RETRIED_STATUSES:
            raise _Retry(answer, float(retry_after) if retry_after.isdigit() else 0.0)
        return answer
