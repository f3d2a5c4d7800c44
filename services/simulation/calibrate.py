"""`disagg calibrate`: a hardware profile of this machine, measured with the real embedded
engine, for `disagg simulate` to predict the topology's own mesh.

    python -m disagg_mesh.server.simulation.calibrate --topology T --out P

For each model the topology's llama_cpp nodes serve, one engine (the settings of its first
decode node: slots, n_ctx) alone on the machine measures:

- prompt tokens per second by depth (new tokens after a prefix its prefix cache holds), and
  by tokens in one pass (prompts of 32 to 448 tokens alone, within the node's n_ubatch);
- one stream's decode tokens per second by depth, and all streams' at 1, 2, 4, ... slots;
- KV bytes per token (two states' sizes) and the prompt's bytes per token (the tokenizer's,
  so the simulated prompts are as long as the real ones).

Its own module and process: llama.cpp's libraries load before grpc's (services/node.py
says why), and the CLI has grpc loaded.
"""

from __future__ import annotations

# isort: off
import llama_cpp  # noqa: F401
# isort: on

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disagg_mesh.server.common.config import DEFAULT_TOPOLOGY
from disagg_mesh.server.common.config.topology import Node, Topology, TopologyError, load_topology
from disagg_mesh.server.common.engines import open_engine
from disagg_mesh.server.common.models.files import ModelFileError
from disagg_mesh.server.common.types import GenerationEnd, Prompt, Sampling

WORDS = "grade the code for correctness style tests and documentation then explain why ".split()
PROMPT_TOKENS = 256
PASS_TOKENS = (32, 64, 128, 256, 448)
DECODE_TOKENS = 48
# Each figure: the best of this many runs (a shared machine's noise only slows things).
RUNS = 2
# Text like a grader's prompt, English and code, for the tokenizer's bytes per token.
SAMPLE = (
    "Rubric: correctness 40 points (every test passes; empty input, negative numbers and "
    "large values handled), style 20 points (PEP 8, clear names, no dead code).\n"
    "def solve(values):\n    total = 0\n    for i, v in enumerate(values):\n"
    "        total = total + values[i] * 3  # step 3 of submission 7\n    return total\n"
) * 8


class CalibrateError(Exception):
    """What the user asked for cannot be measured or written; the message says why."""


def _writable(out: Path) -> None:
    """--out can be written: its folder made, the file created or opened for writing (and
    removed again when it was not there)."""
    existed = out.exists()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a"):
            pass
    except OSError as exc:
        raise CalibrateError(f"--out: {out} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        out.unlink()


def _text(tokens: int, salt: int) -> str:
    """About `tokens` tokens of plain words, different for each salt."""
    words = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(tokens)]
    return f"[{salt}] " + " ".join(words)


async def _end(engine: Any, prompt: Prompt, sampling: Sampling) -> GenerationEnd:
    end: GenerationEnd | None = None
    async for event in engine.generate(prompt, sampling):
        if isinstance(event, GenerationEnd):
            end = event
    assert end is not None
    return end


async def measure_model(
    topology: Topology, node: Node, say: Callable[[str], None]
) -> dict[str, Any]:
    engine = await open_engine(topology, node)
    try:
        return await _measure(engine, node, say)
    finally:
        await engine.close()


