"""Benchmark: engine nodes sharing one machine's cores.

    python -m bench.shared_cores [--prompts 8] [--new-tokens 64] [--repeats 3]

Starts a mesh of its own with default settings, as `make run` would on one machine: a
router, one prefill and one decode node (embedded SmolLM2, no n_threads set: each engine
node takes its default share of the cores), then, alternating the two, repeated:

14. 8 different greedy prompts (ignore_eos, 64 tokens each) through the router all at
    once, against the same prompts one after another: generated tokens per second over
    the whole of each. Goal >= 1.0x: many at once never slower than one after another
    (0.16x on 2 cores while llama.cpp's OpenMP threads spun against each other).

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 14.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import grpc

from bench.common import MODEL, median, run_alone, say
from bench.work import Work, figure, record, total
from disagg_mesh.proto.v1 import router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.server.common.runtime.processes import free_port, serving_mesh

GOAL = 1.0
# Eight different prompts, none a prefix of another.
PROMPTS = [
    "def merge_sort(items):",
    "The longest river in Europe is",
    "List the planets of the solar system:",
    "Write a limerick about a cat.",
    "Explain what a hash table is.",
    "import pandas as pd\ndf =",
    "Name three noble gases:",
    "UPDATE accounts SET balance =",
]


def topology_text() -> str:
    node = '[[nodes]]\nname = "{}"\nrole = "{}"\nhost = "127.0.0.1"\nport = {}\n'
    engine = f'engine = "llama_cpp"\nmodel = "{MODEL}"\n'
    return "\n".join(
        [
            node.format("router", "router", free_port()),
            node.format("prefill", "prefill", free_port()) + engine,
            node.format("decode", "decode", free_port()) + engine,
            '[[models]]\nname = "m"\nprefill = ["prefill"]\ndecode = ["decode"]\n',
        ]
    )


async def one(stub: Any, prompt: str, new_tokens: int) -> Work:
    request = router_pb2.GenerateRequest(
        model="m",
        prompt=prompt,
        sampling=types_pb2.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
    )
    summary = None
    async for reply in stub.Generate(request, timeout=900):
        if reply.HasField("summary"):
            summary = reply.summary
    assert summary is not None
    return Work.of(summary)


async def rate(
    stub: Any, prompts: list[str], new_tokens: int, together: bool
) -> tuple[float, Work]:
    """Generated tokens per second, all prompts at once or one after another."""
    started = time.perf_counter()
    if together:
        works = list(await asyncio.gather(*(one(stub, p, new_tokens) for p in prompts)))
    else:
        works = [await one(stub, p, new_tokens) for p in prompts]
    done = total(works)
    return done.generated_tokens / (time.perf_counter() - started), done


async def measure(prompts: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    chosen = (PROMPTS * (prompts // len(PROMPTS) + 1))[:prompts]
    async with serving_mesh(topology_text(), "bench-shared-cores-") as mesh:
        async with grpc.aio.insecure_channel(mesh.topology.router.address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            await rate(stub, chosen, 4, together=False)  # warm-up: both sides find the same cache
            apart, together = [], []
            apart_work, together_work = [], []
            for _ in range(repeats):  # the two take turns
                tps, work = await rate(stub, chosen, new_tokens, together=False)
                apart.append(tps)
                apart_work.append(work)
                tps, work = await rate(stub, chosen, new_tokens, together=True)
                together.append(tps)
                together_work.append(work)
    ratio = median(together) / median(apart)
    say(
        f"   {prompts} prompts: one after another {median(apart):.0f} tok/s, all at once "
        f"{median(together):.0f} tok/s -> {ratio:.2f}x"
    )
    return {
        "prompts": prompts,
        "new_tokens": new_tokens,
        "one_after_another_tokens_per_s": apart,
        "at_once_tokens_per_s": together,
        "at_once_over_one_after_another": ratio,
        "goal": GOAL,
        "work": record(("at_once", "one_after_another"), total(together_work), total(apart_work)),
    }


def rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (
            f"router + prefill + decode on one machine, default settings: {m['prompts']} "
            "prompts at once / one after another, tok/s",
            figure(f"{m['at_once_over_one_after_another']:.2f}x", m.get("work")),
            f">= {GOAL:g}x",
        )
    ]


def main() -> int:
    options = {"prompts": 8, "new_tokens": 64, "repeats": 3}
    return run_alone(__doc__, "shared_cores", measure, rows, options, repeats="repeats")


if __name__ == "__main__":
    sys.exit(main())
