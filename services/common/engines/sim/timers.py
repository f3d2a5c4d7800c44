"""An event loop whose timers wake on time, for processes of simulated nodes.

A simulated node's time is the event loop's timers: a prompt's evaluation, a state's trip
over the link and each decode step are waits of the profile's seconds / speedup, often
under a millisecond at speedup 20. asyncio's selector on Linux waits in `epoll_wait`,
whose timeout is in whole milliseconds, rounded up: a 0.1 ms wait took 1.0 ms here, a 0.5
ms one 1.1 ms and a 3.1 ms one 4.1 ms (2-core AMD EPYC, medians of 200). The simulated
machines then ran slower than their profiles, and `bench.scale` counted the difference as
the mesh's added latency. This loop waits the whole milliseconds in `epoll_wait` and the
rest in `select(2)` on the epoll descriptor itself (microseconds): 0.09-0.18 ms late for
the same waits, and the descriptors still in epoll, however many.
"""

from __future__ import annotations

import asyncio
import math
import select
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# select(2) takes descriptors below FD_SETSIZE only; the epoll descriptor is made with the
# loop, at a process's start, so it is far below.
FD_SETSIZE = 1024


class _PreciseEpollSelector(selectors.DefaultSelector):
    """Linux's DefaultSelector, EpollSelector, whose timeouts end within a fraction of a
    millisecond (as simulation/clock.py's virtual clock subclasses it)."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0 or self.fileno() >= FD_SETSIZE:
            return super().select(timeout)
        whole_ms = math.floor(timeout * 1e3)
        if whole_ms:
            # (whole_ms - 0.5) ms: EpollSelector rounds up to whole_ms exactly.
            ready = super().select((whole_ms - 0.5) / 1e3)
            if ready:
                return ready
        rest = timeout - whole_ms / 1e3
        if rest > 0:
            select.select([self.fileno()], [], [], rest)  # readable once an event is ready
        return super().select(0)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A loop for a process whose nodes are all simulated (asyncio.Runner's loop_factory).
    Where the platform has no epoll (macOS: kqueue, whose timeouts are in nanoseconds),
    asyncio's own."""
    if selectors.DefaultSelector is not getattr(selectors, "EpollSelector", None):
        return asyncio.new_event_loop()
    return asyncio.SelectorEventLoop(_PreciseEpollSelector())


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on new_event_loop()."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
