"""The KV store (TTL, byte budget, fetch once) and the checked reassembly of a stream."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import pytest

from disagg_mesh.server.common.errors import (
    DataLoss,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
)
from disagg_mesh.server.common.kv.assembler import KvAssembler
from disagg_mesh.server.common.kv.store import KvChunk, KvStore, split_chunks
from disagg_mesh.server.common.types import Fingerprint

FP = Fingerprint("ab" * 32, 4096, "llama-cpp-python/test")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(store: KvStore, data: bytes) -> str:
    return store.put([data], len(data))


def test_a_handle_is_fetched_once() -> None:
    store = KvStore(budget_bytes=1000, ttl_s=10)
    handle = put(store, b"x" * 100)
    assert store.bytes_held == 100
    assert store.take(handle).messages == [b"x" * 100]
    assert store.bytes_held == 0 and len(store) == 0
    with pytest.raises(NotFound, match="already fetched"):
        store.take(handle)
    with pytest.raises(NotFound, match="unknown"):
        store.take("never-issued")


def test_handles_expire_and_free_their_bytes() -> None:
    clock = Clock()
    store = KvStore(budget_bytes=1000, ttl_s=5, clock=clock)
    handle = put(store, b"x" * 400)
    clock.now = 5.1
    store.expire()
    assert store.bytes_held == 0 and len(store) == 0
    with pytest.raises(NotFound, match="expired"):
        store.take(handle)


def test_the_byte_budget_holds() -> None:
    clock = Clock()
    store = KvStore(budget_bytes=1000, ttl_s=5, clock=clock)
    put(store, b"x" * 600)
    with pytest.raises(ResourceExhausted, match="KV store full"):
        put(store, b"y" * 600)
    assert store.bytes_held == 600
    clock.now = 6  # the first one expires, which makes room
    put(store, b"y" * 600)
    assert store.bytes_held == 600


DATA = bytes(range(256)) * 40  # 10 KiB


def chunks(data: bytes = DATA, size: int = 1024) -> list[KvChunk]:
    return list(split_chunks(memoryview(data), hashlib.sha256(data).hexdigest(), FP, size))


def assemble(parts: list[KvChunk], size: int = len(DATA), fp: Fingerprint = FP) -> bytes:
    assembler = KvAssembler(size, fp)
    for part in parts:
        assembler.add(part)
    return bytes(assembler.finish())


def test_chunks_round_trip() -> None:
    parts = chunks()
    assert len(parts) == 10
    assert parts[0].fingerprint == FP and all(p.fingerprint is None for p in parts[1:])
    assert parts[-1].sha256 and not any(p.sha256 for p in parts[:-1])
    assert all(len(p.data) <= 1024 for p in parts)
    assert assemble(parts) == DATA


@pytest.mark.parametrize(
    ("name", "mangle"),
    [
        ("missing", lambda p: p[:3] + p[4:]),
        ("duplicated", lambda p: [*p[:4], p[3], *p[4:]]),
        ("reordered", lambda p: [p[0], p[2], p[1], *p[3:]]),
        ("truncated", lambda p: p[:-1]),
    ],
)
def test_a_broken_stream_is_data_loss(name: str, mangle: object) -> None:
    assert callable(mangle)
    with pytest.raises(DataLoss):
        assemble(mangle(chunks()))


def test_a_flipped_byte_is_data_loss() -> None:
    parts = chunks()
    bad = bytearray(parts[5].data)
    bad[7] ^= 1
    parts[5] = KvChunk(parts[5].offset, bytes(bad), parts[5].total_size)
    with pytest.raises(DataLoss, match="checksum"):
        assemble(parts)


def test_a_size_other_than_announced_is_data_loss() -> None:
    with pytest.raises(DataLoss):
        assemble(chunks(), size=len(DATA) + 1)


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        (
            "model_sha256",
            "cd" * 32,
            "model_sha256 is abababababab… where the state was made, cdcdcdcdcdcd… on this node",
        ),
        ("n_ctx_tokens", 2048, "n_ctx is 4096 where the state was made, 2048 on this node"),
        (
            "engine_version",
            "x/2",
            "engine_version is 'llama-cpp-python/test' where the state was made, 'x/2'",
        ),
        ("type_k", "q8_0", "type_k is 'f16' where the state was made, 'q8_0' on this node"),
        ("type_v", "q4_0", "type_v is 'f16' where the state was made, 'q4_0' on this node"),
        ("flash_attn", False, "flash_attn is on where the state was made, off on this node"),
        ("kv_unified", False, "kv_unified is on where the state was made, off on this node"),
        ("swa_full", True, "swa_full is off where the state was made, on on this node"),
    ],
)
def test_a_state_from_another_engine_setup_is_refused_naming_the_setting(
    setting: str, value: object, said: str
) -> None:
    other = dataclasses.replace(FP, **{setting: value})  # type: ignore[arg-type]
    with pytest.raises(FailedPrecondition, match=re.escape(said)):
        assemble(chunks(), fp=other)
