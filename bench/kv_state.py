"""A one-sequence KV state's bytes, read and rewritten without llama.cpp: what a node with
one KV stream a sequence would need (#42; docs/batching.md, "A decode step does pay for
them", says why the engine keeps its unified cache for now).

llama.cpp's layout (llama-kv-cache.cpp, `state_write`; llama-context.cpp for the header): a
magic and the exporting sequence's id, then each KV cache of the model (one; two for a
sliding-window model, the full layers' and then the window layers'), each as its stream
count and per stream its cell count, then, for a stream with cells, each cell's position and
sequence ids, the V layout and layer count, the K rows of every layer and then the V rows of
every layer (a type and a row size before each layer's rows; V not transposed, which flash
attention gives). A one-sequence state has at most one stream with cells in each cache.

- `with_streams`: the same state for a cache of another stream count. llama.cpp refuses a
  state whose count differs from the loading cache's ("n_stream mismatch"), so a state from
  a unified cache (one stream) loads into a slot of a cache with one stream a sequence only
  so rewritten, and a state from there is rewritten back to one stream for any other node.
- `cut`: the state's first tokens (a cached prefix made from a slot's state).
- `joined`: a cached prefix's state and the state of the cells after it, as one state that
  loads in one call (a stream cannot share a prefix with another stream in place: llama.cpp
  copies cells between streams only as whole buffers).

Records are read as views of the state's bytes: nothing is copied until a state is encoded.
Only the layout is read: which model wrote the bytes is the fingerprint's business.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

HEADER = 8  # llama.cpp's state magic and the exporting sequence's id
_U32 = struct.Struct("<I")
_CELL = struct.Struct("<iI")  # a cell's position and how many sequence ids follow
_ROWS = struct.Struct("<iQ")  # a layer's K or V type and its row size
# A cell of one sequence, as a one-sequence export writes each: position, 1, the id.
_ONE_SEQ = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])


class StateLayoutError(ValueError):
    """Bytes that are not a one-sequence state this module reads."""


@dataclass(frozen=True)
class Stream:
    """One stream's cells: each one's position and metadata, the V layout and layer count,
    and per K and then V tensor its type and row size, the row size, and the cells' rows."""

    positions: tuple[int, ...]
    metas: tuple[memoryview, ...]
    layout: memoryview
    tensors: tuple[tuple[memoryview, int, memoryview], ...]

    def encode(self) -> bytes:
        parts: list[bytes | memoryview] = [_U32.pack(len(self.positions)), *self.metas]
        parts.append(self.layout)
        for head, _, rows in self.tensors:
            parts += [head, rows]
        return b"".join(parts)

    def take(self, keep: list[int]) -> Stream:
        """The cells at indexes `keep`, in that order (a view a tensor when they are one run
        of cells)."""
        if not keep or keep == list(range(keep[0], keep[0] + len(keep))):
            first, end = (keep[0], keep[-1] + 1) if keep else (0, 0)
            tensors = tuple(
                (head, size, rows[first * size : end * size]) for head, size, rows in self.tensors
            )
        else:
            tensors = tuple(
                (head, size, memoryview(b"".join(rows[i * size : (i + 1) * size] for i in keep)))
                for head, size, rows in self.tensors
            )
        return Stream(
            tuple(self.positions[i] for i in keep),
            tuple(self.metas[i] for i in keep),
            self.layout,
            tensors,
        )


@dataclass(frozen=True)
class Cache:
    """One KV cache's part of a state: its stream count and its one stream with cells (None
    when the sequence has no cell there)."""

    stream_count: int
    cells: Stream | None

    def encode(self, stream_count: int | None = None) -> bytes:
        count = self.stream_count if stream_count is None else stream_count
        body = self.cells.encode() if self.cells is not None else b""
        empty = count - (1 if self.cells is not None else 0)
        return _U32.pack(count) + body + bytes(4 * empty)


