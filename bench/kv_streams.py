"""Would one KV stream a sequence keep the node's guarantees? (#42)

    python -m bench.kv_streams [--type-k f16] [--new-tokens 64]

In the node's unified cache a step attends to every resident cell up to the highest in use,
other sequences' included (`python -m bench.kv_view --layouts unified streams` measures what
that costs); with llama.cpp's non-unified cache (llama-server's default) each sequence has a
KV stream of its own and attends to its own cells only. What stands in the way is what the
node does with states, checked here with raw llama.cpp (SmolLM2, this process, greedy,
flash attention, 2 threads), each against a reference computed in the same run:

1. a state exported from a one-sequence context loads into slot k of a context with one
   stream a sequence. llama.cpp refuses it as it is ("n_stream mismatch": the state's
   header counts the exporting cache's streams); with the count rewritten (`with_streams`:
   the same cells, empty records for the other streams) it loads, and decodes the same
   greedy tokens alone and beside two other streams;
2. a state exported from slot k there carries one non-empty stream (the others empty), so
   it reduces to a one-stream state any node loads;
3. only the uncached delta moves: llama.cpp copies cells between streams only as whole
   buffers (`seq_cp` asserts "only supported for full KV buffers"), so a prefix shared
   across slots cannot stay resident and be copied in part as the unified cache does (one
   cell, many sequences). Kept as a state's bytes instead (outside every attended view), a
   cached prefix and a request's delta join into one state (`joined`) that loads in one
   call, and decodes as the same chunks evaluated in one process.

The state's bytes are read and rewritten by `kv_state.py`.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from dataclasses import replace
from typing import Any

# isort: off
# llama.cpp's libraries load before grpc's (services/node.py says why).
import llama_cpp
# isort: on

import numpy as np

from bench.batching import decode_rows, rubric_text
from bench.common import MODEL, ROOT, say
from bench.kv_state import caches, joined, with_streams
from disagg_mesh.server.common.engines.llama_cpp.model import KV_CACHE_TYPES
from disagg_mesh.server.common.models import resolve_model_path

# A llama_context pointer as llama_cpp's bindings hand it out.
Context = Any
CELLS_PER_SEQ = 2048


def export_buffer(ctx: Context, seq: int) -> ctypes.Array[ctypes.c_uint8]:
    """The sequence's state, as llama.cpp writes it."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq))
    buf = (ctypes.c_uint8 * size)()
    if llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq) != size:
        raise RuntimeError("state export failed")
    return buf


def load_buffer(ctx: Context, buf: ctypes.Array[ctypes.c_uint8], seq: int) -> bool:
    """Whether llama.cpp loaded the whole state into the sequence."""
    return bool(llama_cpp.llama_state_seq_set_data(ctx, buf, len(buf), seq) == len(buf))


class Raw:
    """SmolLM2 through llama.cpp's own API: contexts, greedy decoding, states."""

    def __init__(self, type_k: str, path: str | None = None) -> None:
        """SmolLM2, or the GGUF at `path`."""
        self.model = llama_cpp.llama_model_load_from_file(
            (path or str(resolve_model_path(MODEL, ROOT))).encode(),
            llama_cpp.llama_model_default_params(),
        )
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.type_k = KV_CACHE_TYPES[type_k].ggml_type
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.contexts: list[Context] = []

    def context(self, sequences: int, unified: bool) -> Context:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = CELLS_PER_SEQ * sequences
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = sequences
        params.kv_unified = unified
        params.n_threads = params.n_threads_batch = 2
        params.type_k = self.type_k
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.contexts.append(ctx)
        return ctx

    def tokens(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * 4096)()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, 4096, True, True)
        return list(buf[:n])

    def decode(self, ctx: Context, rows: list[tuple[int, int, int, bool]]) -> None:
        decode_rows(ctx, self.batch, rows)

    def pick(self, ctx: Context, row: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.n_vocab,))))

    def prompt(self, ctx: Context, seq: int, tokens: list[int], start: int = 0) -> int:
        """Evaluate tokens at positions start.. in 512-token pieces; the first token."""
        for a in range(0, len(tokens), 512):
            piece = tokens[a : a + 512]
            last = a + len(piece) == len(tokens)
            self.decode(
                ctx,
                [
                    (t, start + a + i, seq, last and i == len(piece) - 1)
                    for i, t in enumerate(piece)
                ],
            )
        return self.pick(ctx, (len(tokens) - 1) % 512)

    def greedy(self, ctx: Context, starts: list[tuple[int, int, int]], n: int) -> list[list[int]]:
        """(sequence, first token, its position) decoded together, n steps: their tokens."""
        texts = [[first] for _, first, _ in starts]
        now = list(starts)
        for _ in range(n):
            self.decode(ctx, [(token, pos, seq, True) for seq, token, pos in now])
            now = [(seq, self.pick(ctx, i), pos + 1) for i, (seq, _, pos) in enumerate(now)]
            for text, (_, token, _) in zip(texts, now, strict=True):
                text.append(token)
        return texts

    def export(self, ctx: Context, seq: int) -> bytes:
        return bytes(export_buffer(ctx, seq))

    def load(self, ctx: Context, state: bytes, seq: int) -> bool:
        return load_buffer(ctx, (ctypes.c_uint8 * len(state)).from_buffer_copy(state), seq)

    def close(self) -> None:
        for ctx in self.contexts:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_model_free(self.model)


