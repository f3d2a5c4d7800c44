"""`make bench-modes`: `disaggregated` against `decode_only`, for each kind of engine.

    python -m bench.modes [--quick] [--sizes N ...] [--new-tokens N]
    python -m bench.modes --topology topology/seed.toml --running [--model M]

Does prefilling on another machine pay? With embedded llama.cpp the decode node receives
the KV state; with Ollama it receives token ids and evaluates the prompt again. This measures
both modes the way the router runs them, calling the nodes directly:

- disaggregated: Prefill on the model's first prefill node, then Generate on its first decode
  node from the KV handle;
- decode_only: Generate on that decode node from the prompt.

By default everything runs on this machine: two Ollama API servers over the SmolLM2 GGUF
(`tests/fake_ollama.py`'s LlamaModel, one process per "machine": Ollama's semantics, with
real llama.cpp compute), an Ollama prefill node and an Ollama decode node on them, and an
embedded llama.cpp pair for contrast. No Ollama binary can run here; with --running it
measures the real thing on the nodes of a topology (the user's machines).

The two modes alternate, every run with a prompt of its own (so that no prefix cache serves
one from another). Reported, medians: time to the first and to the second text delta (with
Ollama the first token is the prefill node's; the second waits for the decode node's own
prompt evaluation), total time, the decode node's prompt evaluation, and the ratios
disaggregated / decode_only; and whether the two modes' greedy texts agree.
Machines here are shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from bench.common import MODEL as GGUF
from bench.common import ROOT, machine, median, report, say, secs
from bench.harness import Bench, Prompts, Timed, timed_stream
from disagg_mesh.proto.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from disagg_mesh.server.common.config.topology import Topology, load_topology
from disagg_mesh.server.common.models import ModelFileError, resolve_model_path
from disagg_mesh.server.common.runtime.processes import MeshProcesses, free_port

OLLAMA_TAG = "smollm2:135m"
EMBEDDED = "smollm2-embedded"
N_CTX = 4096


async def measure_pair(
    bench: Bench, sizes: list[int], new_tokens: int, label: str
) -> list[dict[str, Any]]:
    rows = []
    async with (
        grpc.aio.insecure_channel(bench.prefill.address) as pc,
        grpc.aio.insecure_channel(bench.decode.address) as dc,
    ):
        prefill: Any = prefill_pb2_grpc.PrefillServiceStub(pc)
        decode: Any = decode_pb2_grpc.DecodeServiceStub(dc)

        async def disaggregated(prompt: str) -> Timed:
            return await bench.two_stages(prefill, decode, prompt, new_tokens)

        async def decode_only(prompt: str) -> Timed:
            request = decode_pb2.DecodeServiceGenerateRequest(
                model=bench.model, prompt=prompt, sampling=bench.greedy(new_tokens)
            )
            return await timed_stream(decode, request)

        for warm_up in (disaggregated, decode_only):  # first calls page in and allocate
            await warm_up(bench.prompts.of_tokens(50, salt="warm-up"))
        for size in sizes:
            runs: dict[str, list[Timed]] = {"disaggregated": [], "decode_only": []}
            for k in range(bench.repeats):
                both = [("disaggregated", disaggregated), ("decode_only", decode_only)]
                for mode, run in both if k % 2 == 0 else both[::-1]:
                    timed = await run(bench.prompts.of_tokens(size, salt=f"{mode} {k}"))
                    runs[mode].append(timed)
            # One more prompt through both modes, untimed: do the greedy texts agree?
            same = bench.prompts.of_tokens(size, salt="agree")
            same_text = (await disaggregated(same)).text == (await decode_only(same)).text
            row = _row(label, size, runs, same_text)
            rows.append(row)
            say(
                f"   {label:<9} {row['prompt_tokens']:>5} tokens: total "
                f"{row['disaggregated']['total_s']:.2f} vs {row['decode_only']['total_s']:.2f} s "
                f"-> {row['total_ratio']:.2f}x; 2nd delta {row['second_delta_ratio']:.2f}x; "
                f"decode-side prompt eval {row['disaggregated']['decode_prompt_eval_s']:.2f} s"
            )
    return rows


def _row(label: str, size: int, runs: dict[str, list[Timed]], same_text: bool) -> dict[str, Any]:
    def stats(ts: list[Timed]) -> dict[str, Any]:
        return {
            "first_delta_s": median([t.at(0) for t in ts]),
            "second_delta_s": median([t.at(1) for t in ts]),
            "total_s": median([t.delta_at[-1] if t.delta_at else float("nan") for t in ts]),
            "decode_prompt_eval_s": median([secs(t.summary.prompt_eval_duration) for t in ts]),
            "kv_transfer": sorted({int(t.summary.kv_transfer) for t in ts}),
            "samples_total_s": [t.delta_at[-1] if t.delta_at else None for t in ts],
        }

    d, o = stats(runs["disaggregated"]), stats(runs["decode_only"])
    prompt_tokens = runs["decode_only"][0].summary.prompt_tokens if runs["decode_only"] else 0
    return {
        "engine": label,
        "prompt_tokens": prompt_tokens or size,
        "disaggregated": d,
        "decode_only": o,
        "first_delta_ratio": d["first_delta_s"] / o["first_delta_s"],
        "second_delta_ratio": d["second_delta_s"] / o["second_delta_s"],
        "total_ratio": d["total_s"] / o["total_s"],
        "same_text": same_text,
    }


def standin_topology(folder: Path, ollama_urls: tuple[str, str]) -> Path:
    threads = os.cpu_count() or 1

    def node(name: str, role: str, port: int, engine_lines: list[str]) -> str:
        lines = [
            "[[nodes]]",
            f'name = "{name}"',
            f'role = "{role}"',
            'host = "127.0.0.1"',
            f"port = {port}",
            *engine_lines,
        ]
        return "\n".join(lines) + "\n"

    def ollama(url: str) -> list[str]:
        return [
            'engine = "ollama"',
            f'model = "{OLLAMA_TAG}"',
            f"n_ctx = {N_CTX}",
            f'ollama_url = "{url}"',
        ]

    embedded = [
        'engine = "llama_cpp"',
        f'model = "{GGUF}"',
        f"n_ctx = {N_CTX}",
        f"n_threads = {threads}",
    ]
    parts = [
        node("router", "router", free_port(), []),
        node("prefill-ollama", "prefill", free_port(), ollama(ollama_urls[0])),
        node("decode-ollama", "decode", free_port(), ollama(ollama_urls[1])),
        node("prefill-embedded", "prefill", free_port(), embedded),
        node("decode-embedded", "decode", free_port(), embedded),
        f'[[models]]\nname = "{OLLAMA_TAG}"\nprefill = ["prefill-ollama"]\n'
        'decode = ["decode-ollama"]\n',
        f'[[models]]\nname = "{EMBEDDED}"\nprefill = ["prefill-embedded"]\n'
        'decode = ["decode-embedded"]\n',
    ]
    path = folder / "topology.toml"
    path.write_text("\n".join(parts))
    return path


def start_standins(gguf: Path, folder: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Two Ollama API servers over the GGUF, one process each (the prefill and the decode
    machine), waited for until they answer."""
    procs, urls = [], []
    for name in ("ollama-prefill", "ollama-decode"):
        port = free_port()
        log = (folder / f"{name}.log").open("ab")
        procs.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.fake_ollama", "--gguf", str(gguf)),
                    *("--model", OLLAMA_TAG, "--port", str(port), "--n-ctx", str(N_CTX)),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    for url, proc in zip(urls, procs, strict=True):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the Ollama stand-in at {url} exited: see {folder}")
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the Ollama stand-in at {url} did not answer") from None
                time.sleep(0.2)
    return procs, urls


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "engine",
        "prompt",
        "mode",
        "1st delta",
        "2nd delta",
        "total",
        "decode-side prompt eval",
    )
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        for mode in ("disaggregated", "decode_only"):
            m = r[mode]
            lines.append(
                (
                    r["engine"],
                    str(r["prompt_tokens"]),
                    mode,
                    f"{m['first_delta_s']:.2f} s",
                    f"{m['second_delta_s']:.2f} s",
                    f"{m['total_s']:.2f} s",
                    f"{m['decode_prompt_eval_s']:.2f} s",
                )
            )
        agree = "texts agree" if r["same_text"] else "texts differ"
        lines.append(
            (
                "",
                "",
                "ratio",
                f"{r['first_delta_ratio']:.2f}x",
                f"{r['second_delta_ratio']:.2f}x",
                f"{r['total_ratio']:.2f}x",
                f"({agree})",
            )
        )
    width = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(width[i]) for i, c in enumerate(line)) for line in lines)