def caches(state: bytes) -> list[Cache]:
    """The state's caches, in order (one, or two for a sliding-window model)."""
    view = memoryview(state)
    offset, found = HEADER, []
    try:
        while offset < len(view):
            (count,) = _U32.unpack_from(view, offset)
            offset += 4
            cells: Stream | None = None
            for _ in range(count):
                (n,) = _U32.unpack_from(view, offset)
                offset += 4
                if n and cells is not None:
                    raise StateLayoutError("two streams with cells: not a one-sequence state")
                if n:
                    cells, offset = _stream(view, offset, n)
            found.append(Cache(count, cells))
    except struct.error as exc:
        raise StateLayoutError(f"the state ends inside a record: {exc}") from exc
    if offset != len(view) or not found:
        raise StateLayoutError("the state's records do not add up to its size")
    return found


def _stream(view: memoryview, offset: int, n: int) -> tuple[Stream, int]:
    """The stream of n cells whose record's cells begin at offset, and where it ends."""
    size = _ONE_SEQ.itemsize
    fits = offset + n * size <= len(view)
    cells = np.frombuffer(view, dtype=_ONE_SEQ, count=n, offset=offset) if fits else None
    if cells is not None and bool((cells["n_seq"] == 1).all()):  # fixed size: read at once
        positions = tuple(int(p) for p in cells["pos"])
        metas = tuple(view[offset + i * size : offset + (i + 1) * size] for i in range(n))
        offset += n * size
    else:
        read, metas_read = [], []
        for _ in range(n):
            pos, n_seq = _CELL.unpack_from(view, offset)
            end = offset + _CELL.size + 4 * n_seq
            read.append(pos)
            metas_read.append(view[offset:end])
            offset = end
        positions, metas = tuple(read), tuple(metas_read)
    v_trans, layers = struct.unpack_from("<II", view, offset)
    if v_trans:
        raise StateLayoutError("V is stored transposed (flash attention off): not read here")
    layout = view[offset : offset + 8]
    offset += 8
    tensors = []
    for _ in range(2 * layers):
        _, row = _ROWS.unpack_from(view, offset)
        rows = offset + _ROWS.size + n * row
        if rows > len(view):
            raise StateLayoutError("the state ends inside a layer's rows")
        tensors.append((view[offset : offset + _ROWS.size], row, view[offset + _ROWS.size : rows]))
        offset = rows
    return Stream(positions, metas, layout, tuple(tensors)), offset


def encode(header: bytes, parts: list[Cache], stream_count: int | None = None) -> bytes:
    """A state of `header`'s first bytes (magic, sequence id) and these caches."""
    return header[:HEADER] + b"".join(c.encode(stream_count) for c in parts)


def with_streams(state: bytes, stream_count: int) -> bytes:
    """The same one-sequence state for caches of `stream_count` streams."""
    return encode(state, caches(state), stream_count)


def cut(state: bytes, tokens: int) -> bytes:
    """The state's cells of positions below `tokens`, in every cache."""
    parts = []
    for cache in caches(state):
        cells = cache.cells
        if cells is not None:
            keep = [i for i, pos in enumerate(cells.positions) if pos < tokens]
            cells = cells.take(keep) if keep else None
        parts.append(Cache(cache.stream_count, cells))
    return encode(state, parts)


def joined(prefix: bytes, rest: bytes) -> bytes:
    """One state of `prefix`'s cells before `rest`'s first position and then `rest`'s, in
    every cache (a window cache's cells overlap: the later state's stand), with `rest`'s
    header and stream counts."""
    early, late = caches(prefix), caches(rest)
    if len(early) != len(late):
        raise StateLayoutError("the two states come from models with different caches")
    parts = [
        Cache(b.stream_count, _joined(a.cells, b.cells)) for a, b in zip(early, late, strict=True)
    ]
    return encode(rest, parts)


def _joined(early: Stream | None, late: Stream | None) -> Stream | None:
    if early is None or late is None:
        return late if early is None else early
    heads = [bytes(h) for h, _, _ in early.tensors]
    if early.layout != late.layout or heads != [bytes(h) for h, _, _ in late.tensors]:
        raise StateLayoutError("the two states come from caches of different layouts")
    start = min(late.positions)
    kept = early.take([i for i, pos in enumerate(early.positions) if pos < start])
    tensors = tuple(
        (head, size, memoryview(b"".join((rows, more))))
        for (head, size, rows), (_, _, more) in zip(kept.tensors, late.tensors, strict=True)
    )
    return Stream(kept.positions + late.positions, kept.metas + late.metas, late.layout, tensors)
