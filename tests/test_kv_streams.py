"""bench/kv_streams.py: what one KV stream a sequence would keep of the node's state
guarantees, against llama.cpp's own state layout (#42). If llama.cpp's layout changes under
a new version, this says so before the engine relies on it."""

from __future__ import annotations

import struct

from bench.kv_streams import HEADER, check, streams, with_streams


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
    assert streams(four)[0] == 4 and streams(four)[1] == streams(one)[1]
    empty = b"H" * HEADER + struct.pack("<I", 1) + bytes(4)
    assert with_streams(empty, 3) == b"H" * HEADER + struct.pack("<I", 3) + bytes(12)
