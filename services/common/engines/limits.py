"""A node's own bounds on one request (`types.StageLimits`), as the engines apply them: first
the wait for its turn (a slot, the machine's compute), then its work, each counted from its
own start. A caller's stage deadline thus covers the node's work alone, whoever else sends
the node requests: the calls of other routers the caller cannot see are waited for, and
only a wait longer than queue_s is answered busy (no work was done, none is thrown away).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeGuard

from disagg_mesh.server.common.errors import DeadlineExceeded, MeshError, ResourceExhausted
from disagg_mesh.server.common.types import StageLimits


class LimitClock:
    """One request's bounds, counted from when it was handed to the engine (its wait) and
    from `admitted()` (its work)."""

    def __init__(self, limits: StageLimits | None, what: str, node: str = "") -> None:
        """what: the work, for messages ("prefill"); node: its name, where the engine
        knows it."""
        self._limits = limits or StageLimits()
        self._what = what
        self._node = f"node {node}" if node else "the node"
        self._queued_at = time.monotonic()
        self._admitted_at: float | None = None

    @property
    def bounded(self) -> bool:
        return self._limits.queue_s is not None or self._limits.work_s is not None

    def admitted(self) -> None:
        """The request's work begins: its wait ends, its work bound starts."""
        if self._admitted_at is None:
            self._admitted_at = time.monotonic()

    def left(self) -> float | None:
        """Seconds until the bound now running passes (None: none runs), never below 0."""
        if self._admitted_at is None:
            limit, since = self._limits.queue_s, self._queued_at
        else:
            limit, since = self._limits.work_s, self._admitted_at
        return None if limit is None else max(0.0, limit - (time.monotonic() - since))

    def expired(self) -> MeshError:
        """The error for the bound that passed: busy while waiting, a deadline once working."""
        if self._admitted_at is None:
            return ResourceExhausted(
                f"{self._node} is busy with other callers' requests: this {self._what} waited "
                f"its {self._limits.queue_s:g} s queue_timeout for its turn, nothing done "
                "for it yet; try later or another node"
            )
        return DeadlineExceeded(
            f"{self._node}: the {self._what} took longer than its {self._limits.work_s:g} s "
            "work_timeout (the stage deadline, counted from when its turn came)"
        )

    @asynccontextmanager
    async def bound(self) -> AsyncIterator[None]:
        """Run the body within the bound now running (its wait, or once admitted its work);
        the error for it when it passes."""
        timeout = asyncio.timeout(self.left())
        try:
            async with timeout:
                yield
        except TimeoutError:
            if timeout.expired():
                raise self.expired() from None
            raise

    def alarm(self, put: Callable[[MeshError], None]) -> BoundAlarm:
        """The running bound's passing as an event: see BoundAlarm."""
        return BoundAlarm(self, put)


class BoundAlarm:
    """A clock's running bound as one timer that puts its error among the request's events
    when it passes (`put`), for a stream read event by event: a timeout around each wait
    (`LimitClock.bound`) cost a timer and a context manager at every token. `arm()` when
    the request starts and again once admitted (the work bound replaces the wait's);
    `stale(event)` says an event is a replaced bound's error, to be skipped: the wait's
    bound may pass just after the admission was queued, as an event already queued came
    before a wait's timeout; `passed(event)` that it is the running bound's (the request's
    end). `cancel()` when the stream ends."""

    def __init__(self, clock: LimitClock, put: Callable[[MeshError], None]) -> None:
        self._clock = clock
        self._put = put
        self._timer: asyncio.TimerHandle | None = None
        self._rung: list[MeshError] = []
        self._current: MeshError | None = None

    def arm(self) -> None:
        self.cancel()
        self._current = None
        left = self._clock.left()
        if left is not None:
            self._timer = asyncio.get_running_loop().call_later(left, self._ring)

    def _ring(self) -> None:
        self._timer = None
        self._current = self._clock.expired()
        self._rung.append(self._current)
        self._put(self._current)

    def stale(self, event: object) -> bool:
        return event is not self._current and any(event is e for e in self._rung)

    def passed(self, event: object) -> TypeGuard[MeshError]:
        """Whether the event is the running bound's error (it passed)."""
        return self._current is not None and event is self._current

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
