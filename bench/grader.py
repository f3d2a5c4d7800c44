"""Benchmark: grader-shaped traffic with and without the prefix cache.

    python -m bench.grader [--requests 20] [--rubric-tokens 1500] [--submission-tokens 200]

The grader sends the same long rubric with every submission. This starts a mesh of its own
(a router, a prefill node and a decode node, embedded engine, `disaggregated`) twice: with
the prefix cache (the default) and with `prefix_cache_tokens = 0` (every prompt evaluated
whole and its whole KV state moved, as before the cache). Each mesh gets the same requests,
a ~1,500-token rubric plus 20 different ~200-token submissions, first one after another,
then 4 at once. Reported, as ratios within this run:

10. TTFT with the cache over TTFT without (median of the requests after the first, one
    after another; goal <= 0.25); KV bytes moved per request over the whole state (goal
    <= 0.2); total time for the 20, one after another and 4 at once, with over without.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 10.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict
from typing import Any

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

import grpc

from bench.common import MODEL, ROOT, median, run_alone, say
from bench.work import Work, figure, record, total
from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import free_port, serving_mesh

LOGICAL = "grader"
NEW_TOKENS = 8
RUBRIC_PART = (
    "Rubric: correctness 40 points (every test passes; empty input, negative numbers and "
    "large values handled), style 20 points (PEP 8, clear names, no dead code), tests 20 "
    "points (unit tests cover the edge cases), documentation 20 points (docstrings). "
)
SUBMISSION_PART = "    total = total + values[{i}] * {k}  # step {k} of submission {i}\n"


def prompts(n: int, rubric_tokens: int, submission_tokens: int) -> list[str]:
    """A rubric of about rubric_tokens, then n different submissions of about
    submission_tokens each, counted with the model's own tokenizer."""
    path = resolve_model_path(MODEL, ROOT)
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)

    def count(text: str) -> int:
        return len(vocab.tokenize(text.encode(), add_bos=False, special=True))

    rubric = "You grade Python homework.\n"
    while count(rubric) < rubric_tokens:
        rubric += RUBRIC_PART
    out = []
    for i in range(n):
        body = f"\nSubmission {i}:\ndef grade_{i}(values):\n    total = 0\n"
        k = 0
        while count(body) < submission_tokens:
            body += SUBMISSION_PART.format(i=i, k=k)
            k += 1
        out.append(rubric + body + "    return total\n\nGrade it:")
    return out


def topology_text(cache: bool) -> str:
    setting = "" if cache else "prefix_cache_tokens = 0\n"
    nodes = "".join(
        f'[[nodes]]\nname = "{name}"\nrole = "{role}"\nhost = "127.0.0.1"\n'
        f'port = {free_port()}\nengine = "llama_cpp"\nmodel = "{MODEL}"\nn_ctx = 4096\n'
        f"slots = 4\nn_threads = 1\n{setting}\n"
        for name, role in (("prefill", "prefill"), ("decode", "decode"))
    )
    return (
        f'[[nodes]]\nname = "router"\nrole = "router"\nhost = "127.0.0.1"\n'
        f"port = {free_port()}\n\n{nodes}"
        f'[[models]]\nname = "{LOGICAL}"\nchain = ["disaggregated"]\n'
        f'prefill = ["prefill"]\ndecode = ["decode"]\n'
        # Without the cache, 4 long prompts at once take minutes on a small machine.
        "prefill_deadline_s = 1800\ndecode_deadline_s = 1800\n"
    )


async def one(stub: Any, prompt: str) -> router_pb2.GenerateSummary:
    request = router_pb2.GenerateRequest(
        model=LOGICAL,
        prompt=prompt,
        sampling=types_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
    )
    summary: router_pb2.GenerateSummary | None = None
    async for reply in stub.Generate(request, timeout=600):
        if reply.HasField("summary"):
            summary = reply.summary
    assert summary is not None
    return summary


