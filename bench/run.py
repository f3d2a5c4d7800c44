"""`make bench`: the measurements that say whether the disaggregated mesh is worth running.

    python bench/run.py [--topology topology/local.toml] [--running] [--model M] [--quick]

Starts every node of the topology on this machine (or, with --running, uses the nodes the
topology names, wherever they run), then measures, each as a ratio within this one run,
repeated, median reported:

1. handoff vs re-prefill: a decode node pulling + checking + loading a prompt's KV state,
   against the same decode node evaluating that prompt itself (~250, ~1,000, ~3,000 tokens);
2. mesh overhead: router -> prefill -> KV -> decode, streamed, against the same generation in
   one process with llama-cpp-python (llama_cpp topologies only), cold (a fresh prompt each
   repeat: both evaluate it whole) and warm (one prompt repeated: the mesh takes its whole
   blocks from its prefix cache, the process keeps as many in its context and evaluates the
   same rest);
3. router relay: the same two stages called by this script directly, without the router;
4. KV transfer throughput: FetchKv of a ~50 MB state against a plain gRPC byte stream of the
   same size between two processes (the ceiling);
5. concurrency: 1, 4 and 16 requests at once through the router, against the same mesh
   with one slot per node (how every node served before continuous batching);
6. parallel pipelines: the grader's two calls sequential vs parallel;
7. batched decode: 1, 4, 8 and 16 streams on one decode node against raw llama.cpp
   decoding the same batch in one process (bench/batching.py, on a node of its own);
8. interference: a 3,000-token prompt arriving while 4 streams generate, their p99
   inter-token latency against idle (bench/batching.py);
9. migration: a decode node SIGKILLed mid-answer, the time until the answer resumes on
   another node, against the user's 5 s failover target, for a short and a long prompt,
   evaluated by the node taking over or by the prefill node (bench/migration.py, a mesh of
   its own);
10. grader traffic: a ~1,500-token rubric with 20 different submissions, with the prefix
   cache against without it: TTFT, KV bytes moved, total time (bench/grader.py, meshes of
   their own);
11. model families: row 1 for a sliding-window model (gemma-3-270m, window 512) on a
   ~2,000-token prompt, and the KV bytes a prompt token moves against its whole KV and
   SmolLM2's (bench/families.py, meshes of their own);
12. router failover: the router serving an answer SIGKILLed mid-answer, the time until the
   caller's next text through the other router, against the 5 s target
   (bench/router_failover.py, a mesh of its own);
13. structured output: JSON-Schema-constrained decode against free decode of as many tokens,
   1 and 8 streams on one decode node (bench/batching.py, with rows 7 and 8);
14. shared cores: a router, a prefill and a decode node on this machine with default
   settings, 8 prompts at once against one after another (bench/shared_cores.py, a mesh of
   its own);
15. batch jobs: the grader workload (a ~1,500-token rubric, 20 submissions x 2 models) as
   one `disagg batch` against the same 40 requests sent all at once in file order: wall
   time (bench/batch.py, a mesh of its own);
16. llama-server: `make run`'s mesh against llama-server built (once, into ~/.cache) from
   the same llama.cpp, 16 greedy prompts 1, 4 and 16 at once, and the grader workload cold
   and warm (bench/llama_server.py, a mesh and a server of their own, one after the other).

Every answer is greedy with ignore_eos (end tokens never sampled), so both sides of a ratio
generate the same number of tokens on any CPU. Each row records what each side did (prompt
tokens, tokens from a cache, tokens generated, bytes: bench/work.py) and shows its figure
only when both sides did the same; otherwise the row says what differed and the run exits 1.

Prints a table; writes everything (machine, versions, date, every sample) to bench/results/.
This machine is shared and noisy: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "generated")]

import grpc  # noqa: E402

from bench.batch import measure as measure_batch  # noqa: E402
from bench.batch import rows as batch_rows  # noqa: E402
from bench.batching import measure as measure_batching  # noqa: E402
from bench.batching import structured_rows  # noqa: E402
from bench.families import measure as measure_families  # noqa: E402
from bench.families import rows as families_rows  # noqa: E402
from bench.grader import measure as measure_grader  # noqa: E402
from bench.grader import rows as grader_rows  # noqa: E402
from bench.llama_server import measure as measure_llama_server  # noqa: E402
from bench.llama_server import rows as llama_server_rows  # noqa: E402
from bench.migration import measure as measure_migration  # noqa: E402
from bench.migration import rows as migration_rows  # noqa: E402
from bench.parallel_pipelines import measure as measure_parallel  # noqa: E402
from bench.router_failover import measure as measure_router_failover  # noqa: E402
from bench.router_failover import rows as router_failover_rows  # noqa: E402
from bench.shared_cores import measure as measure_shared_cores  # noqa: E402
from bench.shared_cores import rows as shared_cores_rows  # noqa: E402
from bench.work import Work, failures, figure, record, total  # noqa: E402
from disagg.v1 import (  # noqa: E402
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    types_pb2,
)
from disagg_mesh import AsyncMeshClient, GenerateCall, MeshError  # noqa: E402
from services.common.config.topology import Node, Topology, load_topology  # noqa: E402
from services.common.models import resolve_model_path  # noqa: E402
from services.common.runtime.processes import MeshProcesses  # noqa: E402
from services.common.types import Sampling  # noqa: E402
from services.common.wire.node_clients import ChannelPool, PrefillClient  # noqa: E402

MiB = 1 << 20


# The rows measured on the topology's mesh, and those that start nodes of their own.
ON_THE_MESH = (
    "handoff_vs_reprefill",
    "overhead",
    "relay",
    "kv_throughput",
    "concurrency",
    "parallel_pipelines",
)
OWN_MESH = (
    "batching",
    "migration",
    "grader",
    "families",
    "router_failover",
    "shared_cores",
    "batch",
    "llama_server",
)


def say(line: str = "") -> None:
    print(line, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Prompts:
    """Prompts of about N tokens, counted with the model's own tokenizer when we have it."""

    def __init__(self, model_path: Path | None) -> None:
        self._llm: Any = None
        if model_path is not None:
            import llama_cpp

            self._llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)

    def count(self, text: str) -> int:
        if self._llm is None:
            return len(text) // 4
        return len(self._llm.tokenize(text.encode(), special=True))

    def pair(self, n: int, tag: str) -> tuple[str, str]:
        """Two prompts of about n tokens and exactly as many each, whose first lines
        differ (no prefix cache serves one from the other)."""
        first = self.of_tokens(n, salt=f"{tag} A")
        length = self.count(first)
        for letter in "BCDEFGHJKLMNPQRSTUVWXYZ":
            second = self.of_tokens(n, salt=f"{tag} {letter}")
            if self.count(second) == length:
                return first, second
        raise SystemExit(f"no second prompt of {length} tokens for {tag!r}")

    def of_tokens(self, n: int, salt: str = "") -> str:
        """About n tokens; a salt changes the first line, so that no prefix cache (Ollama
        keeps one) serves one measured prompt from another."""
        tag = f" ({salt})" if salt else ""
        lines = [f"Review the following student submission{tag} and list its bugs.", ""]
        i = 0
        while True:
            block = [
                f"def step_{i}(values, factor={i % 7}):",
                f"    # scale every value by {i} and drop those under {i * 3}",
                f"    return [v * factor for v in values if v > {i * 3}]",
            ]
            if self.count("\n".join(lines + block)) > n:
                return "\n".join(lines)
            lines += block
            i += 1


