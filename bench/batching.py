"""Benchmark: one decode node serving many streams at once, against raw llama.cpp.

    python -m bench.batching [--quick] [--levels 1 4 8 16] [--threads N] [--rows 7 8 13]

Starts one decode node of its own (16 slots, the embedded engine, this machine's cores),
then measures, each as a ratio within this one run:

7. batched decode: 1, 4, 8 and 16 streams at once on the node (DecodeService.Generate with
   a prompt), aggregate generated tokens per second while all of them generate, over one
   stream, and over raw llama.cpp decoding the same prompts as one batch of the same size in
   this process (same model file, context settings and threads): the limit on this machine;
8. interference: 4 streams generating when a long decode_only prompt arrives on the same
   node; the streams' 99th-percentile inter-token latency while that prompt is evaluated,
   over the same streams' p99 without it (chunked prompt evaluation holds it near the node's
   max_itl_slowdown);
13. structured output: 1 and 8 streams whose answers a JSON Schema constrains (llama.cpp's
   grammar sampler), tokens per second over the same prompts unconstrained for as many
   tokens each.

The node and raw llama.cpp take turns, never run at once. Writes JSON to bench/results/ when
run alone; `make bench` (bench/run.py) runs it as rows 7, 8 and 13.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

import grpc

from bench.common import MODEL, ROOT, median, on_llama_thread, report_alone, say
from bench.work import Work, figure, record, total
from disagg_mesh.proto.v1 import decode_pb2, decode_pb2_grpc, types_pb2
from disagg_mesh.server.common.engines.llama_cpp.model import KV_CACHE_TYPES
from disagg_mesh.server.common.engines.llama_cpp.sampling import SlotSampler, end_tokens
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.runtime.processes import free_port, serving_mesh
from disagg_mesh.server.common.types import Sampling

N_CTX = 4096
SLOTS = 16
LOGICAL = "bench"


def p99(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] if xs else float("nan")


def counting(i: int) -> str:
    """A prompt the model keeps continuing (no early end token), different per stream."""
    return f"Count from {i} to one thousand, one number a line: {i}, {i + 1}, {i + 2},"


def rubric_text(criteria: int) -> str:
    """A grader's rubric of `criteria` criteria (~13 tokens each)."""
    return "You grade Python homework. Rubric: " + " ".join(
        f"criterion {i}: the code handles case {i} correctly and clearly." for i in range(criteria)
    )


def decode_rows(ctx: Any, batch: Any, rows: list[tuple[int, int, int, bool]]) -> None:
    """llama_decode of (token, position, sequence, logits wanted) rows through `batch`."""
    for i, (token, pos, seq, logits) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
    batch.n_tokens = len(rows)
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def long_prompt(llm: Any, tokens: int) -> str:
    lines = ["Review the following student submission and list its bugs.", ""]
    i = 0
    while len(llm.tokenize("\n".join(lines).encode(), special=True)) < tokens:
        lines.append(f"def step_{i}(values, factor={i % 7}):")
        lines.append(f"    return [v * factor for v in values if v > {i * 3}]")
        i += 1
    return "\n".join(lines)


