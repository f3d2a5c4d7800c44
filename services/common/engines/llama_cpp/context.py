"""One llama.cpp context whose KV cache holds every slot's sequence (a unified KV cache).

Slot k is llama.cpp sequence k. Only the engine thread touches a `SlotContext`. Every call
that takes a sequence id checks it here first: llama.cpp aborts the whole process on an id
at or above the context's `n_seq_max`.

Why these settings (measured here with llama-cpp-python 0.3.36 on the CPU backend):
- `kv_unified`: a state exported from a one-sequence context carries one KV stream; only a
  unified multi-sequence context has one stream, so only it loads such a state.
- flash attention on: llama.cpp's CPU attention then computes every row of a pass of
  fewer than 64 rows on its own, whatever else shares the pass (the scheduler keeps other
  sequences out of larger passes). With flash attention off, the matrix products pick
  kernels by batch size, and a sequence's greedy text drifted in a batch.
- A finished sequence's cells are parked, not freed (`park`): they move to one extra
  sequence id that no batch attends to, and are freed together (`free_parked`) when the
  engine is idle or room runs short. So are a dropped prefix cache entry's (`drop`) while
  any slot holds cells. Freeing them at once would leave holes that llama.cpp
  fills from the start of the cache, putting a running sequence's next tokens before its
  earlier ones; attention adds cells up in cache order, so that sequence's numbers would
  then round differently from the same sequence run alone.
- A pass of one row must not take llama.cpp's split-KV path once the KV view may reach 512
  cells: its CPU flash attention then splits a lone row's cells between the threads and
  merges the parts, which rounds differently from the one-row-at-a-time kernel of every pass
  of 2..63 rows. Otherwise a stream's numbers would depend on whether it ran alone at a step:
  measured here, logits up to 5.1 apart within 12 steps, and a seeded stream resumed after a
  failover parting from its uninterrupted text under load. Two ways keep a lone row's
  numbers those it has in company (`decode`, `LoneRows`): run it on one thread (one part; a
  pass of one token uses llama.cpp's `n_threads`, larger ones `n_threads_batch`), or give it
  a second row, a token of a scratch sequence at position 0 removed after the pass. Every
  logit is equal either way; the node times both and takes the faster (SmolLM2 on 2 cores:
  one thread 7.3-12.9 ms a step over 150-1,500 cells, company 12.4-16.0 ms; a model big
  enough to be memory-bound on many cores would pay little for company and much for one
  thread). Neither is needed while the view stays under 512 cells (short work on an idle
  node), on one thread, where attention runs on a GPU, or with a quantized K cache
  (`type_k = "q8_0"`, V f16: llama.cpp has a split path only for K and V both f16 or both
  f32), where a lone row runs on all the node's threads with its numbers in company.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import llama_cpp

from disagg_mesh.server.common.engines.llama_cpp.model import (
    KV_CACHE_TYPES,
    LlamaModel,
    ModelLoadError,
)


@dataclass(frozen=True)
class ContextSettings:
    slots: int
    # Tokens one sequence may hold: what a request gets, whatever the other slots hold.
    n_ctx: int
    # Most tokens one llama_decode takes.
    n_batch: int
    # Most rows in one compute pass (llama.cpp splits a step into passes).
    n_ubatch: int
    n_threads: int
    flash_attn: bool = True
    # K and V cache types (names of KV_CACHE_TYPES), and full-size sliding-window caches.
    type_k: str = "f16"
    type_v: str = "f16"
    swa_full: bool = False
    # Let llama.cpp run large batches' matrix products on a GPU even for layers kept on the
    # CPU; off on a CPU-only node (n_gpu_layers = 0), which then never touches the GPU.
    op_offload: bool = True
    # Prompt prefixes kept resident (prefix_cache.py): tokens, and sequences that hold them.
    prefix_cache_tokens: int = 0
    prefix_cache_seqs: int = 0
    # Some layers' attention runs on the CPU (flash attention's lone-row path: see decode).
    cpu_attention: bool = True
    # KV cells in all: slots * n_ctx plus the prefix cache's, so no slot can be crowded
    # out. Tests make it smaller to exercise a full cache.
    kv_cells: int | None = None

    @property
    def cells(self) -> int:
        return self.kv_cells or self.slots * self.n_ctx + self.prefix_cache_tokens


class Row(NamedTuple):
    """One token of one step: where it goes and whether its logits are wanted."""

    token: int
    pos: int
    slot: int
    logits: bool


# llama.cpp's KV view is the cells up to the highest in use, rounded up to 256; from 512
# cells on, its CPU flash attention takes a lone row through the split-KV path.
SPLIT_KV_VIEW_CELLS = 512
VIEW_ROUNDING = 256
# ...and only when K and V are both of one of these types (ggml-cpu's `kv_is_f32_or_f16`
# and `k->type == v->type`): with a quantized K (type_k = "q8_0", V f16) a lone row runs
# through the kernel every pass of 2..63 rows takes, on all the node's threads.
SPLIT_KV_TYPES = frozenset({"f16", "f32"})
# llama.cpp's CPU flash attention takes a pass of fewer query rows than this one row at a
# time (its tiled kernel from GGML_FA_TILE_Q = 64 rows on), and the CPU matrix products
# compute every row alike: in such a pass, each row's numbers are those it has in a pass of
# its own, so several short prompts may share one.
ALIKE_ROWS = 64


def lone_row_may_split(settings: ContextSettings) -> bool:
    """Whether llama.cpp's CPU flash attention has a split-KV path for these KV types."""
    return settings.type_k == settings.type_v and settings.type_k in SPLIT_KV_TYPES