def secs(d: Any) -> float:
    return float(d.ToNanoseconds()) / 1e9


class Timed:
    """One measured Generate stream (the router's or a decode node's): seconds from its
    start to each text delta and to its end, its text, tokens and summary."""

    def __init__(self) -> None:
        self.delta_at: list[float] = []
        self.text = ""
        self.tokens = 0
        self.ended = 0.0
        self.summary: Any = None
        self.prefill_reply: Any = None  # two stages called directly: the Prefill reply

    def at(self, i: int) -> float:
        """Seconds to delta i (nan if there was none)."""
        return self.delta_at[i] if len(self.delta_at) > i else float("nan")


async def timed_stream(stub: Any, request: Any, started: float | None = None) -> Timed:
    """Read a Generate stream to its end; times count from started (default: now)."""
    started = time.perf_counter() if started is None else started
    timed = Timed()
    async for reply in stub.Generate(request, timeout=600):
        if reply.HasField("delta"):
            timed.delta_at.append(time.perf_counter() - started)
            timed.text += reply.delta.text
            timed.tokens += len(reply.delta.token_ids) or 1
        else:
            timed.summary = reply.summary
    timed.ended = time.perf_counter() - started
    return timed


class Bench:
    def __init__(self, topology: Topology, model: str, repeats: int, prompts: Prompts) -> None:
        self.topology = topology
        self.model = model
        self.repeats = repeats
        self.prompts = prompts
        route = topology.route(model)
        if route is None:
            raise SystemExit(f"{topology.source}: no model {model!r}")
        if not route.prefill or not route.decode:
            raise SystemExit(f"model {model!r} needs prefill and decode nodes for this benchmark")
        self.prefill: Node = topology.node(route.prefill[0])
        self.decode: Node = topology.node(route.decode[0])
        self.router = topology.router.address
        # ignore_eos where every node of the route can: embedded nodes only.
        self.ignore_eos = all(
            topology.node(n).engine == "llama_cpp" for n in (*route.prefill, *route.decode)
        )

    def greedy(self, max_tokens: int) -> types_pb2.SamplingParams:
        """Greedy and, with ignore_eos, never ended by an end token: every answer is
        max_tokens long (Ollama has no such option: an answer there may end sooner, and the
        work check then says so)."""
        return types_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=self.ignore_eos or None
        )

    async def _prefill(self, stub: Any, prompt: str, max_tokens: int = 1) -> Any:
        request = prefill_pb2.PrefillRequest(
            model=self.model, prompt=prompt, sampling=self.greedy(max_tokens)
        )
        return await stub.Prefill(request, timeout=600)

    async def two_stages(self, prefill: Any, decode: Any, prompt: str, new_tokens: int) -> Timed:
        """What the router does, called directly: prefill, then the decode node's stream
        from the KV handle; times count from before the prefill."""
        started = time.perf_counter()
        reply = await self._prefill(prefill, prompt)
        timed = await timed_stream(decode, self._kv_request(reply, new_tokens), started)
        timed.prefill_reply = reply
        return timed

    def _kv_request(self, reply: Any, max_tokens: int) -> Any:
        return decode_pb2.DecodeServiceGenerateRequest(
            model=self.model,
            kv=decode_pb2.KvSource(
                prefill_address=self.prefill.address,
                kv_handle=reply.kv_handle,
                first_token_id=reply.first_token_id,
                prompt_tokens=reply.prompt_tokens,
                fingerprint=reply.fingerprint,
                kv_size_bytes=reply.kv_size_bytes,
                first_token_text=reply.first_token_text,
            ),
            sampling=self.greedy(max_tokens),
        )

    # 1 -------------------------------------------------------------------------------------
    async def handoff(self, sizes: list[int]) -> list[dict[str, Any]]:
        rows = []
        async with (
            grpc.aio.insecure_channel(self.prefill.address) as pc,
            grpc.aio.insecure_channel(self.decode.address) as dc,
        ):
            prefill: Any = prefill_pb2_grpc.PrefillServiceStub(pc)
            decode: Any = decode_pb2_grpc.DecodeServiceStub(dc)
            for size in sizes:
                handoff, reprefill, kv_bytes, tokens = [], [], 0, 0
                handoff_work, reprefill_work = [], []
                for k in range(self.repeats):
                    # Two prompts of one length: the decode node would otherwise serve the
                    # re-prefill from the prefix it kept of the state it just loaded.
                    prompt, other = self.prompts.pair(size, f"handoff {size} {k}")
                    reply = await self._prefill(prefill, prompt)
                    # llama.cpp is ready once the state is loaded; Ollama only evaluates the
                    # prompt again when asked for a token beyond the prefill node's first.
                    ready = 2 if self.decode.engine == "ollama" else 1
                    summary = (await timed_stream(decode, self._kv_request(reply, ready))).summary
                    handoff_work.append(
                        Work(
                            summary.prompt_tokens,
                            reply.kv_prefix_tokens + summary.cached_prompt_tokens,
                            summary.completion_tokens,
                        )
                    )
                    # Ready to generate: pulled, checked, loaded. With Ollama (token ids) the
                    # decode side's own prompt evaluation is part of the handoff too.
                    handoff.append(
                        secs(summary.kv_fetch_duration)
                        + secs(summary.kv_load_duration)
                        + secs(summary.prompt_eval_duration)
                    )
                    kv_bytes, tokens = reply.kv_size_bytes, reply.prompt_tokens
                    whole = decode_pb2.DecodeServiceGenerateRequest(
                        model=self.model, prompt=other, sampling=self.greedy(ready)
                    )
                    summary = (await timed_stream(decode, whole)).summary
                    reprefill.append(secs(summary.prompt_eval_duration))
                    reprefill_work.append(Work.of(summary))
                ratio = median(handoff) / median(reprefill)
                rows.append(
                    {
                        "prompt_tokens": tokens,
                        "kv_bytes": kv_bytes,
                        "handoff_s": handoff,
                        "reprefill_s": reprefill,
                        "handoff_over_reprefill": ratio,
                        "work": record(
                            ("handoff", "reprefill"), total(handoff_work), total(reprefill_work)
                        ),
                    }
                )
                say(
                    f"   {tokens:>5} tokens: handoff {median(handoff) * 1000:.1f} ms "
                    f"({kv_bytes / 1e6:.1f} MB) vs re-prefill {median(reprefill) * 1000:.0f} ms "
                    f"-> {ratio:.4f}x"
                )
        return rows

    # 2 -------------------------------------------------------------------------------------
    async def overhead(self, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
        """The whole request through the mesh against one process doing the same work, the
        two alternating so that the machine's drift hits both alike: cold, a fresh prompt
        each repeat (nothing cached on either side), and warm, one prompt repeated (the
        mesh's prefix cache holds its whole blocks; the process keeps as many tokens of it
        in its context, llama-cpp-python's own prefix reuse, and evaluates the same rest).
        The first of each is a warm-up."""
        single = self._single_process()
        warm = self.prompts.of_tokens(prompt_tokens, salt="overhead warm")
        result: dict[str, Any] = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
        async with grpc.aio.insecure_channel(self.router) as rc:
            router: Any = router_pb2_grpc.RouterServiceStub(rc)
            for kind in ("cold", "warm"):
                mesh_s: list[float] = []
                single_s: list[float] = []
                stages: dict[str, list[float]] = {"prefill": [], "kv": [], "decode": []}
                mesh_work: list[Work] = []
                single_work: list[Work] = []
                for attempt in range(self.repeats + 1):
                    prompt = (
                        self.prompts.of_tokens(prompt_tokens, salt=f"overhead {attempt}")
                        if kind == "cold"
                        else warm
                    )
                    request = router_pb2.GenerateRequest(
                        model=self.model, prompt=prompt, sampling=self.greedy(new_tokens)
                    )
                    timed = await timed_stream(router, request)
                    summary = timed.summary
                    keep = summary.cached_prompt_tokens if kind == "warm" else 0
                    alone = single.run(prompt, new_tokens, keep) if single else None
                    if not attempt:
                        continue
                    mesh_s.append(timed.ended)
                    mesh_work.append(Work.of(summary))
                    if alone is not None:
                        single_s.append(alone[0])
                        single_work.append(alone[1])
                    stages["prefill"].append(secs(summary.prefill_duration))
                    kv = secs(summary.kv_transfer_duration) + secs(summary.kv_load_duration)
                    stages["kv"].append(kv)
                    stages["decode"].append(secs(summary.decode_duration))
                row: dict[str, Any] = {
                    "mesh_s": mesh_s,
                    "mesh_stages_s": stages,
                    "single_process_s": single_s,
                }
                if single:
                    row["mesh_over_single_process"] = median(mesh_s) / median(single_s)
                    row["work"] = record(
                        ("mesh", "single_process"), total(mesh_work), total(single_work)
                    )
                result[kind] = row
        if single:
            single.close()
        return result

    def _single_process(self) -> SingleProcess | None:
        """The same generation in one process (this one), as without the mesh; None when
        the topology's engine is not llama.cpp."""
        if self.prefill.engine != "llama_cpp" or self.prefill.model is None:
            return None
        return SingleProcess(
            resolve_model_path(self.prefill.model, self.topology.source.parent),
            self.prefill,
            self.topology.threads_for(self.prefill),
        )

    # 3 -------------------------------------------------------------------------------------
    async def relay(self, new_tokens: int, repeats: int) -> dict[str, Any]:
        """Through the router against the same two stages called directly, on a short prompt
        so that the router's own cost is not lost in the prefill's noise. Rates are tokens
        per second as the caller receives them (first to last delta)."""
        prompt = "def fibonacci(n):"
        request = router_pb2.GenerateRequest(
            model=self.model, prompt=prompt, sampling=self.greedy(new_tokens)
        )
        via_ttft, via_rate, direct_ttft, direct_rate = [], [], [], []
        via_work: list[Work] = []
        direct_work: list[Work] = []
        async with (
            grpc.aio.insecure_channel(self.router) as rc,
            grpc.aio.insecure_channel(self.prefill.address) as pc,
            grpc.aio.insecure_channel(self.decode.address) as dc,
        ):
            router: Any = router_pb2_grpc.RouterServiceStub(rc)
            prefill: Any = prefill_pb2_grpc.PrefillServiceStub(pc)
            decode: Any = decode_pb2_grpc.DecodeServiceStub(dc)
            for attempt in range(repeats + 1):  # the first is a warm-up
                via = await timed_stream(router, request)
                direct = await self.two_stages(prefill, decode, prompt, new_tokens)
                if attempt:
                    via_ttft.append(via.at(0))
                    via_rate.append((via.tokens - 1) / (via.ended - via.at(0)))
                    direct_ttft.append(direct.at(0))
                    direct_rate.append((direct.tokens - 1) / (direct.ended - direct.at(0)))
                    via_work.append(Work.of(via.summary))
                    reply, decoded = direct.prefill_reply, direct.summary
                    direct_work.append(
                        Work(
                            reply.prompt_tokens,
                            reply.cached_prompt_tokens,
                            decoded.completion_tokens,
                        )
                    )
        return {
            "new_tokens": new_tokens,
            "via_router_ttft_s": via_ttft,
            "direct_ttft_s": direct_ttft,
            "via_router_tokens_per_s": via_rate,
            "direct_tokens_per_s": direct_rate,
            "router_added_ttft_ms": (median(via_ttft) - median(direct_ttft)) * 1000,
            "relay_tokens_per_s_ratio": median(via_rate) / median(direct_rate),
            "work": record(("via_router", "direct"), total(via_work), total(direct_work)),
        }

    # 4 -------------------------------------------------------------------------------------
    async def kv_throughput(self, target_bytes: int) -> dict[str, Any]:
        """FetchKv as a decode node receives it (its own client, services.common.wire.node_clients),
        each fetch followed at once by the ceiling's stream of the same size. The first pair
        is a warm-up."""
        prompt = self.prompts.of_tokens(max(256, target_bytes // 23_000))
        fetch_rates: list[float] = []
        ceiling_rates: list[float] = []
        sizes: list[int] = []
        ceiling_sizes: list[int] = []
        pool = ChannelPool()
        try:
            client = PrefillClient(pool, self.prefill.address)
            async with (
                grpc.aio.insecure_channel(self.prefill.address) as pc,
                ByteStreamCeiling() as ceiling,
            ):
                prefill: Any = prefill_pb2_grpc.PrefillServiceStub(pc)
                for attempt in range(self.repeats + 1):
                    reply = await self._prefill(prefill, prompt)
                    started = time.perf_counter()
                    received = 0
                    async for chunk in client.fetch_kv(reply.kv_handle, 600):
                        received += len(chunk.data)
                    fetch_rate = received / (time.perf_counter() - started)
                    ceiling_rate, streamed = await ceiling.rate(received)
                    if attempt:
                        fetch_rates.append(fetch_rate)
                        ceiling_rates.append(ceiling_rate)
                        sizes.append(received)
                        ceiling_sizes.append(streamed)
        finally:
            await pool.close()
        return {
            "state_bytes": sizes,
            "fetchkv_bytes_per_s": fetch_rates,
            "plain_stream_bytes_per_s": ceiling_rates,
            "fetchkv_over_ceiling": median(fetch_rates) / median(ceiling_rates),
            "work": record(
                ("fetchkv", "plain_stream"),
                Work(bytes_moved=sum(sizes)),
                Work(bytes_moved=sum(ceiling_sizes)),
            ),
        }

    # 5 -------------------------------------------------------------------------------------
    async def concurrency(self, levels: list[int], new_tokens: int) -> list[dict[str, Any]]:
        models = [m.name for m in self.topology.models]
        rows = []
        async with AsyncMeshClient(self.router) as client:
            single_rate = 0.0
            for level in levels:
                calls = [
                    GenerateCall(
                        models[i % len(models)],
                        prompt=f"Count to a hundred, item {i}: 1, 2, 3,",
                        max_tokens=new_tokens,
                        temperature=0.0,
                        ignore_eos=self.ignore_eos,
                    )
                    for i in range(level)
                ]

                async def timed(call: GenerateCall) -> tuple[float, int, Work] | MeshError:
                    started = time.perf_counter()
                    try:
                        result = await client.generate(call)
                    except MeshError as exc:
                        return exc
                    m = result.metrics
                    return time.perf_counter() - started, m.completion_tokens, Work.of(m)

                started = time.perf_counter()
                outcomes = await asyncio.gather(*(timed(c) for c in calls))
                wall = time.perf_counter() - started
                done = [o for o in outcomes if not isinstance(o, MeshError)]
                latencies = [o[0] for o in done]
                rate = sum(o[1] for o in done) / wall
                if level == 1:
                    single_rate = rate
                rows.append(
                    {
                        "concurrent": level,
                        "completed": len(done),
                        "errors": [str(o) for o in outcomes if isinstance(o, MeshError)],
                        "p50_s": pct(latencies, 0.5),
                        "p95_s": pct(latencies, 0.95),
                        "p99_s": pct(latencies, 0.99),
                        "tokens_per_s": rate,
                        "over_single_stream": rate / single_rate if single_rate else float("nan"),
                        "work_done": asdict(total([o[2] for o in done])),
                    }
                )
                say(
                    f"   {level:>2} at once: {len(done)}/{level} done, "
                    f"p50 {pct(latencies, 0.5):.2f} s, p95 {pct(latencies, 0.95):.2f} s, "
                    f"{rate:.0f} tok/s ({rows[-1]['over_single_stream']:.2f}x single)"
                )
        return rows


class SingleProcess:
    """llama-cpp-python in this process with the node's settings: Llama.eval evaluates the
    prompt (in n_batch pieces, after the positions its context keeps), then one token at a
    time, each sampled by llama.cpp's greedy sampler behind the same end-token bias as the
    node's (ignore_eos) and detokenized as a stream would be."""

    def __init__(self, model_path: Path, node: Node, threads: int) -> None:
        import llama_cpp

        from services.common.engines.llama_cpp.sampling import SlotSampler, end_tokens

        self.llm: Any = llama_cpp.Llama(
            model_path=str(model_path),
            n_ctx=node.n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=node.n_batch,
            n_ubatch=node.n_ubatch,
            flash_attn=node.flash_attn,
            verbose=False,
        )
        # The node's own chain for a greedy ignore_eos request: end tokens at -inf, greedy.
        n_vocab = self.llm.n_vocab()
        self._sampler = SlotSampler(
            Sampling(max_tokens=1, temperature=0.0, ignore_eos=True),
            0,
            end_tokens(self.llm._model.vocab, n_vocab),
            n_vocab,
        )

    def run(self, prompt: str, new_tokens: int, keep: int) -> tuple[float, Work]:
        """Seconds to generate new_tokens after prompt, keeping at most `keep` positions of
        what the context holds (0: cold); and the work done."""
        llm = self.llm
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        held = llm.input_ids[: min(keep, llm.n_tokens, len(tokens) - 1)].tolist()
        # held is no longer than tokens: the positions both have, up to the first difference
        pairs = zip(held, tokens[: len(held)], strict=True)
        reused = next((i for i, (a, b) in enumerate(pairs) if a != b), len(held))
        llm.n_tokens = reused  # Llama.eval drops every cell from here on
        generated = 0
        started = time.perf_counter()
        llm.eval(tokens[reused:])
        while True:
            token = self._sampler.sample(llm.ctx, -1)
            llm.detokenize([token])
            generated += 1
            if generated == new_tokens:
                break
            llm.eval([token])
        elapsed = time.perf_counter() - started
        return elapsed, Work(len(tokens), reused, generated)

    def close(self) -> None:
        self._sampler.close()


class ByteStreamCeiling:
    """A plain gRPC stream of N bytes in 1 MiB messages from another process: the ceiling
    for FetchKv (bench/byte_stream_server.py)."""

    async def __aenter__(self) -> ByteStreamCeiling:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "bench/byte_stream_server.py"),
            stdout=asyncio.subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        port = int(await self._proc.stdout.readline())
        self._channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 8 * MiB)]
        )
        self._stream: Any = self._channel.unary_stream("/bench.Bytes/Stream")
        return self

    async def rate(self, size: int) -> tuple[float, int]:
        """Bytes per second of a stream of `size` bytes, and the bytes received."""
        started = time.perf_counter()
        received = 0
        async for chunk in self._stream(str(size).encode()):
            received += len(chunk)
        return received / (time.perf_counter() - started), received

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()
        self._proc.terminate()
        await self._proc.wait()


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import importlib.metadata as md

    from services.common.engines.llama_cpp.model import gpu_backend

    versions = {name: md.version(name) for name in ("llama-cpp-python", "grpcio", "protobuf")}
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "gpu": gpu_name(),
        "llama_cpp_backend": gpu_backend() or "CPU",
        "python": platform.python_version(),
        "versions": versions,
    }


