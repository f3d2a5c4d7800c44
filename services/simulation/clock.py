"""An asyncio event loop on a virtual clock: a sleep of any length takes no real time, the
clock jumping to the next timer whenever every task waits. Code written for the real loop
(asyncio.sleep, futures, locks, loop.time()) runs on it unchanged, and a simulation that
needs no sockets (the Ollama baseline) runs as fast as the CPU allows, its times exact."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _InstantSelector(selectors.DefaultSelector):
    """Waits no real time: the loop's clock moves on by the timeout asked for instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("virtual clock: every task waits and no timer is set")
        self.now += timeout
        return super().select(0)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._instant = _InstantSelector()
        super().__init__(self._instant)

    def time(self) -> float:
        return self._instant.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, on a virtual clock starting at 0."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
