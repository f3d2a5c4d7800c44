"""Benchmark: grading a class as one batch against sending every request at once.

    python -m bench.batch [--submissions 20] [--rubric-tokens 1500] [--submission-tokens 200]

Starts a mesh of its own, as `make run` lays it out on one machine: a router with its HTTP
door, and a prefill and a decode node for each of two models (embedded SmolLM2, default
settings). The grader workload: a ~1,500-token rubric shared by 20 ~200-token submissions,
each graded by both models (40 requests, /v1/completions, greedy, ignore_eos, 32 tokens).
Sent three ways, each with a rubric of its own (so each starts with nothing of it cached):

15. naively: all 40 POSTed at once, in file order, against `disagg batch`'s runner
    (MeshClient.batch: as many at once as the decode nodes have free slots, each rubric's
    first request ahead of the others so the prefix cache serves them): wall time, naive
    over batch. Also the batch in file order (no grouping), to show what the grouping adds.

Every side evaluates the same prompts and generates the same tokens; they differ in how
many prompt tokens the prefix cache served, which is what the row measures.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 15.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

import aiohttp

from bench.common import MODEL, run_alone, say
from bench.grader import prompts
from bench.work import Work, figure, record, total
from disagg_mesh import AsyncMeshClient
from disagg_mesh.batch import BatchRequest, BatchResult
from disagg_mesh.server.common.runtime.processes import free_port, serving_mesh

MODELS = ("qwen3-coder:30b", "gpt-oss:120b")
NEW_TOKENS = 32
SIDES = ("naive", "batch_file_order", "batch")

_ = llama_cpp  # imported first for its side effect


def topology_text() -> str:
    node = '[[nodes]]\nname = "{}"\nrole = "{}"\nhost = "127.0.0.1"\nport = {}\n'
    engine = f'engine = "llama_cpp"\nmodel = "{MODEL}"\nn_ctx = 4096\n'
    parts = [node.format("router", "router", free_port()) + f"http_port = {free_port()}\n"]
    for i, model in enumerate(MODELS):
        parts.append(node.format(f"prefill-{i}", "prefill", free_port()) + engine)
        parts.append(node.format(f"decode-{i}", "decode", free_port()) + engine)
        parts.append(
            f'[[models]]\nname = "{model}"\nprefill = ["prefill-{i}"]\ndecode = ["decode-{i}"]\n'
            # 40 long prompts at once take minutes on a small machine.
            "prefill_deadline_s = 1800\ndecode_deadline_s = 1800\n"
        )
    return "\n".join(parts)


def requests(texts: list[str], tag: str) -> list[BatchRequest]:
    """The class as a batch file would hold it: per submission, both models."""
    out = []
    for i, text in enumerate(texts):
        for model in MODELS:
            body = {
                "model": model,
                "prompt": f"{tag}\n{text}",
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            }
            out.append(BatchRequest(f"s{i}-{model}", "/v1/completions", body))
    return out


async def naive(url: str, batch: list[BatchRequest]) -> tuple[float, list[BatchResult]]:
    """All at once, in file order, as a grader's own loop would send them."""
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(r: BatchRequest) -> BatchResult:
            async with session.post(url + r.url, json=r.http_body()) as got:
                body = await got.json()
                return BatchResult(r.custom_id, r.model, got.status, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in batch))
        return time.perf_counter() - started, list(results)


async def batched(
    address: str, batch: list[BatchRequest], group: bool
) -> tuple[float, list[BatchResult], int]:
    async with AsyncMeshClient(address, timeout=3600) as client:
        run = await client.batch_run(batch, group_prefixes=group)
        started = time.perf_counter()
        results = [r async for r in run.results()]
        return time.perf_counter() - started, results, run.concurrency


def work(results: list[BatchResult]) -> Work:
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} failed: {failed[0].message}"
    return total(
        [Work(r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens) for r in results]
    )


async def measure(submissions: int, rubric_tokens: int, submission_tokens: int) -> dict[str, Any]:
    texts = prompts(submissions, rubric_tokens, submission_tokens)
    seconds: dict[str, float] = {}
    works: dict[str, Work] = {}
    concurrency = 0
    async with serving_mesh(topology_text(), "bench-batch-") as mesh:
        await asyncio.sleep(1.0)  # the router's health checks see every node
        router = mesh.topology.router
        url = f"http://{router.host}:{router.http_port}"
        # A rubric of its own per side (same length): each starts with nothing cached.
        for n, side in enumerate(SIDES):
            batch = requests(texts, f"Course {n + 1}.")
            say(f">> 15. {len(batch)} requests, {side.replace('_', ' ')}")
            if side == "naive":
                seconds[side], results = await naive(url, batch)
            else:
                seconds[side], results, concurrency = await batched(
                    router.address, batch, group=side == "batch"
                )
            works[side] = work(results)
            say(
                f"   {seconds[side]:.1f} s; {works[side].cached_tokens} of "
                f"{works[side].prompt_tokens} prompt tokens from the cache"
            )
    result = {
        "submissions": submissions,
        "requests": 2 * submissions,
        "new_tokens": NEW_TOKENS,
        "batch_concurrency": concurrency,
        "seconds": seconds,
        "cached_prompt_tokens": {s: works[s].cached_tokens for s in SIDES},
        "prompt_tokens": works["batch"].prompt_tokens,
        "naive_over_batch": seconds["naive"] / seconds["batch"],
        "file_order_over_batch": seconds["batch_file_order"] / seconds["batch"],
        # The row measures the prefix cache's use: the sides differ in cached tokens only.
        "work": record(("naive", "batch"), works["naive"], works["batch"], cache_compared=True),
        "work_file_order": record(
            ("batch_file_order", "batch"),
            works["batch_file_order"],
            works["batch"],
            cache_compared=True,
        ),
    }
    for row in rows(result):
        say("   " + "  ".join(row))
    return result


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    s, cached, prompt = m["seconds"], m["cached_prompt_tokens"], m["prompt_tokens"]
    return [
        (
            f"grader as one batch ({m['requests']} requests, 2 models, shared rubric): wall "
            "time, all at once in file order / disagg batch",
            figure(
                f"{m['naive_over_batch']:.2f}x ({s['naive']:.0f} vs {s['batch']:.0f} s; cached "
                f"prompt tokens {cached['naive'] / prompt:.0%} vs {cached['batch'] / prompt:.0%})",
                m.get("work"),
            ),
            "> 1x",
        ),
        (
            "  the same batch in file order (no prefix grouping) / grouped",
            figure(
                f"{m['file_order_over_batch']:.2f}x ({s['batch_file_order']:.0f} s, cached "
                f"{cached['batch_file_order'] / prompt:.0%}; {m['batch_concurrency']} at once)",
                m.get("work_file_order"),
            ),
            "-",
        ),
    ]


def main() -> int:
    options = {"submissions": 20, "rubric_tokens": 1500, "submission_tokens": 200}
    return run_alone(__doc__, "batch", measure, rows, options, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
