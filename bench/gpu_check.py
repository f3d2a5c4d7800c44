"""GPU check: KV handoff between a GPU node and a CPU node of the same GGUF, both ways.

    python -m bench.gpu_check [--prompts 8] [--tokens 64] [--families llama,gemma3,...]

Needs llama-cpp-python built with a GPU backend (`make venv` on a machine with nvcc and a
GPU, or LLAMA_BACKEND=cuda). Starts a mesh of its own on this machine: two prefill and two
decode nodes of SmolLM2-135M, one of each with every layer on the GPU and one of each on the
CPU alone (n_gpu_layers = 0, which also turns llama.cpp's offload of large batches off), and
four logical models, one per pair:

    gpu-to-cpu   prefill on the GPU, decode on the CPU
    cpu-to-gpu   the reverse
    gpu-to-gpu, cpu-to-cpu   the same-backend references

Each of N prompts runs greedy for M tokens through each pair. Reported: the backend and
layers each node reports (GetNodeInfo), for each cross pair the tokens that agree with the
reference of its decode side's backend and of its prefill side's (a GPU and a CPU round
differently, so greedy texts part at some token; agreement counts the tokens before that),
whole prompts identical, the handoff time (KV fetch + load) against the same-backend pairs',
and how many of the prompts sent all at once through a same-backend pair give the text they
give alone. Writes JSON to bench/results/.

--families runs the same check for each model family in turn, a mesh of its own each:
llama is SmolLM2-135M (chat prompts, as above); gemma3, gpt-oss and qwen3moe are the tiny
random-weight files of tests/tiny_models.py (gemma3: 128-position sliding window on 5 of 6
layers; gpt-oss: sinks, a 128-position window on every other layer, MXFP4 experts; qwen3moe:
experts, q/k norms), written here since the real ones cannot travel to a lent GPU machine;
they take the rubric and submission as one plain prompt and ignore end tokens (random
weights). --allow-cpu runs without a GPU (every node on the CPU), to check the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

import grpc

from bench.common import MODEL, ROOT, machine, say
from bench.common import report as write_report
from disagg_mesh.client import AsyncMeshClient, GenerateCall, Result
from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.engines.llama_cpp.model import gpu_backend
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port

PAIRS = {
    "gpu-to-cpu": ("prefill-gpu", "decode-cpu"),
    "cpu-to-gpu": ("prefill-cpu", "decode-gpu"),
    "gpu-to-gpu": ("prefill-gpu", "decode-gpu"),
    "cpu-to-cpu": ("prefill-cpu", "decode-cpu"),
}
# The grader's shape: a shared rubric, then the submission (about 300 tokens in all).
RUBRIC = (
    "You are grading first-year computer science homework. For each submission, say what "
    "is correct, what is wrong and why, and give one concrete suggestion. Be specific: quote "
    "the line you mean. Grade on correctness (50%), clarity (30%) and style (20%). Do not "
    "rewrite the whole answer; point at the smallest change that fixes each problem. If the "
    "submission is off-topic, say so in one sentence. Keep the tone encouraging and direct. "
) * 3
PROMPTS = [
    "Explain what a hash map is to a first-year student.",
    "Write a Python function that reverses a linked list, then explain it.",
    "List five common mistakes in student essays about the French Revolution.",
    "What does this code do? for i in range(10): print(i * i)",
    "Give feedback on this thesis: 'Social media is bad for everyone.'",
    "Describe how binary search works and when it fails.",
    "Summarise the causes of the First World War in a paragraph.",
    "Review this SQL: SELECT * FROM users WHERE name = '" + "' + input + '" + "';",
    "Explain recursion with an example in JavaScript.",
    "What makes a good unit test? Answer in bullet points.",
]


FAMILIES = ("llama", "gemma3", "gpt-oss", "qwen3moe")


def family_model(family: str, folder: Path) -> str:
    """The model spec of a family: SmolLM2 for llama, a tiny random file for the others."""
    if family == "llama":
        return MODEL
    from tests import tiny_models  # the test helpers write them; numpy and gguf only

    writers = {
        "gemma3": tiny_models.write_gemma3,
        "gpt-oss": tiny_models.write_gpt_oss,
        "qwen3moe": tiny_models.write_qwen3moe,
    }
    return str(writers[family](folder / f"tiny-{family}.gguf"))


def topology_text(threads: int, model: str) -> str:
    lines = [
        f'[[nodes]]\nname = "router"\nrole = "router"\nhost = "127.0.0.1"\nport = {free_port()}\n'
    ]
    for role in ("prefill", "decode"):
        for side in ("gpu", "cpu"):
            lines.append(
                f'[[nodes]]\nname = "{role}-{side}"\nrole = "{role}"\nhost = "127.0.0.1"\n'
                f'port = {free_port()}\nengine = "llama_cpp"\nmodel = "{model}"\n'
                f"n_ctx = 4096\nslots = 2\nn_threads = {threads}\n"
                + ("n_gpu_layers = 0\n" if side == "cpu" else "")
            )
    for name, (prefill, decode) in PAIRS.items():
        lines.append(
            f'[[models]]\nname = "{name}"\nchain = ["disaggregated"]\n'
            f'prefill = ["{prefill}"]\ndecode = ["{decode}"]\n'
        )
    return "\n".join(lines)


def call(pair: str, submission: str, tokens: int, chat: bool) -> GenerateCall:
    """The grader's request: the rubric as the system turn, the submission as the user's;
    not chat (random weights): the two as one prompt, run to `tokens` past end tokens."""
    if not chat:
        return GenerateCall(
            model=pair,
            prompt=f"{RUBRIC}\n\n{submission}\n",
            max_tokens=tokens,
            temperature=0.0,
            ignore_eos=True,
        )
    return GenerateCall(
        model=pair,
        messages=[{"role": "system", "content": RUBRIC}, {"role": "user", "content": submission}],
        max_tokens=tokens,
        temperature=0.0,
    )


def agreeing_tokens(vocab: Any, a: str, b: str) -> tuple[int, int]:
    """Tokens of text a before it parts from text b, and a's tokens in all."""
    tokens_a = vocab.tokenize(a.encode(), add_bos=False, special=True)
    tokens_b = vocab.tokenize(b.encode(), add_bos=False, special=True)
    same = 0
    for x, y in zip(tokens_a, tokens_b, strict=False):
        if x != y:
            break
        same += 1
    return same, len(tokens_a)


