"""How a decode step's time grows with KV cells that are not its streams' own.

    python -m bench.kv_view [--streams 16 1] [--other 0 4096 16384] [--repeats 2]
        [--layouts unified streams] [--type-k f16] [--shared 1500]

Raw llama.cpp in this process (bench/batching.py's RawBatched), in the node's unified
context or with one KV stream a sequence (`--layouts`: llama.cpp's non-unified cache,
llama-server's default): `--other` cells of another sequence are evaluated first, then the
streams' prompts; in the unified context every step's attention and mask span those cells
too (as a node's prefix cache and parked cells do), in its own stream a sequence attends to
its own cells only. Then greedy steps of one token a stream. Reported per step: its time
(against the same layout with no other cells), the time llama_decode took to return (on a
GPU: the graph built and queued, the mask included), and the wait for the first row's
logits (on a GPU: the rest of the pass). The other cells are evaluated once a layout and
count, then each repeat starts its streams afresh beside them. `--shared N`: every stream's
prompt begins with the same N-token rubric (the grader's shape), evaluated once and given
to the others as the node's prefix cache gives it (`share_prefix`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

from bench.batching import N_CTX, SLOTS, RawBatched, counting, rubric_text
from bench.common import MODEL, ROOT, median, say
from bench.kv_streams import export_buffer, load_buffer
from disagg_mesh.server.common.engines.llama_cpp.model import KV_CACHE_TYPES
from disagg_mesh.server.common.engines.llama_cpp.sampling import SlotSampler
from disagg_mesh.server.common.models import resolve_model_path
from disagg_mesh.server.common.types import Sampling

OTHER_SEQ = SLOTS  # RawBatched's context has SLOTS + 1 sequences
LAYOUTS = ("unified", "streams")


def step_times(
    raw: RawBatched, streams: int, new_tokens: int, other: int, shared: int = 0
) -> tuple[float, float, float, float]:
    """Seconds a step: whole, llama_decode's return, the first row's logits after it; and
    the seconds the shared prefix took to reach every stream.
    `shared`: the streams' prompts begin with the same `shared` tokens (a rubric), evaluated
    once and given to every stream as the node's prefix cache would: in the unified cache
    the same cells (llama_memory_seq_cp), with one stream a sequence a copy each (the first
    stream's state loaded into the others)."""
    memory = llama_cpp.llama_get_memory(raw._ctx)
    for s in range(OTHER_SEQ):
        llama_cpp.llama_memory_seq_rm(memory, s, -1, -1)
    if llama_cpp.llama_memory_seq_pos_max(memory, OTHER_SEQ) + 1 != other:
        llama_cpp.llama_memory_clear(memory, True)
        for start in range(0, other, 512):
            end = min(other, start + 512)
            raw._decode([(100 + p % 1000, p, OTHER_SEQ, False) for p in range(start, end)])
    greedy = Sampling(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    samplers = [SlotSampler(greedy, 0, raw.ends, raw.llm.n_vocab()) for _ in range(streams)]
    prefix, given = rubric(raw, shared), 0.0
    if prefix:
        for start in range(0, len(prefix), 512):
            piece = prefix[start : start + 512]
            raw._decode([(t, start + i, 0, False) for i, t in enumerate(piece)])
        given = share_prefix(raw, len(prefix), streams)
    prompts = [
        raw.llm.tokenize(counting(i).encode(), add_bos=not prefix, special=True)
        for i in range(streams)
    ]
    last = []
    for s, tokens in enumerate(prompts):
        at = len(prefix)
        raw._decode([(t, at + p, s, p == len(tokens) - 1) for p, t in enumerate(tokens)])
        last.append(samplers[s].sample(raw._ctx, len(tokens) - 1))
    positions = [len(prefix) + len(t) for t in prompts]
    returned = waited = 0.0
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        raw._decode([(last[s], positions[s], s, True) for s in range(streams)])
        t1 = time.perf_counter()
        last[0] = samplers[0].sample(raw._ctx, 0)
        waited += time.perf_counter() - t1
        returned += t1 - t0
        for s in range(1, streams):
            last[s] = samplers[s].sample(raw._ctx, s)
        positions = [p + 1 for p in positions]
    steps = new_tokens - 1
    for sampler in samplers:
        sampler.close()
    return (time.perf_counter() - started) / steps, returned / steps, waited / steps, given


def rubric(raw: RawBatched, tokens: int) -> list[int]:
    """A grader's rubric of `tokens` tokens (none for 0), BOS first."""
    if not tokens:
        return []
    ids: list[int] = raw.llm.tokenize(rubric_text(tokens).encode(), add_bos=True, special=True)
    return ids[:tokens]


def share_prefix(raw: RawBatched, tokens: int, streams: int) -> float:
    """Sequence 0's first `tokens` positions given to sequences 1..streams-1; seconds it
    took."""
    memory = llama_cpp.llama_get_memory(raw._ctx)
    started = time.perf_counter()
    if raw.unified:
        for s in range(1, streams):
            llama_cpp.llama_memory_seq_cp(memory, 0, s, 0, tokens)
        return time.perf_counter() - started
    # One stream a sequence: whole buffers only between streams, so the state's bytes (its
    # one stream with cells goes to whichever sequence loads it).
    state = export_buffer(raw._ctx, 0)
    for s in range(1, streams):
        if not load_buffer(raw._ctx, state, s):
            raise RuntimeError("state load failed")
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--other", type=int, nargs="+", default=[0, 4096, 16384])
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["unified"])
    parser.add_argument("--type-k", choices=sorted(KV_CACHE_TYPES), default="f16")
    parser.add_argument(
        "--shared", type=int, default=0, help="tokens every stream's prompt begins with"
    )
    args = parser.parse_args()
    threads = args.threads or os.cpu_count() or 1
    for layout in args.layouts:
        # One stream a sequence: each as big as the other cells and a slot's n_ctx need.
        cells = max([*args.other, N_CTX]) + 256 if layout == "streams" else 0
        raw = RawBatched(
            resolve_model_path(MODEL, ROOT), threads, stream_cells=cells, type_k=args.type_k
        )
        try:
            base: dict[int, float] = {}
            for other in args.other:
                for streams in args.streams:
                    runs = [
                        step_times(raw, streams, args.new_tokens, other, args.shared)
                        for _ in range(args.repeats)
                    ]
                    step, returned, waited, given = (median([r[k] for r in runs]) for k in range(4))
                    base.setdefault(streams, step)
                    say(
                        f"{layout}, K {args.type_k}: {streams:>2} streams"
                        f"{f' sharing {args.shared} tokens' if args.shared else ''}, {other:>5} "
                        f"other cells: step {step * 1e3:.2f} ms ({step / base[streams]:.2f}x), "
                        f"llama_decode returned after {returned * 1e3:.2f} ms, first logits "
                        f"{waited * 1e3:.2f} ms after that"
                        + (f"; the shared prefix given in {given * 1e3:.1f} ms" if given else "")
                    )
        finally:
            raw.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