class RawBatched:
    """Raw llama.cpp in this process: B sequences of one unified context, prefilled, then
    decoded one token each per llama_decode, greedy (the node's own sampler).

    Its passes all run on the benchmark's one llama.cpp thread (`run`, `llama_thread`), as a
    node's run on its engine thread. Passes started from asyncio's worker threads, a
    different one now and then, made one stream 2.7x slower here (36 against 98 tok/s, 2
    cores), and so did a thread of its own after row 2's passes on the main thread."""

    def __init__(
        self, model_path: Path, threads: int, *, stream_cells: int = 0, type_k: str = "f16"
    ) -> None:
        """stream_cells > 0: instead of the node's unified cache, one KV stream a sequence
        (llama.cpp's non-unified cache, llama-server's default) of that many cells each."""
        self.llm: Any = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        self.ends = end_tokens(self.llm._model.vocab, self.llm.n_vocab())
        params = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
        ctx_params = llama_cpp.llama_context_default_params()
        # The node's own settings: slots x n_ctx cells, 512-token batches, flash attention,
        # one extra sequence (the node's parked cells).
        ctx_params.n_ctx = (SLOTS + 1) * stream_cells if stream_cells else SLOTS * N_CTX
        ctx_params.n_batch = 512
        ctx_params.n_ubatch = 512
        ctx_params.n_seq_max = SLOTS + 1
        ctx_params.kv_unified = self.unified = not stream_cells
        ctx_params.type_k = KV_CACHE_TYPES[type_k].ggml_type
        ctx_params.n_threads = ctx_params.n_threads_batch = threads
        ctx_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        self._batch = llama_cpp.llama_batch_init(512, 0, 1)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        decode_rows(self._ctx, self._batch, rows)

    def tokens_per_second(self, streams: int, new_tokens: int) -> tuple[float, Work]:
        """Generated tokens per second of `streams` sequences decoded together, and the
        work: their prompts evaluated whole, new_tokens generated each."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)
        # The node's own chain for a greedy ignore_eos request: end tokens at -inf, greedy.
        greedy = Sampling(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        samplers = [SlotSampler(greedy, 0, self.ends, self.llm.n_vocab()) for _ in range(streams)]
        prompts = [
            self.llm.tokenize(counting(i).encode(), add_bos=True, special=True)
            for i in range(streams)
        ]
        last: list[int] = []
        for s, tokens in enumerate(prompts):
            self._decode([(t, p, s, p == len(tokens) - 1) for p, t in enumerate(tokens)])
            last.append(samplers[s].sample(self._ctx, len(tokens) - 1))
        positions = [len(t) for t in prompts]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            self._decode([(last[s], positions[s], s, True) for s in range(streams)])
            for s in range(streams):
                last[s] = samplers[s].sample(self._ctx, s)
                positions[s] += 1
        elapsed = time.perf_counter() - started
        for sampler in samplers:
            sampler.close()
        work = Work(sum(len(t) for t in prompts), 0, streams * new_tokens)
        return streams * (new_tokens - 1) / elapsed, work

    async def run(self, streams: int, new_tokens: int) -> tuple[float, Work]:
        """`tokens_per_second` on the benchmark's llama.cpp thread."""
        return await on_llama_thread(self.tokens_per_second, streams, new_tokens)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        llama_cpp.llama_model_free(self._model)


class Stream:
    """One DecodeService.Generate with a prompt, and when each of its text deltas came."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self.tokens: list[int] = []
        self.call: Any = None
        self.summary: Any = None


async def run_stream(
    stub: Any,
    prompt: str,
    max_tokens: int,
    stream: Stream,
    fmt: types_pb2.ResponseFormat | None = None,
) -> Stream:
    """Greedy; ignore_eos, unless the answer is constrained (fmt: it ends with its JSON)."""
    request = decode_pb2.DecodeServiceGenerateRequest(
        model=LOGICAL,
        prompt=prompt,
        sampling=types_pb2.SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=fmt is None,
            response_format=fmt,
        ),
    )
    stream.call = stub.Generate(request, timeout=900)
    try:
        async for reply in stream.call:
            if reply.HasField("delta"):
                stream.at.append(time.perf_counter())
                stream.tokens.append(len(reply.delta.token_ids))
            else:
                stream.summary = reply.summary
    except asyncio.CancelledError:
        if not stream.call.cancelled():  # this task was cancelled, not the call
            raise
    return stream


async def node_tokens_per_second(stub: Any, streams: int, new_tokens: int) -> tuple[float, Work]:
    """Generated tokens per second, all streams together, while every one of them generates
    (from the last first delta to the first last delta); and the streams' work."""
    done = await asyncio.gather(
        *(run_stream(stub, counting(i), new_tokens, Stream()) for i in range(streams))
    )
    return while_all_generate(done), total([Work.of(s.summary) for s in done])


def while_all_generate(done: list[Stream]) -> float:
    """Tokens per second of the streams together, from the last first delta to the first
    last delta."""
    begin = max(s.at[0] for s in done)
    end = min(s.at[-1] for s in done)
    count = sum(n for s in done for t, n in zip(s.at, s.tokens, strict=True) if begin < t <= end)
    return count / (end - begin)


# Structured output's row: the counting prompts' numbers as a JSON array, which the model
# keeps going (llama.cpp's grammar sampler checks every token).
NUMBERS = types_pb2.ResponseFormat(
    type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
    json_schema=json.dumps(
        {
            "type": "object",
            "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
            "required": ["numbers"],
        }
    ),
)