def rubric_and_submission() -> tuple[str, str]:
    rubric = rubric_text(30)
    return rubric, rubric + "\nSubmission 1: def f(x): return x * 3 + 9\nGrade:"


def check(type_k: str, new_tokens: int) -> bool:
    raw = Raw(type_k)
    held = []
    try:
        rubric, prompt = rubric_and_submission()
        tokens, prefix = raw.tokens(prompt), raw.tokens(rubric)
        if tokens[: len(prefix)] != prefix:
            raise RuntimeError("the rubric's tokens are not the prompt's first ones")
        one = raw.context(1, unified=True)
        first = raw.prompt(one, 0, tokens)
        state = raw.export(one, 0)
        alone = raw.greedy(one, [(0, first, len(tokens))], new_tokens)[0]

        # 1. Into slot 2 of a context with one stream a sequence.
        four = raw.context(4, unified=False)
        refused = not raw.load(four, state, 2)
        began = time.perf_counter()
        rewritten = with_streams(state, 4)
        loaded = raw.load(four, rewritten, 2)
        load_s = time.perf_counter() - began
        by_itself = raw.greedy(four, [(2, first, len(tokens))], new_tokens)[0]
        memory = llama_cpp.llama_get_memory(four)
        llama_cpp.llama_memory_seq_rm(memory, 2, -1, -1)
        raw.load(four, rewritten, 2)
        others = [raw.tokens(f"Count from {i} to one thousand: {i}, {i + 1},") for i in (1, 2)]
        firsts = [raw.prompt(four, s, t) for s, t in enumerate(others)]
        company = raw.greedy(
            four,
            [
                (0, firsts[0], len(others[0])),
                (1, firsts[1], len(others[1])),
                (2, first, len(tokens)),
            ],
            new_tokens,
        )[2]
        held.append(refused and loaded and by_itself == alone and company == alone)
        say(
            f"1. a one-stream state ({len(state) / 1e6:.1f} MB, {len(tokens)} tokens) into "
            f"slot 2 of 4 streams: as it is {'refused' if refused else 'loaded'}; the count "
            f"rewritten {'loaded' if loaded else 'refused'} ({load_s * 1e3:.1f} ms with the "
            f"rewrite); greedy {new_tokens} tokens = one process's alone: {by_itself == alone}, "
            f"beside 2 other streams: {company == alone}"
        )

        # 2. Out of slot 2 (the prompt's state again): one non-empty stream of four.
        llama_cpp.llama_memory_seq_rm(memory, 2, -1, -1)
        raw.load(four, rewritten, 2)
        exported = raw.export(four, 2)
        [cache] = caches(exported)
        count, records = cache.stream_count, [cache.cells] if cache.cells else []
        reduced = with_streams(exported, 1)
        if caches(reduced) != [replace(cache, stream_count=1)]:
            raise RuntimeError("with_streams changed the state's cells")
        other = raw.context(1, unified=True)
        back = (
            raw.load(other, reduced, 0)
            and raw.greedy(other, [(0, first, len(tokens))], new_tokens)[0] == alone
        )
        held.append(count == 4 and len(records) == 1 and back)
        say(
            f"2. exported from slot 2: {count} streams, {len(records)} non-empty; as one "
            f"stream it loads into a one-sequence context and decodes the same: {back}"
        )

        # 3. A cached prefix's bytes and a request's delta, joined.
        chunks = raw.context(1, unified=True)
        raw.prompt(chunks, 0, prefix)
        first_in_chunks = raw.prompt(chunks, 0, tokens[len(prefix) :], start=len(prefix))
        in_chunks = raw.greedy(chunks, [(0, first_in_chunks, len(tokens))], new_tokens)[0]
        node = raw.context(1, unified=True)
        raw.prompt(node, 0, prefix)
        cached = raw.export(node, 0)
        delta_first = raw.prompt(node, 0, tokens[len(prefix) :], start=len(prefix))
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(node), 0, 0, len(prefix))
        delta = raw.export(node, 0)
        began = time.perf_counter()
        whole = with_streams(joined(cached, delta), 4)
        join_s = time.perf_counter() - began
        llama_cpp.llama_memory_seq_rm(memory, 3, -1, -1)
        began = time.perf_counter()
        loaded = raw.load(four, whole, 3)
        load_s = time.perf_counter() - began
        decoded = raw.greedy(four, [(3, delta_first, len(tokens))], new_tokens)[0]
        held.append(loaded and delta_first == first_in_chunks and decoded == in_chunks)
        say(
            f"3. the prefix's state ({len(cached) / 1e6:.2f} MB, {len(prefix)} tokens) and the "
            f"delta ({len(delta) / 1e6:.2f} MB) joined in {join_s * 1e3:.1f} ms, loaded into "
            f"slot 3 in {load_s * 1e3:.1f} ms: {loaded}; greedy = the same chunks in one "
            f"process: {decoded == in_chunks} (= one batch: {decoded == alone})"
        )
    finally:
        raw.close()
    return all(held)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--type-k", choices=sorted(KV_CACHE_TYPES), default="f16")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    held = check(args.type_k, args.new_tokens)
    say("every check held" if held else "a check failed")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
