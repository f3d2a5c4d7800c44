"""Benchmark: what an open dashboard costs the router (#40).

    python -m bench.dashboard [--repeats 3] [--requests 40]

Starts a mesh of its own (a router with its HTTP door, a prefill and a decode node, two
logical models), then, in turns, `--requests` streamed requests through the OpenAI door one
after another (both models in turn, 16 greedy tokens) with the dashboard closed, and the
same with it open and streaming: a page's worth of clients, one fetching /api/dashboard
(the state and its hour of history) and reading /api/dashboard/events as a page does, plus
one GET /api/dashboard a second as a script might. Each turn is measured by the router
process's own CPU time per request (user + system, /proc) and each request's time to first
token; the turns alternate `--repeats` times each, medians reported:

21. dashboard open / closed: the router's CPU per request and the TTFT p50 (goal <= 1.05x).

The router samples the mesh every 2 s either way (the page's history must be there when a
page opens); what an open page adds is its feed and its reads. Writes JSON to bench/results/
when run alone; `make bench` (bench/run.py) runs it as row 21.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import psutil

from bench.common import median, run_alone, say, small_mesh
from disagg_mesh.server.common.runtime.processes import serving_mesh

GOAL = 1.05
MODELS = ("code", "feedback")


async def _ttft(http: httpx.AsyncClient, model: str, i: int) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Grade submission {i}: print({i})"}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - started
    assert first is not None
    return first


@contextlib.asynccontextmanager
async def open_page(base: str) -> AsyncIterator[list[int]]:
    """A page's traffic while the block runs: the state once, its event stream read as it
    comes, and a script's GET /api/dashboard a second. Yields the count of events read."""
    events = [0]

    async def follow(http: httpx.AsyncClient) -> None:
        (await http.get("/api/dashboard")).raise_for_status()
        async with http.stream("GET", "/api/dashboard/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("event: update"):
                    events[0] += 1

    async def poll(http: httpx.AsyncClient) -> None:
        while True:
            (await http.get("/api/dashboard")).raise_for_status()
            await asyncio.sleep(1.0)

    async with httpx.AsyncClient(base_url=base, timeout=None) as http:
        tasks = [asyncio.create_task(follow(http)), asyncio.create_task(poll(http))]
        await asyncio.sleep(2.5)  # connected, and a first update read
        try:
            yield events
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def _turn(
    http: httpx.AsyncClient, router: psutil.Process, requests: int, start: int
) -> tuple[float, list[float]]:
    """CPU seconds of the router per request, and each request's TTFT."""
    cpu = _cpu_s(router)
    ttfts = [await _ttft(http, MODELS[i % 2], start + i) for i in range(requests)]
    return (_cpu_s(router) - cpu) / requests, ttfts


async def measure(repeats: int, requests: int) -> dict[str, Any]:
    async with serving_mesh(small_mesh(MODELS, "n_threads = 1\n"), "bench-dashboard-") as mesh:
        router = mesh.topology.router
        base = f"http://127.0.0.1:{router.http_port}"
        process = psutil.Process(mesh.procs[router.name].pid)
        cpu: dict[str, list[float]] = {"closed": [], "open": []}
        ttft: dict[str, list[float]] = {"closed": [], "open": []}
        events = 0
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            await _turn(http, process, 4, 0)  # warm-up
            n = 100
            for repeat in range(repeats):
                for kind in ("closed", "open") if repeat % 2 == 0 else ("open", "closed"):
                    if kind == "open":
                        async with open_page(base) as read:
                            c, t = await _turn(http, process, requests, n)
                        events += read[0]
                    else:
                        c, t = await _turn(http, process, requests, n)
                    n += requests
                    cpu[kind].append(c)
                    ttft[kind].extend(t)
                    say(
                        f"   {kind:6}: router CPU {c * 1000:.2f} ms a request, TTFT p50 "
                        f"{median(t) * 1000:.0f} ms"
                    )
    assert events > 0, "the open page read no update"
    return {
        "requests_per_turn": requests,
        "router_cpu_s_per_request": cpu,
        "ttft_s": ttft,
        "events_read": events,
        "cpu_open_over_closed": median(cpu["open"]) / median(cpu["closed"]),
        "ttft_p50_open_over_closed": median(ttft["open"]) / median(ttft["closed"]),
    }


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    cpu = m["router_cpu_s_per_request"]
    return [
        (
            "dashboard open / closed: the router's CPU a request "
            f"({median(cpu['open']) * 1000:.2f} vs {median(cpu['closed']) * 1000:.2f} ms)",
            f"{m['cpu_open_over_closed']:.3f}x",
            f"<= {GOAL}x",
        ),
        (
            "dashboard open / closed: TTFT p50 "
            f"({median(m['ttft_s']['open']) * 1000:.0f} vs "
            f"{median(m['ttft_s']['closed']) * 1000:.0f} ms)",
            f"{m['ttft_p50_open_over_closed']:.3f}x",
            f"<= {GOAL}x",
        ),
    ]


def main() -> int:
    return run_alone(
        __doc__, "dashboard", measure, rows, {"repeats": 3, "requests": 40}, repeats="repeats"
    )


if __name__ == "__main__":
    sys.exit(main())
