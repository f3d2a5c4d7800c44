"""A node's own bounds on one request (`types.StageLimits`), as the engines apply them: first
the wait for its turn (a slot, the machine's compute), then its work, each counted from its
own start. A caller's stage deadline thus covers the node's work alone, whoever else sends
the node requests: the calls of other routers the caller cannot see are waited for, and
only a wait longer than queue_s is answered busy (no work was done, none is thrown away).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
