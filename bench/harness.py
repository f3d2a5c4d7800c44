"""Driving a mesh for run.py's rows 1-6 (and modes.py): prompts of a given token count, timed
streams, and `Bench`, with the in-process llama-cpp-python and byte-stream references those
rows measure against."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.common import ROOT, median, metric, metrics_text, on_llama_thread, pct, say, secs
from bench.work import Work, record, total
from disagg_mesh import AsyncMeshClient, GenerateCall, MeshError
from disagg_mesh.proto.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    types_pb2,
)
from disagg_mesh.server.common.config.topology import Node, Topology
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.types import Sampling
from disagg_mesh.server.common.wire.node_clients import ChannelPool, PrefillClient

MiB = 1 << 20


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
            kv=decode_pb2.KvSource(prefill_address=self.prefill.address, reference=reply.reference),
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
                per_token: dict[str, list[float]] = {}
                for attempt in range(self.repeats + 1):
                    prompt = (
                        self.prompts.of_tokens(prompt_tokens, salt=f"overhead {attempt}")
                        if kind == "cold"
                        else warm
                    )
                    request = router_pb2.GenerateRequest(
                        model=self.model, prompt=prompt, sampling=self.greedy(new_tokens)
                    )
                    before, caller_cpu = await self._per_token_meters(), time.process_time()
                    timed = await timed_stream(router, request)
                    caller_cpu = time.process_time() - caller_cpu
                    after = await self._per_token_meters()
                    summary = timed.summary
                    keep = summary.cached_prompt_tokens if kind == "warm" else 0
                    alone = (
                        await on_llama_thread(single.run, prompt, new_tokens, keep)
                        if single
                        else None
                    )
                    if not attempt:
                        continue
                    for name, used in after.items():
                        per_token.setdefault(name, []).append(used - before.get(name, 0.0))
                    per_token.setdefault("caller_cpu_s", []).append(caller_cpu)
                    per_token.setdefault("generated", []).append(timed.tokens)
                    if single:
                        per_token.setdefault("single_steps_s", []).append(single.steps_s)
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
                    "per_token_ms": per_token_ms(per_token),
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

    async def _per_token_meters(self) -> dict[str, float]:
        """What row 2 splits a generated token's time by, read from the nodes' /metrics (a
        node without metrics_port is left out): the router's CPU seconds so far, and the
        route's decode nodes' engine steps (count and seconds)."""
        route = self.topology.route(self.model)
        assert route is not None
        meters: dict[str, float] = {}
        async with aiohttp.ClientSession() as session:
            for node in (self.topology.router, *map(self.topology.node, route.decode)):
                if node.metrics_port is None:
                    continue
                text = await metrics_text(session, node)
                if node.role == "router":
                    meters["router_cpu_s"] = metric(text, "process_cpu_seconds_total")
                    continue
                for what in ("count", "sum"):
                    step = metric(text, f"disagg_engine_step_seconds_{what}")
                    meters[f"decode_steps_{what}"] = meters.get(f"decode_steps_{what}", 0.0) + step
        return meters

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
        """FetchKv as a decode node receives it (its own client,
        disagg_mesh.server.common.wire.node_clients), each fetch followed at once by the
        ceiling's stream of the same size. The first pair is a warm-up."""
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


def per_token_ms(per_token: dict[str, list[float]]) -> dict[str, float]:
    """Row 2's milliseconds a generated token, over the measured requests: the decode node's
    engine step (its pass, sampling and hand-over), the single process's step (the same),
    and the CPU the relay took besides: the router's process and the caller's (this
    process, reading the stream). Keys whose meters were missing are left out."""
    generated = sum(per_token.get("generated", [])) or 1
    out: dict[str, float] = {}
    steps = sum(per_token.get("decode_steps_count", []))
    if steps:
        out["decode_node_step"] = 1000 * sum(per_token["decode_steps_sum"]) / steps
    if per_token.get("single_steps_s"):
        out["single_process_step"] = 1000 * median(per_token["single_steps_s"])
    for name in ("router_cpu_s", "caller_cpu_s"):
        if name in per_token:
            out[name.removesuffix("_s")] = 1000 * sum(per_token[name]) / generated
    return out


class SingleProcess:
    """llama-cpp-python in this process with the node's settings (its KV cache types too):
    Llama.eval evaluates the prompt (in n_batch pieces, after the positions its context
    keeps), then one token at a time, each sampled by llama.cpp's greedy sampler behind the
    same end-token bias as the node's (ignore_eos) and detokenized as a stream would be."""

    def __init__(self, model_path: Path, node: Node, threads: int) -> None:
        import llama_cpp

        from disagg_mesh.server.common.engines.llama_cpp.model import (
            KV_CACHE_TYPES,
            gpu_backend,
            layers_on_gpu,
        )
        from disagg_mesh.server.common.engines.llama_cpp.sampling import SlotSampler, end_tokens

        # Layers where the node puts them: all on the GPU of a GPU build unless the topology
        # says otherwise (llama-cpp-python's own default is none).
        gpu_layers = layers_on_gpu(node.n_gpu_layers, gpu_backend())
        self.llm: Any = llama_cpp.Llama(
            model_path=str(model_path),
            n_gpu_layers=gpu_layers,
            n_ctx=node.n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=node.n_batch,
            n_ubatch=node.n_ubatch,
            flash_attn=node.flash_attn,
            type_k=KV_CACHE_TYPES[node.type_k].ggml_type,
            type_v=KV_CACHE_TYPES[node.type_v].ggml_type,
            verbose=False,
        )
        # The node's own chain for a greedy ignore_eos request: end tokens at -inf, greedy.
        n_vocab = self.llm.n_vocab()
        self.steps_s = 0.0  # the last run's seconds a generated token (`run`)
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
        prompt_done = time.perf_counter()
        while True:
            token = self._sampler.sample(llm.ctx, -1)
            llm.detokenize([token])
            generated += 1
            if generated == new_tokens:
                break
            llm.eval([token])
        ended = time.perf_counter()
        # Each generated token after the first: its pass, sampling and text.
        self.steps_s = (ended - prompt_done) / max(1, generated - 1)
        return ended - started, Work(len(tokens), reused, generated)

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