async def run_mesh(cache: bool, texts: list[str], others: list[str]) -> dict[str, Any]:
    async with serving_mesh(topology_text(cache), "bench-grader-") as mesh:
        await asyncio.sleep(1.0)  # the router's health checks see both nodes
        async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            started = time.perf_counter()
            sequential = [await one(stub, t) for t in texts]
            sequential_s = time.perf_counter() - started
            say(f"   {len(texts)} one after another: {sequential_s:.1f} s")
            # 4 at once: as many other submissions of the same rubric.
            limit = asyncio.Semaphore(4)

            async def limited(text: str) -> router_pb2.GenerateSummary:
                async with limit:
                    return await one(stub, text)

            started = time.perf_counter()
            parallel = await asyncio.gather(*(limited(t) for t in others))
            parallel_s = time.perf_counter() - started
            say(f"   {len(others)}, 4 at once: {parallel_s:.1f} s")
    later = sequential[1:]
    return {
        "prefix_cache": cache,
        "ttft_s": [s.time_to_first_token.ToNanoseconds() / 1e9 for s in sequential],
        "prompt_tokens": [s.prompt_tokens for s in sequential],
        "cached_prompt_tokens": [s.cached_prompt_tokens for s in sequential],
        "kv_moved_bytes": [s.kv_transfer_bytes for s in sequential],
        "kv_state_bytes": [s.kv_state_bytes for s in sequential],
        "median_ttft_after_first_s": median(
            [s.time_to_first_token.ToNanoseconds() / 1e9 for s in later]
        ),
        "median_moved_over_state": median(
            [s.kv_transfer_bytes / s.kv_state_bytes for s in later if s.kv_state_bytes]
        ),
        "sequential_s": sequential_s,
        "parallel_4_s": parallel_s,
        "parallel_cached_prompt_tokens": [s.cached_prompt_tokens for s in parallel],
        "work_done": asdict(total([Work.of(s) for s in sequential + list(parallel)])),
    }


async def measure(requests: int, rubric_tokens: int, submission_tokens: int) -> dict[str, Any]:
    every = prompts(2 * requests, rubric_tokens, submission_tokens)
    texts, others = every[:requests], every[requests:]
    say(">> 10. grader traffic: with the prefix cache")
    with_cache = await run_mesh(True, texts, others)
    say(">> 10. grader traffic: without it (prefix_cache_tokens = 0)")
    without = await run_mesh(False, texts, others)
    result = {
        "requests": requests,
        "prompt_tokens": median([float(t) for t in with_cache["prompt_tokens"]]),
        "with_cache": with_cache,
        "without_cache": without,
        "ttft_ratio": with_cache["median_ttft_after_first_s"]
        / without["median_ttft_after_first_s"],
        "kv_moved_over_state": with_cache["median_moved_over_state"],
        "sequential_ratio": with_cache["sequential_s"] / without["sequential_s"],
        "parallel_ratio": with_cache["parallel_4_s"] / without["parallel_4_s"],
        # This row measures the cache: its sides differ in cached tokens, nothing else.
        "work": record(
            ("with_cache", "without_cache"),
            Work(**with_cache["work_done"]),
            Work(**without["work_done"]),
            cache_compared=True,
        ),
    }
    for row in rows(result):
        say("   " + "  ".join(row))
    return result


def rows(g: dict[str, Any]) -> list[tuple[str, str, str]]:
    w, wo = g["with_cache"], g["without_cache"]
    n, tokens = g["requests"], int(g["prompt_tokens"])
    return [
        (
            f"grader, {n} x {tokens}-token prompts sharing a rubric: TTFT with / without the "
            "prefix cache",
            figure(
                f"{g['ttft_ratio']:.2f}x ({w['median_ttft_after_first_s'] * 1000:.0f} vs "
                f"{wo['median_ttft_after_first_s'] * 1000:.0f} ms)",
                g.get("work"),
            ),
            "<= 0.25x",
        ),
        (
            "grader: KV bytes moved / whole state",
            f"{g['kv_moved_over_state']:.3f}x ({median(w['kv_moved_bytes'][1:]) / 1e6:.1f} "
            f"of {median(w['kv_state_bytes'][1:]) / 1e6:.1f} MB)",
            "<= 0.2x",
        ),
        (
            f"grader: the {n} one after another, 4 at once: time with / without",
            figure(
                f"{g['sequential_ratio']:.2f}x ({w['sequential_s']:.1f} vs "
                f"{wo['sequential_s']:.1f} s), {g['parallel_ratio']:.2f}x "
                f"({w['parallel_4_s']:.1f} vs {wo['parallel_4_s']:.1f} s)",
                g.get("work"),
            ),
            "-",
        ),
    ]


def main() -> int:
    options = {"requests": 20, "rubric_tokens": 1500, "submission_tokens": 200}
    return run_alone(__doc__, "grader", measure, rows, options, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