async def structured(
    stub: Any, levels: list[int], new_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    """13. Constrained streams' tokens per second over free ones', at each level: the
    constrained ones first (up to new_tokens; a JSON that closes ends its stream), then the
    same prompts free for as many tokens as each constrained one made (ignore_eos)."""
    await asyncio.gather(  # every prompt in the prefix cache for both sides
        *(run_stream(stub, counting(i), 2, Stream()) for i in range(max(levels)))
    )
    rows = []
    for level in levels:
        constrained, free = [], []
        constrained_work, free_work = [], []
        for _ in range(repeats):
            done = await asyncio.gather(
                *(
                    run_stream(stub, counting(i), new_tokens, Stream(), NUMBERS)
                    for i in range(level)
                )
            )
            constrained.append(while_all_generate(done))
            constrained_work.append(total([Work.of(s.summary) for s in done]))
            made = [s.summary.completion_tokens for s in done]
            same = await asyncio.gather(
                *(run_stream(stub, counting(i), made[i], Stream()) for i in range(level))
            )
            free.append(while_all_generate(same))
            free_work.append(total([Work.of(s.summary) for s in same]))
        ratio = median(constrained) / median(free)
        rows.append(
            {
                "streams": level,
                "constrained_tokens_per_s": constrained,
                "free_tokens_per_s": free,
                "constrained_over_free": ratio,
                "work": record(("constrained", "free"), total(constrained_work), total(free_work)),
            }
        )
        say(
            f"   {level:>2} streams: JSON-constrained {median(constrained):.0f} tok/s, free "
            f"{median(free):.0f} tok/s -> {ratio:.2f}x"
        )
    return rows


async def batched_decode(
    stub: Any, raw: RawBatched, levels: list[int], new_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    one = 0.0
    for level in levels:
        node, limit = [], []
        node_work, raw_work = [], []
        for _ in range(repeats):  # the two take turns
            rate, work = await node_tokens_per_second(stub, level, new_tokens)
            node.append(rate)
            node_work.append(work)
            rate, work = await raw.run(level, new_tokens)
            limit.append(rate)
            raw_work.append(work)
        if level == 1:
            one = median(node)
        rows.append(
            {
                "streams": level,
                "node_tokens_per_s": node,
                "raw_llama_cpp_tokens_per_s": limit,
                "over_one_stream": median(node) / one,
                "over_raw_llama_cpp": median(node) / median(limit),
                "work": record(("node", "raw_llama_cpp"), total(node_work), total(raw_work)),
            }
        )
        say(
            f"   {level:>2} streams: node {median(node):.0f} tok/s "
            f"({rows[-1]['over_one_stream']:.2f}x one stream), raw llama.cpp "
            f"{median(limit):.0f} tok/s -> {rows[-1]['over_raw_llama_cpp']:.2f}x of the limit"
        )
    raw_one = median(rows[0]["raw_llama_cpp_tokens_per_s"]) if rows else float("nan")
    for row in rows:
        row["raw_over_its_one_stream"] = median(row["raw_llama_cpp_tokens_per_s"]) / raw_one
    return rows


def gaps(stream: Stream, span: tuple[int, int]) -> list[float]:
    """Seconds between consecutive deltas span[0] .. span[1] of the stream."""
    first, last = span
    return [stream.at[k + 1] - stream.at[k] for k in range(first, min(last, len(stream.at) - 1))]


async def interference(
    stub: Any, prompt: str, prompt_tokens: int, repeats: int, streams: int = 4
) -> dict[str, Any]:
    """The streams' p99 inter-token latency while the prompt is evaluated, against the same
    streams' p99 at the same positions without it (a stream's steps slow down as its own
    context grows, so the two are compared token for token)."""
    idle_p99, loaded_p99, prompt_s = [], [], []
    for _ in range(repeats):
        # With the prompt, arriving once every stream generates.
        running = [Stream() for _ in range(streams)]
        tasks = [
            asyncio.create_task(run_stream(stub, counting(i), N_CTX - 64, s))
            for i, s in enumerate(running)
        ]
        while not all(s.at for s in running):  # noqa: ASYNC110 (polling the streams' state)
            await asyncio.sleep(0.01)
        arrived = time.perf_counter()
        long = await run_stream(stub, prompt, 1, Stream())
        finished = long.at[0] if long.at else time.perf_counter()
        for s in running:
            s.call.cancel()
        await asyncio.gather(*tasks)
        spans = [
            (
                next(k for k, t in enumerate(s.at) if t >= arrived),
                max(k for k, t in enumerate(s.at) if t <= finished),
            )
            for s in running
        ]
        loaded_p99.append(
            p99([g for s, span in zip(running, spans, strict=True) for g in gaps(s, span)])
        )
        prompt_s.append(finished - arrived)
        # Without it: the same streams again, as far as they got.
        quiet = await asyncio.gather(
            *(run_stream(stub, counting(i), span[1] + 1, Stream()) for i, span in enumerate(spans))
        )
        idle_p99.append(
            p99([g for s, span in zip(quiet, spans, strict=True) for g in gaps(s, span)])
        )
    ratio = median(loaded_p99) / median(idle_p99)
    say(
        f"   {prompt_tokens}-token prompt with {streams} streams generating: p99 inter-token "
        f"{median(loaded_p99) * 1000:.0f} ms vs {median(idle_p99) * 1000:.0f} ms without it "
        f"-> {ratio:.2f}x (prompt evaluated in {median(prompt_s):.1f} s)"
    )
    return {
        "prompt_tokens": prompt_tokens,
        "streams": streams,
        "idle_p99_s": idle_p99,
        "loaded_p99_s": loaded_p99,
        "prompt_seconds": prompt_s,
        "p99_over_idle": ratio,
    }


@asynccontextmanager
async def decode_node(threads: int) -> AsyncIterator[Any]:
    """A topology of its own: a router and one decode node with SLOTS slots; the node's
    DecodeService stub."""
    port = free_port()
    text = (
        f'[[nodes]]\nname = "router"\nrole = "router"\nhost = "127.0.0.1"\nport = '
        f"{free_port()}\n\n"
        f'[[nodes]]\nname = "bench-decode"\nrole = "decode"\nhost = "127.0.0.1"\n'
        f'port = {port}\nengine = "llama_cpp"\nmodel = "{MODEL}"\nn_ctx = {N_CTX}\n'
        f"slots = {SLOTS}\nn_threads = {threads}\n\n"
        f'[[models]]\nname = "{LOGICAL}"\nchain = ["decode_only"]\ndecode = ["bench-decode"]\n'
    )
    async with (
        serving_mesh(text, "bench-batching-"),
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield decode_pb2_grpc.DecodeServiceStub(channel)


async def measure(
    levels: list[int],
    new_tokens: int,
    repeats: int,
    prompt_tokens: int,
    threads: int,
    rows: frozenset[int] = frozenset({7, 8, 13}),
) -> dict[str, Any]:
    """Rows 7, 8 and 13, or those of `rows`."""
    model_path = resolve_model_path(MODEL, ROOT)
    raw = RawBatched(model_path, threads)
    result: dict[str, Any] = {"threads": threads, "slots": SLOTS, "new_tokens": new_tokens}
    try:
        async with decode_node(threads) as stub:
            await node_tokens_per_second(stub, 2, 8)  # warm-up
            if 7 in rows:
                say(">> 7. batched decode on one decode node vs raw llama.cpp")
                result["batched_decode"] = await batched_decode(
                    stub, raw, levels, new_tokens, repeats
                )
            if 8 in rows:
                say(">> 8. a long prompt arriving while streams generate")
                prompt = long_prompt(raw.llm, prompt_tokens)
                # One run: its p99 is over thousands of gaps, and a run takes minutes here.
                result["interference"] = await interference(stub, prompt, prompt_tokens, repeats=1)
            if 13 in rows:
                say(">> 13. structured output: JSON-constrained vs free decode")
                result["structured"] = await structured(stub, [1, 8], new_tokens, repeats)
            return result
    finally:
        raw.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    # Long enough that every stream is generating for a while: a stream that arrives while
    # others generate gets its prompt evaluated a share at a time (max_itl_slowdown).
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="1 repeat, shorter runs")
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        choices=[7, 8, 13],
        default=[7, 8, 13],
        help="only these rows (13 needs a model that writes JSON: not a random-weight one)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens, args.prompt_tokens = 1, 96, 1000

    started = time.perf_counter()
    result = asyncio.run(
        measure(
            args.levels,
            args.new_tokens,
            args.repeats,
            args.prompt_tokens,
            args.threads,
            frozenset(args.rows),
        )
    )
    report_alone(args.out, "batching", args.repeats, started, result, table({"batching": result}))
    return 0


def table(r: dict[str, Any]) -> str:
    b = r["batching"]
    rows = []
    for row in b.get("batched_decode", []):
        rows.append(
            f"{row['streams']} streams on one decode node: tok/s over 1 stream / over raw "
            f"llama.cpp at {row['streams']}: {row['over_one_stream']:.2f}x / "
            f"{row['over_raw_llama_cpp']:.2f}x (raw: {row['raw_over_its_one_stream']:.2f}x)"
        )
    if "interference" in b:
        i = b["interference"]
        rows.append(
            f"{i['prompt_tokens']}-token prompt while {i['streams']} stream: p99 inter-token / "
            f"idle: {i['p99_over_idle']:.2f}x"
        )
    rows += [f"{name}: {value}" for name, value, _ in structured_rows(b)]
    return "\n".join(rows)


def structured_rows(b: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Row 13 for the tables: (measure, figure, goal)."""
    return [
        (
            f"{row['streams']} JSON-constrained streams on one decode node: tok/s / free",
            figure(f"{row['constrained_over_free']:.2f}x", row.get("work")),
            "-",
        )
        for row in b.get("structured", [])
    ]


if __name__ == "__main__":
    sys.exit(main())