def gpu_name() -> str:
    """The NVIDIA GPU's name and memory (nvidia-smi), "" without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


async def run_all(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    threads = os.cpu_count() or 1  # rows 7 and 8: the node of their own has the machine
    steps: list[tuple[str, str, Callable[[], Awaitable[Any]]]] = [
        (
            "handoff_vs_reprefill",
            "1. KV handoff vs re-prefill on the decode node",
            lambda: bench.handoff(args.sizes),
        ),
        (
            "overhead",
            "2. mesh overhead against one process",
            lambda: bench.overhead(args.overhead_tokens, 64),
        ),
        (
            "relay",
            "3. router relay cost",
            lambda: bench.relay(64, bench.repeats * 3),
        ),
        ("kv_throughput", "4. KV transfer throughput", lambda: bench.kv_throughput(args.kv_bytes)),
        (
            "concurrency",
            "5. concurrency through the router",
            lambda: bench.concurrency([1, 4, 16], 32),
        ),
        (
            "parallel_pipelines",
            "6. the grader's two calls, sequential vs parallel",
            lambda: measure_parallel(bench.router, bench.repeats, 64, bench.ignore_eos),
        ),
        (
            "batching",
            "7., 8. and 13. on a decode node of its own (this machine)",
            lambda: measure_batching(
                [1, 4, 8, 16], args.batch_tokens, bench.repeats, args.prompt_tokens, threads
            ),
        ),
        (
            "migration",
            "9. resume after a decode node dies (a mesh of its own)",
            lambda: measure_migration(args.kills, 200),
        ),
        (
            "grader",
            "10. grader traffic with and without the prefix cache (meshes of their own)",
            lambda: measure_grader(args.grader_requests, 1500, 200),
        ),
        (
            "families",
            "11. a sliding-window model's handoff (meshes of their own)",
            lambda: measure_families(args.family_tokens, bench.repeats),
        ),
        (
            "router_failover",
            "12. resume after the serving router dies (a mesh of its own)",
            lambda: measure_router_failover(args.kills, 200),
        ),
        (
            "shared_cores",
            "14. engine nodes sharing this machine's cores (a mesh of its own)",
            lambda: measure_shared_cores(8, 64, bench.repeats),
        ),
        (
            "batch",
            "15. the grader as one batch against all at once (a mesh of its own)",
            lambda: measure_batch(args.grader_requests, 1500, 200),
        ),
        (
            "llama_server",
            "16. make run's mesh against llama-server (a mesh and a server of their own)",
            lambda: measure_llama_server(bench.repeats, min(args.grader_requests, 8)),
        ),
    ]
    for key, title, step in steps:
        if args.only and key not in args.only:
            continue
        if key in OWN_MESH and args.running:
            say(f">> {title}: skipped with --running (it starts a node on this machine)")
            continue
        say(f">> {title}")
        started = time.perf_counter()
        results[key] = await step()
        say(f"   ({time.perf_counter() - started:.0f} s)")
    return results


def table(r: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    for h in r.get("handoff_vs_reprefill", []):
        rows.append(
            (
                f"handoff / re-prefill, {h['prompt_tokens']} tokens",
                figure(f"{h['handoff_over_reprefill']:.4f}x", h.get("work")),
                "<= 0.05x at ~1,000" if 900 < h["prompt_tokens"] < 1100 else "falls with size",
            )
        )
    o = r.get("overhead", {})
    for kind, what in (("cold", "a new prompt each time"), ("warm", "the prompt cached")):
        row = o.get(kind, {})
        if "mesh_over_single_process" in row:
            cached = row["work"]["mesh"]["cached_tokens"] // max(1, len(row["mesh_s"]))
            rows.append(
                (
                    f"mesh / single process, {o['prompt_tokens']} + {o['new_tokens']} tokens, "
                    f"{kind} ({what}{f': {cached} tokens' if cached else ''})",
                    figure(f"{row['mesh_over_single_process']:.3f}x", row["work"]),
                    "<= 1.10x",
                )
            )
    if "relay" in r:
        relay = r["relay"]
        ratio = figure(f"{relay['relay_tokens_per_s_ratio']:.3f}x", relay.get("work"))
        rows.append(("router relay tokens/s / direct", ratio, ">= 0.95x"))
        rows.append(("router added TTFT", f"{relay['router_added_ttft_ms']:.1f} ms", "<= 5 ms"))
    if "kv_throughput" in r:
        k = r["kv_throughput"]
        size_mb = median([float(s) for s in k["state_bytes"]]) / 1e6
        fetch, plain = median(k["fetchkv_bytes_per_s"]), median(k["plain_stream_bytes_per_s"])
        rows.append(
            (
                f"FetchKv / plain gRPC stream, {size_mb:.0f} MB",
                figure(
                    f"{k['fetchkv_over_ceiling']:.2f}x ({fetch / 1e9:.2f} vs "
                    f"{plain / 1e9:.2f} GB/s)",
                    k.get("work"),
                ),
                ">= 0.8x",
            )
        )
    for c in r.get("concurrency", []):
        latency = f"{c['p50_s']:.2f}/{c['p95_s']:.2f}/{c['p99_s']:.2f} s"
        gain = (
            f", {c['over_one_slot_per_node']:.2f}x one slot per node"
            if "over_one_slot_per_node" in c
            else ""
        )
        rows.append(
            (
                f"{c['concurrent']} concurrent: done, errors, p50/p95/p99",
                figure(
                    f"{c['completed']}, {len(c['errors'])}, {latency}, "
                    f"{c['over_single_stream']:.2f}x tok/s{gain}",
                    c.get("work"),
                ),
                "0 errors",
            )
        )
    if "parallel_pipelines" in r:
        pipelines = r["parallel_pipelines"]
        speedup = figure(
            f"{pipelines['speedup_parallel_over_sequential']:.2f}x", pipelines.get("work")
        )
        rows.append(("grader's 2 calls: parallel speedup", speedup, "-"))
    if "batching" in r:
        b = r["batching"]
        for d in b["batched_decode"]:
            rows.append(
                (
                    f"{d['streams']} streams on one decode node: tok/s / 1 stream, / raw "
                    f"llama.cpp at {d['streams']}",
                    figure(
                        f"{d['over_one_stream']:.2f}x, {d['over_raw_llama_cpp']:.2f}x "
                        f"(raw itself: {d['raw_over_its_one_stream']:.2f}x)",
                        d.get("work"),
                    ),
                    ">= 0.85x of raw",
                )
            )
        i = b["interference"]
        rows.append(
            (
                f"{i['prompt_tokens']}-token prompt while {i['streams']} streams: p99 "
                "inter-token / idle",
                f"{i['p99_over_idle']:.2f}x",
                "<= 3x",
            )
        )
        rows += structured_rows(b)
    if "migration" in r:
        rows += migration_rows(r["migration"])
    if "grader" in r:
        rows += grader_rows(r["grader"])
    if "families" in r:
        rows += families_rows(r["families"])
    if "router_failover" in r:
        rows += router_failover_rows(r["router_failover"])
    if "shared_cores" in r:
        rows += shared_cores_rows(r["shared_cores"])
    if "batch" in r:
        rows += batch_rows(r["batch"])
    if "llama_server" in r:
        rows += llama_server_rows(r["llama_server"])
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    header = ("measurement", "result", "goal")
    lines = ["  ".join(h.ljust(width[i]) for i, h in enumerate(header))]
    lines += ["  ".join(cell.ljust(width[i]) for i, cell in enumerate(row)) for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topology", default=str(ROOT / "topology/local.toml"))
    parser.add_argument(
        "--running", action="store_true", help="use the running nodes of --topology"
    )
    parser.add_argument("--model", help="logical model to measure (default: the topology's first)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[250, 1000, 3000], help="prompt tokens"
    )
    parser.add_argument("--overhead-tokens", type=int, default=1000)
    parser.add_argument("--kv-bytes", type=int, default=50_000_000)
    parser.add_argument(
        "--batch-tokens", type=int, default=160, help="tokens per stream, batched decode"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=3000, help="the prompt that interferes"
    )
    parser.add_argument("--kills", type=int, default=5, help="decode nodes killed, row 9")
    parser.add_argument(
        "--grader-requests",
        type=int,
        default=20,
        help="submissions sharing a rubric, rows 10 and 15",
    )
    parser.add_argument("--family-tokens", type=int, default=2000, help="prompt tokens, row 11")
    parser.add_argument(
        "--quick", action="store_true", help="1 repeat, smaller prompts (a smoke run)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[*ON_THE_MESH, *OWN_MESH],
        help="run only these measurements",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.sizes, args.overhead_tokens, args.kv_bytes = (
            1,
            [250, 1000],
            250,
            5_000_000,
        )
        args.batch_tokens, args.prompt_tokens, args.kills = 96, 1000, 2
        args.grader_requests, args.family_tokens = 4, 1000

    topology = load_topology(args.topology)
    model = args.model or topology.models[0].name
    first = topology.route(model)
    engine_node = topology.node(first.prefill[0]) if first and first.prefill else None
    model_path = None
    if engine_node is not None and engine_node.engine == "llama_cpp" and engine_node.model:
        model_path = resolve_model_path(engine_node.model, topology.source.parent)
    bench = Bench(topology, model, args.repeats, Prompts(model_path))

    started = time.perf_counter()
    with local_mesh(topology, args.running):
        results = asyncio.run(run_all(bench, args))
    if "concurrency" in results and not args.running:
        results["concurrency_one_slot"] = one_slot_concurrency(bench, Path(args.topology))
        for row, before in zip(
            results["concurrency"], results["concurrency_one_slot"], strict=True
        ):
            row["over_one_slot_per_node"] = row["tokens_per_s"] / before["tokens_per_s"]
            row["work"] = record(
                ("batched", "one_slot_per_node"),
                Work(**row["work_done"]),
                Work(**before["work_done"]),
            )
    run_record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "topology": str(args.topology),
        "model": model,
        "repeats": args.repeats,
        "wall_s": time.perf_counter() - started,
        **results,
    }
    report(args.out, "bench", run_record, table(results))
    return check_same_work(results)


def check_same_work(results: dict[str, Any]) -> int:
    """1 (and what differed) when any row's two sides did different work, else 0."""
    bad = failures(results)
    for line in bad:
        say(f"!! different work on the two sides of {line}")
    return 1 if bad else 0


