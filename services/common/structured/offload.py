"""Work on a caller's schema or grammar, off the event loop, on threads with a large stack,
within a time budget.

llama.cpp's grammar parser and its left-recursion check recurse once per nesting level, and
a thread's default stack (8 MiB here) overflows at ~20,000 levels: the process dies of
SIGSEGV. The limits (`SchemaLimits`) keep grammars far below that; these threads are the
second line, where a deeper grammar is refused by llama.cpp's own checks instead of
overflowing (measured: 100,000 nested groups refused in 0.15 s on a 256 MiB stack, SIGSEGV on
the default one). Their stacks are virtual memory: only the pages used are ever touched.

A task over its budget is refused to its caller at once (`OverBudget`); the thread itself
cannot be stopped and finishes in the background, so the pool starts another thread for the
next task rather than queue it behind one that overran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

STACK_BYTES = 256 << 20
# Threads kept waiting for work; more start while tasks overrun, and end when idle.
IDLE_THREADS = 2

_Task = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class OverBudget(Exception):
    """A task ran past its time budget (it goes on in the background; its result is lost)."""


class _Pool:
    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._idle == 0:
                self._start_thread()
            else:
                self._idle -= 1
        self._tasks.put((future, fn))
        return future

    def _start_thread(self) -> None:
        self._started += 1
        thread = threading.Thread(
            target=self._work, name=f"schema-worker-{self._started}", daemon=True
        )
        start_on_large_stack(thread)

    def _work(self) -> None:
        while True:
            future, fn = self._tasks.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
            with self._lock:
                if self._idle >= IDLE_THREADS:
                    return
                self._idle += 1


def start_on_large_stack(thread: threading.Thread) -> None:
    """Start the thread with a STACK_BYTES stack (the size is taken when a thread starts):
    the schema workers, and the engine's step loop, whose grammar samplers recurse."""
    with _STACK_SIZE:
        old = threading.stack_size(STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(old)


# threading.stack_size is process-wide: set it and create the thread under one lock.
_STACK_SIZE = threading.Lock()
_POOL = _Pool()


async def off_loop(fn: Callable[[], T], budget_s: float) -> T:
    """fn() on a large-stack thread; OverBudget if it takes longer than budget_s."""
    future = asyncio.wrap_future(_POOL.submit(fn))
    try:
        return await asyncio.wait_for(asyncio.shield(future), budget_s)
    except TimeoutError:
        raise OverBudget(f"took longer than its {budget_s:g} s budget") from None
