"""The event loop of a process of simulated nodes (#41): its timers wake on time, where
asyncio's own on Linux waits whole milliseconds, and it still hands over every ready
descriptor, however many the process has."""

from __future__ import annotations

import asyncio
import selectors
import socket
import statistics
import time
from collections.abc import Iterator

import pytest

from disagg_mesh.server import node
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.engines.sim import timers

linux_only = pytest.mark.skipif(not hasattr(selectors, "EpollSelector"), reason="epoll: Linux only")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _late_ms(loop: asyncio.AbstractEventLoop, wait_s: float, times: int = 60) -> float:
    """The median of how late `times` sleeps of wait_s end on this loop, in ms."""

    async def sleeps() -> list[float]:
        late = []
        for _ in range(times):
            began = time.perf_counter()
            await asyncio.sleep(wait_s)
            late.append(time.perf_counter() - began - wait_s)
        assert min(late) >= 0  # never early
        return late

    try:
        return 1000 * statistics.median(loop.run_until_complete(sleeps()))
    finally:
        loop.close()


@linux_only
def test_a_sim_process_timers_wake_within_a_fraction_of_a_millisecond() -> None:
    """0.3 ms waits: asyncio's epoll loop waits 1 ms each; the sim loop about 0.1. The two
    in the same run, so a slow machine slows both."""
    plain = _late_ms(asyncio.SelectorEventLoop(selectors.EpollSelector()), 0.0003)
    precise = _late_ms(timers.new_event_loop(), 0.0003)
    assert precise < plain / 2, (precise, plain)
    # Waits longer than a millisecond keep their fraction too.
    assert _late_ms(timers.new_event_loop(), 0.0023, times=20) < 0.6


@linux_only
@pytest.mark.parametrize("fd_setsize", [timers.FD_SETSIZE, 0])
def test_the_selector_hands_over_ready_descriptors_in_either_part_of_its_wait(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch, fd_setsize: int
) -> None:
    """Ready before the wait, or ready during its whole milliseconds (epoll) or during its
    rest (select(2) on the epoll descriptor). With the epoll descriptor past select(2)'s
    reach (fd_setsize 0 here), the selector waits as asyncio's does."""
    monkeypatch.setattr(timers, "FD_SETSIZE", fd_setsize)
    reader, writer = pair
    loop = timers.new_event_loop()
    assert isinstance(loop, asyncio.SelectorEventLoop)
    selector = loop._selector  # type: ignore[attr-defined]
    key = selector.register(reader, selectors.EVENT_READ)
    try:
        writer.send(b"x")
        for timeout in (0.0009, 0.0025, 5.0):  # the rest alone, both parts, whole ms
            began = time.perf_counter()
            ready = selector.select(timeout)
            assert ready == [(key, selectors.EVENT_READ)]
            assert time.perf_counter() - began < 0.5
        reader.recv(1)
        began = time.perf_counter()
        assert selector.select(0.0015) == []  # nothing ready: the whole timeout
        assert time.perf_counter() - began >= 0.0015
        selector.unregister(reader)

        # Ready while the loop waits on a timer: the reader runs first.
        seen: list[str] = []
        loop.add_reader(reader, lambda: seen.append(reader.recv(1).decode()))
        loop.call_later(0.2, seen.append, "timer")
        loop.call_later(0.02, writer.send, b"r")
        loop.run_until_complete(asyncio.sleep(0.25))
        assert seen == ["r", "timer"]
    finally:
        loop.close()


def test_only_a_process_of_sim_nodes_runs_on_the_sim_loop() -> None:
    seed = load_topology("topology/seed.toml")
    engines = [n for n in seed.nodes if n.role != "router"]
    sims = [n.model_copy(update={"engine": "sim"}) for n in engines]
    router = next(n for n in seed.nodes if n.role == "router")
    assert node._event_loop(sims) is timers.run
    assert node._event_loop(engines[:1]) is asyncio.run  # llama_cpp
    assert node._event_loop([router]) is asyncio.run


def test_the_sim_loop_runs_a_coroutine_to_its_result() -> None:
    async def answer() -> int:
        await asyncio.sleep(0.0005)
        return 42

    assert timers.run(answer()) == 42