async def node_placements(mesh: MeshProcesses) -> dict[str, str]:
    out = {}
    for node in mesh.topology.nodes:
        if node.role == "router":
            continue
        async with grpc.aio.insecure_channel(node.address) as channel:
            stub: Any = node_pb2_grpc.NodeServiceStub(channel)
            info = await stub.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=10)
        out[node.name] = f"{info.backend}, {info.gpu_layers}/{info.model_layers} layers on GPU"
    return out


async def run(
    prompts: list[str], tokens: int, threads: int, model: str, chat: bool, folder: Path
) -> dict[str, Any]:
    path = folder / "topology.toml"
    path.write_text(topology_text(threads, model))
    topology = load_topology(path)
    mesh = MeshProcesses(topology, folder / "logs")
    mesh.start()
    try:
        await mesh.wait_serving(300, progress=say)
        placements = await node_placements(mesh)
        for name, where in placements.items():
            say(f"   {name}: {where}")
        results: dict[str, list[Result]] = {name: [] for name in PAIRS}
        async with AsyncMeshClient(topology.router.address, timeout=300) as client:
            for pair in PAIRS:  # warm-up: CUDA kernels load on first use
                await client.generate(call(pair, PROMPTS[0], 4, chat))
            for prompt in prompts:
                for pair in PAIRS:
                    results[pair].append(await client.generate(call(pair, prompt, tokens, chat)))
            # The same prompts all at once: batched on each node's slots.
            batched: dict[str, list[str]] = {}
            for pair in ("gpu-to-gpu", "cpu-to-cpu"):
                together = await asyncio.gather(
                    *(client.generate(call(pair, p, tokens, chat)) for p in prompts)
                )
                batched[pair] = [r.text for r in together]
    finally:
        mesh.stop()
    return {"placements": placements, "results": results, "batched": batched}


