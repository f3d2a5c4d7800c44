"""The engine worker: one call at a time, a bounded queue, RESOURCE_EXHAUSTED at once when
full, and an abandoned stream releases the engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from services.common.errors import ResourceExhausted
from services.common.worker import EngineWorker


async def test_a_full_node_answers_resource_exhausted_at_once() -> None:
    worker = EngineWorker("test", max_queue=1)
    release = threading.Event()
    running = asyncio.create_task(worker.call(lambda: release.wait(10)))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(worker.call(lambda: "second"))
    await asyncio.sleep(0.05)
    started = asyncio.get_running_loop().time()
    with pytest.raises(ResourceExhausted, match="1 requests already waiting"):
        await worker.call(lambda: "third")
    assert asyncio.get_running_loop().time() - started < 0.05  # at once, not queued
    release.set()
    assert await running is True and await queued == "second"
    worker.shutdown()


async def test_an_abandoned_stream_releases_the_engine() -> None:
    worker = EngineWorker("test", max_queue=1)
    stopped = threading.Event()

    def forever(cancel: threading.Event) -> Iterator[int]:
        i = 0
        try:
            while True:  # an endless generation: only the cancel flag ends it
                i += 1
                yield i
        finally:
            stopped.set()

    stream = worker.stream(forever)
    assert await anext(stream) == 1
    await stream.aclose()  # the caller went away
    # The thread stops at its next item and the engine is free again.
    assert await asyncio.wait_for(worker.call(lambda: "free again"), 5) == "free again"
    assert await asyncio.to_thread(stopped.wait, 5)
    worker.shutdown()
