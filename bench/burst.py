"""Benchmark: a whole class sent at once (#45).

    python -m bench.burst [--submissions 12]

`make run`'s mesh (topology/local.toml on free ports) and llama-server of the same llama.cpp
(`-np 8 -kvu -t <cores>`, as the issue ran it; bench/llama_server.py builds it once) both
serve; each is given, in turn, every request of a class at once: N submissions x 2 models
(llama-server: both to its one model), each prompt the same ~1,500-token rubric, new to
both sides, and a ~250-token submission, streamed through the OpenAI API (greedy, 48 tokens,
ignore_eos). Then the same again with another new rubric, the sides in the other order.

18. wall time, mesh / llama-server (goal <= 0.8x); the mesh's TTFT p50 over its wall time
    (goal <= 0.5); the router's failed attempts, migrations and cool-downs (goal 0); prompt
    tokens each prefill node evaluated, against the rubric once per node plus every
    submission. Both sides generate the same tokens for the same prompts (checked); their
    prompt caches differ on purpose.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 18.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from bench.common import median, metric, metrics_text, run_alone, say
from bench.grader import prompts as grader_prompts
from bench.llama_server import CannotBuild, llama_server_binary, side_by_side
from bench.work import Work, figure, record, total
from disagg_mesh.server.common.runtime.processes import MeshProcesses

NEW_TOKENS = 48
GOAL_WALL = 0.8
GOAL_TTFT_OVER_WALL = 0.5


async def chat(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> dict[str, Any]:
    """A streamed chat completion (greedy, NEW_TOKENS, ignore_eos): its HTTP status, the
    Retry-After of a refusal, the time to its first text, its usage, and whether an error
    event ended it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    out: dict[str, Any] = {"ttft_s": None, "usage": {}, "error": None}
    async with session.post(url + "/v1/chat/completions", json=body) as got:
        out["status"] = got.status
        if got.status != 200:
            out["retry_after"] = got.headers.get("Retry-After")
            out["error"] = await got.text()
            return out
        async for raw in got.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                return out
            out["usage"] = chunk.get("usage") or out["usage"]
            choices = chunk.get("choices") or []
            if out["ttft_s"] is None and (
                choices and (choices[0].get("delta") or {}).get("content")
            ):
                out["ttft_s"] = time.perf_counter() - started
    return out


def uncached(usage: dict[str, Any]) -> int:
    """The prompt tokens a request's usage says were evaluated (not taken from a cache)."""
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens", 0)) - int(details.get("cached_tokens", 0))


async def one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str
) -> tuple[float, Work]:
    """A streamed chat completion that must succeed: its time to first text, its work."""
    got = await chat(session, url, model, prompt)
    assert got["status"] == 200 and got["error"] is None, got
    usage = got["usage"]
    assert got["ttft_s"] is not None and usage, "a stream without text or usage"
    cached = int(usage["prompt_tokens"]) - uncached(usage)
    return got["ttft_s"], Work(usage["prompt_tokens"], cached, usage["completion_tokens"])


async def burst(url: str, models: tuple[str, ...], texts: list[str]) -> dict[str, Any]:
    """Every request at once: wall time, TTFTs, work."""
    timeout = aiohttp.ClientTimeout(total=3600)
    asked = [(m, t) for t in texts for m in models]
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()
        got = await asyncio.gather(*(one(session, url, m, t) for m, t in asked))
        wall = time.perf_counter() - started
    ttfts = sorted(g[0] for g in got)
    return {
        "wall_s": wall,
        "ttft_s": ttfts,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "work": total([g[1] for g in got]),
        "by_model": {
            m: total([g[1] for g, (a, _) in zip(got, asked, strict=True) if a == m]) for m in models
        },
    }


def median_needs(requests: int, by_model: Mapping[str, Work]) -> float:
    """The least share of the evaluated prompt tokens that the median answer (the one
    `burst` reports: number requests // 2 + 1 in order of first text) needs evaluated before
    it, in the best order: whole models' rubrics, then their submissions. Per model, from
    its n requests' usage: they evaluated the rubric once and every submission, and all but
    the first took the rubric from a cache, so rubric = cached / (n - 1), a submission the
    rest of the evaluated tokens over n. Whatever the scheduler does, the prompts evaluated
    before the median's first text are at least this share of them all."""
    per_model = requests // len(by_model)
    shapes = []
    for work in by_model.values():
        rubric = work.cached_tokens / max(per_model - 1, 1)
        evaluated = work.prompt_tokens - work.cached_tokens
        shapes.append((rubric, (evaluated - rubric) / per_model))
    needed = requests // 2 + 1

    def cost(counts: tuple[int, ...]) -> float:
        return sum(r + k * s for (r, s), k in zip(shapes, counts, strict=True) if k)

    splits = [
        c for c in itertools.product(range(per_model + 1), repeat=len(shapes)) if sum(c) == needed
    ]
    everything = sum(w.prompt_tokens - w.cached_tokens for w in by_model.values())
    return min(map(cost, splits)) / everything


