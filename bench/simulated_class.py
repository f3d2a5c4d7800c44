"""Benchmark and workload: a class graded on the user's four machines, simulated.

    python -m bench.simulated_class --write class.jsonl [--submissions 200]
        [--submission-tokens 300] [--answer-tokens 400]
    python -m bench.simulated_class [--submissions 200] [--speedup 20]

A class: each submission (~300 tokens of Python) graded by both models with the shared
~1,500-token rubric as the system message, ~400-token answers (ignore_eos, so every answer
is as long: the work is the same on both sides). Tokens as the simulated engine counts
them (4 bytes a token). `--write` writes it as a `disagg batch` file; without it, the
headline row (#41): `disagg simulate` on topology/seed.toml with the shipped profiles, the
mesh against the Ollama baseline on the same machines, with where the time goes.

Writes JSON to bench/results/ when run alone; `make bench` (bench/run.py) runs it as row 22.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from bench.common import ROOT, run_alone, say

MODELS = ("qwen3-coder:30b", "gpt-oss:120b")
RUBRIC_LINE = (
    "Rubric: correctness 40 points (every test passes; empty input, negative numbers and "
    "large values handled), style 20 points (PEP 8, clear names, no dead code), tests 20 "
    "points (unit tests cover the edge cases), documentation 20 points (docstrings). "
)
TASK = {
    "qwen3-coder:30b": "Analyse the code: bugs, edge cases, complexity. ",
    "gpt-oss:120b": "Write feedback for the student: what is good, what to fix. ",
}


def class_lines(
    submissions: int,
    rubric_tokens: int = 1500,
    submission_tokens: int = 300,
    answer_tokens: int = 400,
) -> list[dict[str, Any]]:
    rubric = "You grade Python homework.\n"
    while len(rubric) < rubric_tokens * 4:
        rubric += RUBRIC_LINE
    lines = []
    for i in range(submissions):
        code = f"# submission {i}\ndef solve(values):\n"
        k = 0
        while len(code) < submission_tokens * 4:
            code += f"    total = total + values[{i % 7}] * {k}  # step {k}\n"
            k += 1
        for model in MODELS:
            lines.append(
                {
                    "custom_id": f"student-{i:03d}-{model.split(':')[0]}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": model,
                        "messages": [
                            {"role": "system", "content": TASK[model] + rubric},
                            {"role": "user", "content": code},
                        ],
                        "max_tokens": answer_tokens,
                        "ignore_eos": True,
                    },
                }
            )
    return lines


def write(
    path: Path, submissions: int, submission_tokens: int = 300, answer_tokens: int = 400
) -> None:
    lines = class_lines(
        submissions, submission_tokens=submission_tokens, answer_tokens=answer_tokens
    )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


# The what-if that lifts what limits the class (the Macs' batches): more slots where their
# KV fits, qwen3-coder:30b's context at 16,384 (its 32 slots' KV, 48 GiB, and the model's
# 19 GB within the M4 Max's 128 GB; gpt-oss's 16 slots at 8,192 are 4.5 GiB).
WHAT_IF_SLOTS = {"mac-studio-1": 16, "mac-studio-2": 32}
WHAT_IF_N_CTX = {"qwen3-coder:30b": 16384}
WHAT_IF = "slots = 16 on the M3 Ultra, 32 on the M4 Max (qwen3-coder's n_ctx 16,384)"


def what_if(seed: Path, path: Path) -> None:
    """seed.toml with WHAT_IF's slots and contexts, written to path."""
    from disagg_mesh.server.simulation.topology import write_toml

    data = tomllib.loads(seed.read_text())
    for node in data["nodes"]:
        if node["name"] in WHAT_IF_SLOTS:
            node["slots"] = WHAT_IF_SLOTS[node["name"]]
        served = str(node.get("model", "")).removeprefix("ollama:")
        if served in WHAT_IF_N_CTX:
            node["n_ctx"] = WHAT_IF_N_CTX[served]
    write_toml(data, path)


async def measure(submissions: int, speedup: int) -> dict[str, Any]:
    """seed.toml as it is, and the what-if that lifts what limits it (the Macs' slots)."""
    from disagg_mesh.server.simulation.run import simulate

    def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            workload = Path(tmp) / "class.jsonl"
            write(workload, submissions)
            seed = ROOT / "topology" / "seed.toml"
            lifted = Path(tmp) / "seed-what-if.toml"
            what_if(seed, lifted)
            return {
                "seed": simulate(seed, workload, speedup=speedup, progress=say).data,
                "what_if": simulate(lifted, workload, speedup=speedup, progress=say).data,
            }

    return await asyncio.to_thread(run)


def _limit(m: dict[str, Any]) -> str:
    """The busiest mesh node and how full its slots were."""
    nodes = m["mesh"]["nodes"]
    name = max(nodes, key=lambda n: nodes[n]["slots_share"])
    return f"{name} {nodes[name]['slots_share']:.0%} of its slots busy"


def rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    m, w = r["seed"], r["what_if"]
    mesh, base = m["mesh"], m["baseline"]
    return [
        (
            f"class of {m['requests'] // 2} x 2 models on seed.toml's 4 machines (simulated, "
            f"shipped profiles): Ollama today / mesh wall time ({base['wall_seconds']:.0f} s "
            f"/ {mesh['wall_seconds']:.0f} s; TTFT p50 {mesh['ttft_p50_seconds']:.1f} s vs "
            f"{base['ttft_p50_seconds']:.1f} s; limit: {_limit(m)})",
            f"{m['ratio']:.2f}x",
            ">= 3x",
        ),
        (
            f"  what-if: {WHAT_IF} ({w['mesh']['wall_seconds']:.0f} s; {_limit(w)})",
            f"{w['ratio']:.2f}x",
            ">= 3x",
        ),
    ]


def main() -> int:
    if "--write" in sys.argv:
        parser = argparse.ArgumentParser(description=__doc__)
        parser.add_argument("--write", type=Path, required=True)
        parser.add_argument("--submissions", type=int, default=200)
        parser.add_argument("--submission-tokens", type=int, default=300)
        parser.add_argument("--answer-tokens", type=int, default=400)
        args = parser.parse_args()
        write(args.write, args.submissions, args.submission_tokens, args.answer_tokens)
        print(f"wrote {args.write}: {args.submissions * len(MODELS)} requests")
        return 0
    options = {"submissions": 200, "speedup": 20}
    return run_alone(__doc__, "simulated_class", measure, rows, options, repeats=None)


if __name__ == "__main__":
    sys.exit(main())