# How a lone row over a view that may split runs (`LoneRows`).
ONE_THREAD = "one thread"
PAIRED = "paired"
# The way not in use is timed again every this many lone steps (the faster may change as the
# view grows or the threads change); the newest step's weight in a way's running average.
RETIME_EVERY = 64
LONE_WEIGHT = 0.2


class LoneRows:
    """Which way a lone row over a view that may split runs, by measurement: its step on one
    thread, or with a scratch row of company on all of them (the same numbers either way).
    Each way's step seconds are a running average per thread count; each is tried first,
    then the faster is taken and the other timed again every RETIME_EVERY lone steps."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, str], float] = {}
        self._steps = 0

    def way(self, threads: int) -> str:
        one = self._seconds.get((threads, ONE_THREAD))
        paired = self._seconds.get((threads, PAIRED))
        if one is None:
            return ONE_THREAD
        if paired is None:
            return PAIRED
        self._steps += 1
        faster, slower = (ONE_THREAD, PAIRED) if one <= paired else (PAIRED, ONE_THREAD)
        return slower if self._steps % RETIME_EVERY == 0 else faster

    def took(self, threads: int, way: str, seconds: float) -> None:
        last = self._seconds.get((threads, way))
        self._seconds[threads, way] = (
            seconds if last is None else last + LONE_WEIGHT * (seconds - last)
        )


def _nothing() -> None:
    pass


class SlotContext:
    def __init__(self, model: LlamaModel, settings: ContextSettings) -> None:
        # One sequence for the parked cells, one for the scratch row, and the prefix cache's.
        limit = int(llama_cpp.llama_max_parallel_sequences()) - 2 - settings.prefix_cache_seqs
        if not 1 <= settings.slots <= limit:
            raise ModelLoadError(f"slots must be 1..{limit} for llama.cpp, got {settings.slots}")
        if settings.n_batch < settings.slots:
            raise ModelLoadError(
                f"n_batch = {settings.n_batch} is under slots = {settings.slots}: a step must "
                "hold one token of every generating slot"
            )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = settings.cells
        params.n_batch = settings.n_batch
        params.n_ubatch = min(settings.n_ubatch, settings.n_batch)
        # The slots, the parked cells' sequence, the scratch row's, then the prefix cache's.
        params.n_seq_max = settings.slots + 2 + settings.prefix_cache_seqs
        params.kv_unified = True
        params.n_threads = settings.n_threads
        # Prompt evaluation too: its default is every core, whatever n_threads says.
        params.n_threads_batch = settings.n_threads
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if settings.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.type_k = KV_CACHE_TYPES[settings.type_k].ggml_type
        params.type_v = KV_CACHE_TYPES[settings.type_v].ggml_type
        params.swa_full = settings.swa_full
        params.op_offload = settings.op_offload
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model.ptr, params)
        if not ctx:
            kv_bytes = settings.cells * model.kv_bytes_per_token(settings.type_k, settings.type_v)
            raise ModelLoadError(
                f"llama.cpp could not create a context of {settings.cells} KV cells "
                f"({kv_bytes / 2**20:.0f} MiB, K/V {settings.type_k}/{settings.type_v}) for "
                f"{settings.slots} slots: lower slots or n_ctx"
            )
        self._ctx: Any = ctx
        self._mem: Any = llama_cpp.llama_get_memory(ctx)
        self._batch: Any = llama_cpp.llama_batch_init(settings.n_batch, 0, 1)
        self.settings = settings
        self._threads = settings.n_threads
        self.slots = settings.slots
        self._parked = settings.slots
        # Positions parked since the parked cells were last freed (a bound on their cells:
        # some may also be a prefix cache entry's).
        self.parked_cells = 0
        self._scratch = settings.slots + 1
        # The sequences that may hold cells (each way cells are placed adds its sequence;
        # `_held` drops those found empty): `_held` asks llama.cpp about these alone, not
        # every sequence at every step, each call leaving the interpreter's lock.
        self._holding: set[int] = set()
        self.cache_seqs = range(settings.slots + 2, settings.slots + 2 + settings.prefix_cache_seqs)
        # A bound on the highest KV cell in use (+1), and whether lone rows are kept off
        # the split-KV path (one thread or company).
        self._cells_high = 0
        self._placed_high = 0
        self._guard_lone_rows = (
            settings.flash_attn and settings.cpu_attention and lone_row_may_split(settings)
        )
        self.lone_rows = LoneRows()
        # Called right before each llama_decode, which leaves the interpreter's lock for
        # the whole pass (the scheduler hands its callers their events then).
        self.before_pass: Callable[[], None] = _nothing
        self.n_ctx = settings.n_ctx
        self.n_batch = settings.n_batch
        # Rows of a pass shared by several prompts: under ALIKE_ROWS on the CPU with flash
        # attention; 1 (a pass each) where a GPU takes part, whose kernels go by batch size.
        self.alike_rows = ALIKE_ROWS if settings.flash_attn and not settings.op_offload else 1

    @property
    def ptr(self) -> Any:
        return self._ctx

    def set_threads(self, n: int) -> None:
        """The threads of the next passes (decode and prompt alike)."""
        if n != self._threads:
            llama_cpp.llama_set_n_threads(self._ctx, n, n)
            self._threads = n

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"sequence id {slot} is outside 0..{self.slots - 1}")

    def decode(self, rows: list[Row]) -> int:
        """llama_decode on these rows: 0 done, 1 no free KV cells (nothing was written), other
        values an error."""
        if not 0 < len(rows) <= self.n_batch:
            raise ValueError(f"a step holds 1..{self.n_batch} tokens, got {len(rows)}")
        for row in rows:
            self.check_slot(row.slot)
        if not self._guard_lone_rows:
            return self._decode(rows)
        self._note_cells(len(rows), passing=1)  # + the scratch row, if it joins
        if len(rows) == 1 and self._threads > 1 and self._view_may_split():
            threads = self._threads
            way = self.lone_rows.way(threads)
            started = time.perf_counter()
            if way == ONE_THREAD:
                result = self._lone_on_one_thread(rows)
            else:
                result = self._decode([*rows, Row(rows[0].token, 0, self._scratch, False)])
                llama_cpp.llama_memory_seq_rm(self._mem, self._scratch, -1, -1)
                if result == 1:
                    # No cell for the scratch row: on one thread, rather than no room at all.
                    return self._lone_on_one_thread(rows)
            if result == 0:
                self.lone_rows.took(threads, way, time.perf_counter() - started)
            return result
        return self._decode(rows)

    def _lone_on_one_thread(self, rows: list[Row]) -> int:
        """A pass of one token runs on llama.cpp's n_threads: one, for this pass."""
        llama_cpp.llama_set_n_threads(self._ctx, 1, self._threads)
        try:
            return self._decode(rows)
        finally:
            llama_cpp.llama_set_n_threads(self._ctx, self._threads, self._threads)

    def _decode(self, rows: list[Row]) -> int:
        batch = self._batch
        holding = self._holding
        for i, row in enumerate(rows):
            batch.token[i] = row.token
            batch.pos[i] = row.pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = row.slot
            batch.logits[i] = row.logits
            holding.add(row.slot)
        batch.n_tokens = len(rows)
        self.before_pass()
        return int(llama_cpp.llama_decode(self._ctx, batch))

    def _held(self) -> int:
        """At least the KV cells in use: every sequence's positions from 0 to its highest."""
        held = 0
        for seq in list(self._holding):
            top = int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq))
            if top < 0:
                self._holding.discard(seq)
            held += top + 1
        return held

    def _held_before_placing(self) -> int:
        """`_held`, the cache cleared first when it holds nothing (its head back to cell 0,
        which `_note_cells` counts on)."""
        held = self._held()
        if held == 0:
            llama_cpp.llama_memory_clear(self._mem, False)
            self._holding.clear()
        return held

    def _note_cells(self, new: int, held: int | None = None, passing: int = 0) -> None:
        """Keep two bounds above the highest cell in use once `new` cells are placed
        (`held`: the cells in use before, when already counted by `_held_before_placing`;
        `passing`: cells placed for one pass and removed after it, the scratch row). Bounds,
        not readings: llama.cpp does not say where its cells are. Both drop back only when
        the cache is empty.

        - `_cells_high`: llama.cpp places cells from its head, which it moves back to 0 when
          more than 2 * new cells below it are free, so no placed cell is beyond
          2 * in use + 3 * new (a decode's later micro-batches count the earlier ones as in
          use: 5 * new).
        - `_placed_high`: the cells placed since the cache was empty. llama.cpp takes the
          first free cells from its head, which is never above this bound (it moves to the
          cell after the last placed, or back), so each placement raises it by the cells
          placed; a scratch row's cell, removed after its pass, is taken again next. An
          empty cache is cleared first, which puts the head at cell 0. Tight while a node's
          work is short (a stream on an idle node), loose on a busy node."""
        held = self._held_before_placing() if held is None else held
        if held == 0:
            self._cells_high = 0
            self._placed_high = new + passing
        else:
            self._placed_high += new
        self._cells_high = max(self._cells_high, 2 * held + 5 * (new + passing))

    def _view_may_split(self) -> bool:
        high = min(self._cells_high, self._placed_high)
        view = max(VIEW_ROUNDING, -(-high // VIEW_ROUNDING) * VIEW_ROUNDING)
        return view >= SPLIT_KV_VIEW_CELLS

    def park(self, slot: int) -> None:
        """The slot is free at once; its cells stay in use, under the parked sequence, until
        `free_parked` (no copy: the cells change owner)."""
        self.check_slot(slot)
        self._park(slot)

    def _park(self, seq: int) -> None:
        self.parked_cells += int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq)) + 1
        llama_cpp.llama_memory_seq_cp(self._mem, seq, self._parked, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._holding.add(self._parked)

    def _check_seq(self, seq: int) -> None:
        if not (0 <= seq < self.slots or seq in self.cache_seqs):
            raise ValueError(f"sequence id {seq} is neither a slot nor a prefix cache entry")

    def copy_prefix(self, source: int, target: int, tokens: int) -> None:
        """Positions 0..tokens-1 of one sequence (a slot or a prefix cache entry) become the
        other's too: the cells are shared, not copied."""
        self._check_seq(source)
        self._check_seq(target)
        llama_cpp.llama_memory_seq_cp(self._mem, source, target, 0, tokens)
        self._holding.add(target)

    def drop(self, seq: int) -> None:
        """A prefix cache entry's sequence is emptied. Its cells no other sequence holds are
        freed at once while no slot holds cells, and parked otherwise (freed with a finished
        slot's): llama.cpp places the next cells from the first one freed, so a running
        sequence's next tokens would land ahead of its earlier ones (see above)."""
        if seq not in self.cache_seqs:
            raise ValueError(f"sequence id {seq} is not a prefix cache entry")
        if any(llama_cpp.llama_memory_seq_pos_max(self._mem, s) >= 0 for s in range(self.slots)):
            self._park(seq)
        else:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def free_parked(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, self._parked, -1, -1)
        self.parked_cells = 0

    def pos_min(self, seq: int) -> int:
        """The lowest position a slot or a prefix cache entry holds in every layer, -1 when
        it holds none. With sliding-window layers, their cache's lowest: the others hold
        every position from 0 (or from where a prefix was left out)."""
        self._check_seq(seq)
        return int(llama_cpp.llama_memory_seq_pos_min(self._mem, seq))

    def forget_prefix(self, slot: int, tokens: int) -> None:
        """The slot lets go of positions 0..tokens-1 (cells another sequence holds stay)."""
        self.check_slot(slot)
        llama_cpp.llama_memory_seq_rm(self._mem, slot, 0, tokens)

    def state_size(self, slot: int) -> int:
        self.check_slot(slot)
        return int(llama_cpp.llama_state_seq_get_size(self._ctx, slot))

    def pos_max(self, slot: int) -> int:
        """The slot's highest position, -1 when it holds none."""
        self.check_slot(slot)
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, slot))

    def export_state(self, seq: int) -> memoryview:
        """A slot's or a prefix cache entry's KV as a one-sequence state's bytes."""
        self._check_seq(seq)
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buffer, size, seq)
        if written == 0 or written > size:
            raise RuntimeError(f"llama.cpp wrote {written} bytes of a {size}-byte KV state")
        return memoryview(buffer).cast("B")[:written]

    def import_state(self, seq: int, state: memoryview) -> int:
        """Load a one-sequence state into a slot or a prefix cache entry's sequence; the
        bytes llama.cpp read (0 if refused)."""
        self._check_seq(seq)
        held = self._held_before_placing() if self._guard_lone_rows else 0
        buffer = (ctypes.c_uint8 * len(state)).from_buffer(state)
        self._holding.add(seq)  # before: llama.cpp may have placed cells, whatever it says
        read = int(llama_cpp.llama_state_seq_set_data(self._ctx, buffer, len(state), seq))
        if self._guard_lone_rows:  # its cells were placed as a decode's are
            self._note_cells(int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq)) + 1, held)
        return read

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
