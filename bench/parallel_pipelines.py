"""Benchmark: the grader's two calls (code analysis + feedback), sequential vs parallel.

    python -m bench.parallel_pipelines [--topology topology/local.toml] [--repeats 3]

Starts every node of the topology on this machine (or uses a running mesh with --router),
runs the two grading calls one after the other and then both at once, `repeats` times each,
and prints the median wall times and their ratio. Writes JSON to bench/results/. Compare
the ratio, not absolute times: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine
from bench.work import Work, record, total
from disagg_mesh import AsyncMeshClient, GenerateCall
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.runtime.processes import MeshProcesses

# Both calls do the same amount of work (ignore_eos: each answer is max_tokens long), so
# the ratio shows what running the two pipelines at once buys.
COUNTING = "Count to five hundred: " + ", ".join(str(i) for i in range(1, 30)) + ","


def calls(max_tokens: int, ignore_eos: bool = True) -> list[GenerateCall]:
    return [
        GenerateCall(
            model, prompt=COUNTING, max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos
        )
        for model in ("qwen3-coder:30b", "gpt-oss:120b")
    ]


async def measure(
    router: str, repeats: int, max_tokens: int, ignore_eos: bool = True
) -> dict[str, Any]:
    """ignore_eos: every answer max_tokens long (embedded nodes only; Ollama has none)."""
    sequential: list[float] = []
    parallel: list[float] = []
    tokens: list[int] = []
    sequential_work: list[Work] = []
    parallel_work: list[Work] = []
    async with AsyncMeshClient(router) as mesh:
        # Warm-up: models paged in, channels open, and the prompt's whole blocks cached on
        # both sides alike.
        await mesh.gather(*calls(4, ignore_eos))
        for _ in range(repeats):
            started = time.perf_counter()
            for call in calls(max_tokens, ignore_eos):
                sequential_work.append(Work.of((await mesh.generate(call)).metrics))
            sequential.append(time.perf_counter() - started)
            started = time.perf_counter()
            results = await mesh.gather(*calls(max_tokens, ignore_eos))
            parallel.append(time.perf_counter() - started)
            for r in results:
                if isinstance(r, Exception):
                    raise r
                tokens.append(r.metrics.completion_tokens)
                parallel_work.append(Work.of(r.metrics))
    seq, par = statistics.median(sequential), statistics.median(parallel)
    return {
        "sequential_s": sequential,
        "parallel_s": parallel,
        "sequential_median_s": seq,
        "parallel_median_s": par,
        "speedup_parallel_over_sequential": seq / par,
        "completion_tokens": tokens,
        "work": record(("sequential", "parallel"), total(sequential_work), total(parallel_work)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", default=str(ROOT / "topology/local.toml"))
    parser.add_argument(
        "--router", help="use a running mesh at this address instead of starting one"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()

    mesh = None
    router = args.router
    if router is None:
        topology = load_topology(args.topology)
        mesh = MeshProcesses(topology, Path(tempfile.mkdtemp(prefix="bench-logs-")))
        print(f">> starting {len(topology.nodes)} nodes of {args.topology}", flush=True)
        mesh.start()
        router = topology.router.address
    try:
        if mesh is not None:
            asyncio.run(mesh.wait_serving(300, progress=lambda line: print(line, flush=True)))
        print(
            f">> {args.repeats} x (2 calls sequential, then 2 in parallel), "
            f"up to {args.max_tokens} tokens each",
            flush=True,
        )
        result = asyncio.run(measure(router, args.repeats, args.max_tokens))
    finally:
        if mesh is not None:
            mesh.stop()
    record = {
        "benchmark": "parallel_pipelines",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "topology": args.topology if mesh is not None else f"running mesh at {router}",
        **result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"parallel_pipelines-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    print(
        f"sequential {result['sequential_median_s']:.2f} s, "
        f"parallel {result['parallel_median_s']:.2f} s (medians of {args.repeats}; "
        f"completion tokens {result['completion_tokens']}): "
        f"parallel/sequential speedup {result['speedup_parallel_over_sequential']:.2f}x"
    )
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