def report(prompts: list[str], tokens: int, raw: dict[str, Any], model: str) -> dict[str, Any]:
    vocab: Any = llama_cpp.Llama(
        model_path=str(resolve_model_path(model, ROOT)), vocab_only=True, verbose=False
    )
    results: dict[str, list[Result]] = raw["results"]
    pairs: dict[str, Any] = {}
    for pair in PAIRS:
        runs = results[pair]
        handoff = [r.metrics.kv_transfer_time + r.metrics.kv_load_time for r in runs]
        pairs[pair] = {
            "methods": sorted({r.metrics.method for r in runs}),
            "kv_bytes_median": statistics.median(r.metrics.kv_bytes for r in runs),
            "handoff_seconds_median": statistics.median(handoff),
            "kv_fetch_seconds_median": statistics.median(r.metrics.kv_transfer_time for r in runs),
            "kv_load_seconds_median": statistics.median(r.metrics.kv_load_time for r in runs),
            "decode_tokens_per_second_median": statistics.median(
                r.metrics.decode_speed for r in runs
            ),
            "completion_tokens": [r.metrics.completion_tokens for r in runs],
        }
    for pair, refs in (
        ("gpu-to-cpu", {"decode side (cpu-to-cpu)": "cpu-to-cpu", "prefill side": "gpu-to-gpu"}),
        ("cpu-to-gpu", {"decode side (gpu-to-gpu)": "gpu-to-gpu", "prefill side": "cpu-to-cpu"}),
        ("gpu-to-gpu", {"cpu-to-cpu": "cpu-to-cpu"}),
    ):
        agreement = {}
        for label, ref in refs.items():
            counts = [
                agreeing_tokens(vocab, a.text, b.text)
                for a, b in zip(results[pair], results[ref], strict=True)
            ]
            agreement[label] = {
                "reference": ref,
                "tokens_agreeing": sum(c[0] for c in counts),
                "tokens": sum(c[1] for c in counts),
                "prompts_identical": sum(
                    a.text == b.text for a, b in zip(results[pair], results[ref], strict=True)
                ),
                "first_difference_at_token": [c[0] for c in counts],
            }
        pairs[pair]["agreement"] = agreement
    for pair, texts in raw["batched"].items():
        pairs[pair]["batched_identical_to_alone"] = sum(
            a == b.text for a, b in zip(texts, results[pair], strict=True)
        )
    same = statistics.median(
        [
            pairs["gpu-to-gpu"]["handoff_seconds_median"],
            pairs["cpu-to-cpu"]["handoff_seconds_median"],
        ]
    )
    for pair in ("gpu-to-cpu", "cpu-to-gpu"):
        pairs[pair]["handoff_over_same_backend"] = pairs[pair]["handoff_seconds_median"] / same
    return {
        "model": Path(str(resolve_model_path(model, ROOT))).name,
        "prompts": len(prompts),
        "tokens": tokens,
        "backend": gpu_backend(),
        "placements": raw["placements"],
        "pairs": pairs,
        "texts": {pair: [r.text for r in results[pair]] for pair in PAIRS},
    }


def table(r: dict[str, Any]) -> str:
    rows = [
        f"{r['model']}: {r['prompts']} prompts x {r['tokens']} greedy tokens, "
        f"backend {r['backend']}"
    ]
    rows += [f"  {name}: {where}" for name, where in r["placements"].items()]
    for pair in ("gpu-to-cpu", "cpu-to-gpu", "gpu-to-gpu"):
        p = r["pairs"][pair]
        for label, a in p["agreement"].items():
            rows.append(
                f"{pair} vs {label}: {a['tokens_agreeing']}/{a['tokens']} tokens agree "
                f"({a['tokens_agreeing'] / max(a['tokens'], 1):.2f}), "
                f"{a['prompts_identical']}/{r['prompts']} prompts identical"
            )
    for pair in ("gpu-to-gpu", "cpu-to-cpu"):
        rows.append(
            f"{pair}: {r['prompts']} prompts at once: "
            f"{r['pairs'][pair]['batched_identical_to_alone']}/{r['prompts']} texts identical "
            "to the same prompt alone"
        )
    for pair in PAIRS:
        p = r["pairs"][pair]
        extra = (
            f", {p['handoff_over_same_backend']:.2f}x the same-backend pairs'"
            if "handoff_over_same_backend" in p
            else ""
        )
        rows.append(
            f"{pair}: handoff (fetch + load) median {p['handoff_seconds_median'] * 1000:.1f} ms "
            f"for {p['kv_bytes_median'] / 1e6:.2f} MB{extra}; decode "
            f"{p['decode_tokens_per_second_median']:.0f} tok/s"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    parser.add_argument(
        "--families", default="llama", help=f"comma-separated, of {', '.join(FAMILIES)}"
    )
    parser.add_argument("--allow-cpu", action="store_true", help="run with no GPU backend")
    args = parser.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        say(f"error: --families: unknown {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
        return 2
    if gpu_backend() is None and not args.allow_cpu:
        say(
            "error: this llama.cpp build has no GPU backend (or sees no GPU): build it with "
            "LLAMA_BACKEND=cuda make venv on a machine with nvcc"
        )
        return 2

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for family in families:
        folder = Path(tempfile.mkdtemp(prefix=f"gpu-check-{family}-"))
        model = family_model(family, folder)
        say(f">> {family}: {Path(str(resolve_model_path(model, ROOT))).name}")
        raw = asyncio.run(run(prompts, args.tokens, args.threads, model, family == "llama", folder))
        results[family] = report(prompts, args.tokens, raw, model)
        say(table(results[family]))
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "repeats": 1,
        "wall_s": time.perf_counter() - started,
        # One family: the layout of earlier runs; several: one such object per family.
        "gpu_check": results[families[0]] if len(families) == 1 else results,
    }
    write_report(args.out, "gpu_check", record, "\n\n".join(table(r) for r in results.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
