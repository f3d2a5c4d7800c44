"""bench/kv_state.py (a one-sequence KV state's bytes, read and rewritten) and bench/kv_streams.py
(what one KV stream a sequence keeps of the node's state guarantees, #42), against real
llama.cpp states: SmolLM2's one cache and gemma3's two (full and sliding-window layers). If
llama.cpp's state layout changes under a new version, these say so first."""

from __future__ import annotations

import struct

import llama_cpp
import pytest

from bench.kv_state import (
    HEADER,
    StateLayoutError,
    caches,
    cut,
    joined,
    with_streams,
)
from bench.kv_streams import Raw, check
from tests.test_model_families import gemma3_path


def test_one_stream_a_sequence_keeps_states_slots_and_the_delta() -> None:
    assert check("f16", new_tokens=16)


def test_a_stream_count_rewrite_keeps_every_cell() -> None:
    # A made-up one-sequence state: 2 cells of one layer, K and V rows of 4 bytes.
    cells = struct.pack("<iIi", 0, 1, 0) + struct.pack("<iIi", 1, 1, 0)
    tensors = (struct.pack("<iQ", 1, 4) + b"kkkkKKKK") + (struct.pack("<iQ", 1, 4) + b"vvvvVVVV")
    record = struct.pack("<I", 2) + cells + struct.pack("<II", 0, 1) + tensors
    one = b"H" * HEADER + struct.pack("<I", 1) + record
    four = with_streams(one, 4)
    assert four == b"H" * HEADER + struct.pack("<I", 4) + record + bytes(12)
    assert with_streams(four, 1) == one
    assert (
        cut(one, 1)
        == b"H" * HEADER
        + struct.pack("<I", 1)
        + struct.pack("<I", 1)
        + (struct.pack("<iIi", 0, 1, 0) + struct.pack("<II", 0, 1))
        + struct.pack("<iQ", 1, 4)
        + b"kkkk"
        + struct.pack("<iQ", 1, 4)
        + b"vvvv"
    )
    assert joined(cut(one, 1), one) == one
    assert with_streams(b"H" * HEADER + struct.pack("<I", 1) + bytes(4), 3) == (
        b"H" * HEADER + struct.pack("<I", 3) + bytes(12)
    )
    with pytest.raises(StateLayoutError):
        caches(one[:-1])
    with pytest.raises(StateLayoutError):
        caches(b"H" * HEADER + struct.pack("<I", 2) + record + record)


def test_a_sliding_window_models_state_moves_between_layouts_and_joins() -> None:
    """gemma3 (window 512): a 700-token prompt's state has two caches, the window layers'
    holding only the last 512 positions. Rewritten for 4 streams it loads into slot 2 of a
    context with one stream a sequence and decodes as the one-sequence context does; cut
    at 320 tokens and joined with the state of the cells after them (exported as the
    prefill node exports a delta), it decodes the same again."""
    raw = Raw("f16", path=gemma3_path())
    try:
        words = " ".join(f"item{i % 53} is graded {i % 7} of 10." for i in range(140))
        tokens = raw.tokens("Grade each item. " + words)[:700]
        one = raw.context(1, unified=True)
        first = raw.prompt(one, 0, tokens)
        state = raw.export(one, 0)
        whole, window = caches(state)
        assert whole.cells is not None and window.cells is not None
        assert len(whole.cells.positions) == 700 and len(window.cells.positions) < 700
        alone = raw.greedy(one, [(0, first, len(tokens))], 16)[0]

        four = raw.context(4, unified=False)
        assert not raw.load(four, state, 2)  # llama.cpp: "n_stream mismatch"
        assert raw.load(four, with_streams(state, 4), 2)
        assert raw.greedy(four, [(2, first, len(tokens))], 16)[0] == alone

        node = raw.context(1, unified=True)
        raw.prompt(node, 0, tokens)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(node), 0, 0, 320)
        rest = raw.export(node, 0)
        assert min(caches(rest)[0].cells.positions) == 320  # type: ignore[union-attr]
        both = with_streams(joined(cut(state, 320), rest), 4)
        assert raw.load(four, both, 3)
        assert raw.greedy(four, [(3, first, len(tokens))], 16)[0] == alone
    finally:
        raw.close()