async def _measure(engine: Any, node: Node, say: Callable[[str], None]) -> dict[str, Any]:
    one = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
    steps = Sampling(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    n_ctx = node.n_ctx
    depths = [d for d in (0, 512, 1024, 2048) if d + PROMPT_TOKENS + DECODE_TOKENS < n_ctx]
    await _end(engine, Prompt(text=_text(64, 1)), steps)  # first-use costs, not measured
    # Bytes per token of text like the grader's: the tokenizer's count of it.
    end = await _end(engine, Prompt(text=SAMPLE), one)
    bytes_per_token = len(SAMPLE.encode()) / end.prompt_tokens
    salt = iter(range(10_000, 1_000_000))

    async def prompt_rate(depth: int, tokens: int = PROMPT_TOKENS) -> float:
        base = _text(depth, next(salt)) if depth else ""
        if base:
            await _end(engine, Prompt(text=base), one)  # its prefix cache holds it now
        end = await _end(engine, Prompt(text=base + _text(tokens, next(salt))), one)
        return (end.prompt_tokens - end.cached_prompt_tokens) / end.prompt_eval_seconds

    async def pass_rate(tokens: int) -> float:
        return await prompt_rate(0, tokens)

    async def decode_rate(depth: int) -> float:
        end = await _end(engine, Prompt(text=_text(max(depth, 16), next(salt))), steps)
        return (end.completion_tokens - 1) / end.decode_seconds

    async def batch_rate(streams: int) -> float:
        started = time.perf_counter()
        texts = [_text(16, next(salt)) for _ in range(streams)]
        ends = await asyncio.gather(*(_end(engine, Prompt(text=t), steps) for t in texts))
        wall = time.perf_counter() - started
        prompt_s = max(e.prompt_eval_seconds for e in ends)
        return sum(e.completion_tokens for e in ends) / max(wall - prompt_s, 1e-6)

    async def best(measure: Callable[[int], Any], at: int, what: str) -> float:
        rate = max([await measure(at) for _ in range(RUNS)])
        say(f"{what} {at}: {rate:.1f} tok/s")
        return float(rate)

    prefill = [await best(prompt_rate, d, "prompt tokens at depth") for d in depths]
    # A pass's size: one prompt alone fills its pass (within n_ubatch; about these many
    # tokens, the tokenizer's count being a little more).
    passes = [t for t in PASS_TOKENS if t + 32 <= node.n_ubatch] or [PROMPT_TOKENS]
    pass_rates = [await best(pass_rate, t, "prompt tokens in a pass of") for t in passes]
    decode = [await best(decode_rate, d, "one stream at depth") for d in depths]
    slots = node.slots or node.default_slots
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, slots) if b <= slots})
    batch_rates = [await best(batch_rate, b, "streams at once:") for b in batches]
    sizes = []
    for tokens in (128, 512):
        out = await engine.prefill(Prompt(text=_text(tokens, 5000 + tokens)), one)
        sizes.append((out.prompt_tokens, out.kv_state_bytes))
    (t1, s1), (t2, s2) = sizes
    return {
        "kv_bytes_per_token": round((s2 - s1) / (t2 - t1)),
        "bytes_per_token": round(bytes_per_token, 3),
        "prefill": {
            "measured_prompt_tokens": PROMPT_TOKENS,
            "depth_tokens": depths,
            "tokens_per_second": [round(r, 1) for r in prefill],
            "pass_tokens": passes,
            "pass_tokens_per_second": [round(r, 1) for r in pass_rates],
        },
        "decode": {
            "depth_tokens": depths,
            "tokens_per_second": [round(r, 2) for r in decode],
            "batch": batches,
            "batch_tokens_per_second": [round(r, 2) for r in batch_rates],
        },
    }


def profile_text(name: str, topology: Path, models: dict[str, dict[str, Any]]) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    lines = [
        f"# Measured by `disagg calibrate --topology {topology}` on {when} UTC: the embedded",
        "# engine alone on this machine, one model at a time (services/simulation/calibrate.py).",
        "",
        "[profile]",
        f'name = "{name}"',
        'description = "this machine, measured"',
        "",
        "# Not measured: the nodes of one host hand states over loopback (no link charged).",
        "[link]",
        "bandwidth_bytes_per_second = 1.15e9",
        "latency_seconds = 0.0002",
        "",
    ]
    for model, m in models.items():
        lines += [
            f'[models."{model}"]',
            f"kv_bytes_per_token = {m['kv_bytes_per_token']}",
            f"bytes_per_token = {m['bytes_per_token']}",
            "",
            f'[models."{model}".prefill]',
            *(f"{k} = {v}" for k, v in m["prefill"].items()),
            'source = "measured: new tokens after a cached prefix of each depth; a prompt alone '
            'of each pass size"',
            "",
            f'[models."{model}".decode]',
            *(f"{k} = {v}" for k, v in m["decode"].items()),
            'source = "measured: one stream by depth; streams at once by batch"',
            "",
        ]
    return "\n".join(lines)


async def calibrate(
    topology: Topology, topology_file: Path, out: Path, say: Callable[[str], None]
) -> Path:
    models: dict[str, dict[str, Any]] = {}
    for node in sorted(
        (n for n in topology.nodes if n.engine == "llama_cpp"), key=lambda n: n.role != "decode"
    ):
        assert node.model is not None
        if node.model in models:
            continue
        say(f"{node.model} (settings of {node.name})")
        models[node.model] = await measure_model(topology, node, say)
    if not models:
        raise CalibrateError(f"{topology_file} has no llama_cpp node to measure")
    text = profile_text(out.stem, topology_file, models)
    await asyncio.to_thread(out.write_text, text)
    return out


def main(argv: list[str] | None = None) -> int:
    """One line and exit code 2 for what the user gave (a topology that cannot be used, an
    --out that cannot be written, checked before minutes of measuring), 1 for a model that
    cannot be opened, 130 for Ctrl-C: never a traceback."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topology", type=Path, default=Path(DEFAULT_TOPOLOGY))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"... {line}", file=sys.stderr, flush=True)

    try:
        topology = load_topology(args.topology)
        _writable(args.out)
    except (TopologyError, CalibrateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        path = asyncio.run(calibrate(topology, args.topology, args.out, say))
    except CalibrateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ModelFileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted: nothing was written to {args.out}", file=sys.stderr)
        return 130
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
