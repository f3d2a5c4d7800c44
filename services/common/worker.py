"""Runs blocking engine calls on one dedicated thread, off the event loop.

An engine is not thread-safe, so each node has exactly one `EngineWorker`. Callers wait
their turn; when `max_queue` callers are already waiting, a new one gets RESOURCE_EXHAUSTED
at once instead of queueing without bound. A streamed job stops at its next item when the
caller goes away (cancelled RPC), so an abandoned stream never keeps the engine busy.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.common.errors import ResourceExhausted

T = TypeVar("T")
_DONE = object()


class EngineWorker:
    def __init__(self, name: str, max_queue: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{name}")
        self._max_queue = max_queue
        self._lock = asyncio.Lock()
        self._waiting = 0

    async def _admit(self) -> None:
        if self._lock.locked() and self._waiting >= self._max_queue:
            raise ResourceExhausted(
                f"node busy: {self._waiting} requests already waiting for the engine; retry later"
            )
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread and return its result."""
        await self._admit()
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        except BaseException:
            self._lock.release()
            raise
        try:
            # Shielded: once started, the call finishes before the engine is released.
            return await asyncio.shield(future)
        finally:
            self._release_after(future)

    def _release_after(self, future: asyncio.Future[T] | asyncio.Future[None]) -> None:
        if future.done():
            self._lock.release()
        else:
            future.add_done_callback(lambda _: self._lock.release())

    async def stream(
        self, make: Callable[[threading.Event], Iterator[T]]
    ) -> AsyncGenerator[T, None]:
        """Iterate make(cancel) on the engine thread, handing each item to the caller as it
        comes. If the caller stops early, cancel is set and the thread stops."""
        await self._admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancel = threading.Event()

        def run() -> None:
            try:
                for item in make(cancel):
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                    if cancel.is_set():
                        break
            except BaseException as exc:  # handed to the caller, raised there
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        future = loop.run_in_executor(self._executor, run)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            cancel.set()
            self._release_after(future)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
