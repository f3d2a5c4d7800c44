"""Benchmark: a class of 200 requests at once on `make run`'s mesh (#45).

    python -m bench.class_at_once [--submissions 100]

`make run`'s mesh (topology/local.toml on free ports) is given every request of a class at
once: N submissions x 2 models, each prompt the same ~1,500-token rubric, new to the mesh,
and a ~250-token submission, streamed through the OpenAI API (greedy, 48 tokens,
ignore_eos), no client deadline, as a grader using `asyncio.gather` sends them.

19. Every request answered, or refused at once with a retryable status (429 and
    Retry-After): counts by outcome, none failed after its work was done (the router's
    failed attempts: goal 0), and nothing evaluated twice: the prompt tokens the engine
    nodes evaluated equal the served requests' prompt tokens less those their caches held
    (a second evaluation of any part of a prompt would show as more); also the time to the
    first and the median first token, and the wall time.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 19.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter
from typing import Any

import aiohttp

from bench.burst import chat, scrape, uncached
from bench.common import run_alone, say
from bench.grader import prompts as grader_prompts
from bench.llama_server import MODELS, local_topology
from disagg_mesh.server.common.runtime.processes import MeshProcesses, serving_mesh


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> dict[str, Any]:
    """A request of the class: its outcome, time to first text, tokens evaluated."""
    got = await chat(session, url, model, prompt)
    if got["status"] != 200:
        return {"outcome": str(got["status"]), "retry_after": got.get("retry_after")}
    if got["error"] is not None:
        return {"outcome": "error after text" if got["ttft_s"] else "error"}
    usage = got["usage"]
    return {
        "outcome": "served",
        "ttft_s": got["ttft_s"],
        "evaluated": uncached(usage),
        "completion_tokens": usage.get("completion_tokens", 0),
    }


async def _counters(mesh: MeshProcesses) -> dict[str, float]:
    """The router's failed attempts, and the prompt tokens every engine node evaluated."""
    counts = await scrape(mesh, ("prefill", "decode"))
    evaluated = sum(v for k, v in counts.items() if k.endswith("_prompt"))
    return {"failed_attempts": counts["failed_attempts"], "evaluated": evaluated}


async def measure(submissions: int) -> dict[str, Any]:
    texts = [f"Course 19.\n{t}" for t in grader_prompts(submissions, 1500, 250)]
    say(f">> 19. a class of {2 * submissions} requests at once on make run's mesh")
    async with serving_mesh(local_topology(), "bench-class-") as mesh:
        await asyncio.sleep(1.0)  # the router's health checks see every node
        router = mesh.topology.router
        url = f"http://{router.host}:{router.http_port}"
        before = await _counters(mesh)
        timeout = aiohttp.ClientTimeout(total=3600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            started = time.perf_counter()
            got = await asyncio.gather(*(one(session, url, m, t) for t in texts for m in MODELS))
            wall = time.perf_counter() - started
        after = await _counters(mesh)
        log = mesh.log_tail("router", 10_000_000)
    served = [g for g in got if g["outcome"] == "served"]
    ttfts = sorted(g["ttft_s"] for g in served)
    result = {
        "submissions": submissions,
        "requests": len(got),
        "wall_s": wall,
        "outcomes": dict(Counter(g["outcome"] for g in got)),
        "retry_after_s": sorted({g["retry_after"] for g in got if g.get("retry_after")}),
        "failed_attempts": after["failed_attempts"] - before["failed_attempts"],
        "cool_downs": log.count("node cooling down"),
        "evaluated_by_nodes": after["evaluated"] - before["evaluated"],
        "evaluated_by_requests": sum(g["evaluated"] for g in served),
        "completion_tokens": sum(g["completion_tokens"] for g in served),
        "ttft_first_s": ttfts[0] if ttfts else None,
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
        "attempt_failures": Counter(
            re.sub(r"\d+", "N", m) for m in re.findall(r'"error": "([^"]{0,120})', log)
        ).most_common(5),
    }
    for row in rows(result):
        say("   " + "  ".join(row))
    return result


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(m["outcomes"].items()))
    return [
        (
            f"a class of {m['requests']} at once (~1,750-token prompts sharing a rubric, "
            "make run's mesh): outcomes",
            f"{outcomes} ({m['wall_s']:.0f} s; first answer {m['ttft_first_s']:.1f} s, TTFT "
            f"p50 {m['ttft_p50_s']:.0f} s)",
            "served or refused at once",
        ),
        (
            f"a class of {m['requests']} at once: failed attempts, cool-downs in the router",
            f"{m['failed_attempts']:.0f}, {m['cool_downs']}",
            "0, 0",
        ),
        (
            f"a class of {m['requests']} at once: prompt tokens evaluated by the nodes / "
            "the requests' uncached prompt tokens",
            f"{m['evaluated_by_nodes'] / max(m['evaluated_by_requests'], 1):.3f} "
            f"({m['evaluated_by_nodes']:.0f} vs {m['evaluated_by_requests']})",
            "1.000",
        ),
    ]


def main() -> int:
    return run_alone(__doc__, "class_at_once", measure, rows, {"submissions": 100}, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