async def run_pairs(
    topology: Topology, models: list[str], args: argparse.Namespace, prompts: Prompts
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model in models:
        bench = Bench(topology, model, args.repeats, prompts)
        label = bench.decode.engine or "?"
        say(f">> {model}: {bench.prefill.name} ({label}) -> {bench.decode.name}")
        rows += await measure_pair(bench, args.sizes, args.new_tokens, label)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", help="measure this topology's nodes (with --running)")
    parser.add_argument("--running", action="store_true", help="the nodes are already running")
    parser.add_argument("--model", action="append", help="logical model(s) to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sizes", type=int, nargs="+", help="prompt tokens (default 250 1000 3000)"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--quick", action="store_true", help="1 repeat, 250 and 1000 tokens unless --sizes"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    args.sizes = args.sizes or ([250, 1000] if args.quick else [250, 1000, 3000])
    if args.topology and not args.running:
        parser.error("--topology measures nodes that are running: add --running")

    try:
        gguf: Path | None = resolve_model_path(GGUF, ROOT)
    except ModelFileError as exc:
        if not args.running:
            raise SystemExit(f"{exc} (make venv installs it)") from None
        gguf = None  # prompt sizes are then estimated at 4 characters a token
    prompts = Prompts(gguf)
    started = time.perf_counter()
    standins: list[subprocess.Popen[bytes]] = []
    mesh = None
    try:
        if args.running:
            topology = load_topology(args.topology or ROOT / "topology/local.toml")
            models = args.model or [m.name for m in topology.models]
        else:
            folder = Path(tempfile.mkdtemp(prefix="bench-modes-"))
            say(">> starting two Ollama stand-ins (Ollama's API over llama.cpp)")
            assert gguf is not None
            standins, urls = start_standins(gguf, folder)
            topology = load_topology(standin_topology(folder, (urls[0], urls[1])))
            models = args.model or [OLLAMA_TAG, EMBEDDED]
            mesh = MeshProcesses(topology, folder / "logs")
            say(f">> starting {len(topology.nodes)} nodes (logs in {folder})")
            mesh.start()
            asyncio.run(mesh.wait_serving(300, progress=say))
        rows = asyncio.run(run_pairs(topology, models, args, prompts))
    finally:
        if mesh is not None:
            mesh.stop()
        for proc in standins:
            proc.terminate()
            proc.wait(10)
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "topology": args.topology or "stand-in (tests/fake_ollama.py LlamaModel + embedded)",
        "repeats": args.repeats,
        "new_tokens": args.new_tokens,
        "wall_s": time.perf_counter() - started,
        "modes": rows,
    }
    report(args.out, "modes", record, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