async def scrape(mesh: MeshProcesses, roles: tuple[str, ...] = ("prefill",)) -> dict[str, float]:
    """The router's failed attempts and migrations, and the prompt tokens each engine node
    of these roles evaluated (`<node>_prompt`)."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for node in mesh.topology.nodes:
            if node.metrics_port is None or node.role not in ("router", *roles):
                continue
            text = await metrics_text(session, node)
            if node.role == "router":
                out["failed_attempts"] = metric(text, "disagg_failed_attempts_total")
                out["migrations"] = metric(text, "disagg_migrations_total")
            else:
                out[f"{node.name}_prompt"] = metric(
                    text, "disagg_engine_tokens_total", 'kind="prompt"'
                )
    return out


async def measure(submissions: int) -> dict[str, Any]:
    try:
        binary = llama_server_binary()
    except (CannotBuild, subprocess.CalledProcessError) as exc:
        say(f"   skipped: {exc}")
        return {"skipped": str(exc)}
    threads = os.cpu_count() or 1
    rounds = [
        [f"Course 18{r}.\n" + t for t in grader_prompts(submissions, 1500, 250)] for r in "ab"
    ]
    say(f">> 18. {2 * submissions} requests at once: the mesh and llama-server -np 8 -kvu")
    runs: dict[str, list[dict[str, Any]]] = {"mesh": [], "llama-server": []}
    async with side_by_side(binary, threads, 8, "bench-burst-") as (mesh, targets, _):
        for i, texts in enumerate(rounds):
            order = list(targets) if i == 0 else list(reversed(targets))
            for name in order:
                url, models = targets[name]
                models = models if len(models) == 2 else models * 2
                before = await scrape(mesh) if name == "mesh" else {}
                run = await burst(url, models, texts)
                by_model = run.pop("by_model")
                if name == "mesh":
                    after = await scrape(mesh)
                    run["counts"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    run["cool_downs"] = mesh.log_tail("router", 100_000).count("node cooling down")
                    run["median_needs"] = median_needs(len(texts) * 2, by_model)
                runs[name].append(run)
                say(
                    f"   {name}: {run['wall_s']:.1f} s, TTFT p50 {run['ttft_p50_s']:.1f} s"
                    + (f", {run['counts']}" if "counts" in run else "")
                )
    ours, theirs = runs["mesh"], runs["llama-server"]
    mine = median([r["wall_s"] for r in ours])
    other = median([r["wall_s"] for r in theirs])
    counts = ours[-1]["counts"]
    result = {
        "submissions": submissions,
        "requests": 2 * submissions,
        "threads": threads,
        "mesh_wall_s": [r["wall_s"] for r in ours],
        "llama_server_wall_s": [r["wall_s"] for r in theirs],
        "mesh_over_llama_server": mine / other,
        "mesh_ttft_p50_over_wall": median([r["ttft_p50_s"] / r["wall_s"] for r in ours]),
        "llama_server_ttft_p50_over_wall": median([r["ttft_p50_s"] / r["wall_s"] for r in theirs]),
        "mesh_median_needs": median([r["median_needs"] for r in ours]),
        "mesh_last_ttft_over_wall": median([r["ttft_s"][-1] / r["wall_s"] for r in ours]),
        "failed_attempts": sum(r["counts"]["failed_attempts"] for r in ours),
        "migrations": sum(r["counts"]["migrations"] for r in ours),
        "cool_downs": ours[-1]["cool_downs"],
        "prefill_prompt_tokens_last_round": {
            k: v for k, v in counts.items() if k.endswith("_prompt")
        },
        "work": record(
            ("mesh", "llama_server"),
            total([r["work"] for r in ours]),
            total([r["work"] for r in theirs]),
            cache_compared=True,
        ),
    }
    for row in rows(result):
        say("   " + "  ".join(row))
    return result


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    if "skipped" in m:
        return [("a class at once, mesh / llama-server", f"skipped: {m['skipped']}", "-")]
    return [
        (
            f"a class at once ({m['requests']} requests, ~1,750-token prompts sharing a rubric): "
            "wall time, mesh / llama-server -np 8 -kvu",
            figure(
                f"{m['mesh_over_llama_server']:.2f}x ({median(m['mesh_wall_s']):.1f} vs "
                f"{median(m['llama_server_wall_s']):.1f} s)",
                m["work"],
            ),
            f"<= {GOAL_WALL:g}x",
        ),
        (
            "a class at once: the mesh's TTFT p50 / its wall time (llama-server's)",
            f"{m['mesh_ttft_p50_over_wall']:.2f} ({m['llama_server_ttft_p50_over_wall']:.2f})",
            f"<= {GOAL_TTFT_OVER_WALL:g}",
        ),
        (
            "a class at once: prompt tokens its median answer needs evaluated first, in the "
            "best order / all the mesh evaluated (the last first text / the wall time)",
            f"{m['mesh_median_needs']:.2f} ({m['mesh_last_ttft_over_wall']:.2f})"
            if "mesh_median_needs" in m
            else "-",
            "-",
        ),
        (
            "a class at once: failed attempts, migrations, cool-downs in the router",
            f"{m['failed_attempts']:.0f}, {m['migrations']:.0f}, {m['cool_downs']}",
            "0, 0, 0",
        ),
    ]


def main() -> int:
    return run_alone(__doc__, "burst", measure, rows, {"submissions": 12}, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