@contextmanager
def local_mesh(topology: Topology, running: bool) -> Iterator[None]:
    """Every node of the topology started on this machine for the block (nothing with
    --running: the nodes already run, wherever they are)."""
    if running:
        yield
        return
    mesh = MeshProcesses(topology, Path(tempfile.mkdtemp(prefix="bench-logs-")))
    say(f">> starting {len(topology.nodes)} nodes of {topology.source}")
    mesh.start()
    try:
        asyncio.run(mesh.wait_serving(300, progress=say))
        yield
    finally:
        mesh.stop()


def one_slot_concurrency(bench: Bench, path: Path) -> list[dict[str, Any]]:
    """Row 5 again on the same topology with one slot per embedded node: every node serving
    one request at a time, as before continuous batching. The variant file sits beside the
    original (model paths are relative to it) while it runs."""
    lines = []
    for line in path.read_text().splitlines():
        if re.match(r"\s*slots\s*=", line):
            continue
        lines.append(line)
        if re.match(r'\s*engine\s*=\s*"llama_cpp"', line):
            lines.append("slots = 1")
    variant = path.with_name(f".{path.stem}.one-slot.toml")
    variant.write_text("\n".join(lines) + "\n")
    try:
        one_slot = load_topology(variant)
        with local_mesh(one_slot, running=False):
            say(">> 5. again, one slot per node")
            return asyncio.run(
                Bench(one_slot, bench.model, bench.repeats, bench.prompts).concurrency(
                    [1, 4, 16], 32
                )
            )
    finally:
        variant.unlink(missing_ok=True)


def report_alone(
    out: Path, key: str, repeats: int, started: float, result: dict[str, Any], table_text: str
) -> None:
    """A benchmark run on its own (bench/batching.py, migration.py, grader.py): its record,
    with the machine and date, under its key."""
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "repeats": repeats,
        "wall_s": time.perf_counter() - started,
        key: result,
    }
    report(out, key, record, table_text)


def report(out: Path, prefix: str, record: dict[str, Any], table_text: str) -> None:
    """Write the record as JSON under out/ and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    say()
    say(table_text)
    say(f"\n(medians of {record['repeats']}; {record['wall_s']:.0f} s in all; written to {path})")


if __name__ == "__main__":
    sys.exit(main())
