"""The decode node's checked reassembly of a streamed KV state."""

from __future__ import annotations

import hashlib

from disagg_mesh.server.common.errors import DataLoss, FailedPrecondition
from disagg_mesh.server.common.kv.store import KvChunk
from disagg_mesh.server.common.types import Fingerprint


class KvAssembler:
    """Reassembles a streamed state into one buffer, refusing anything inconsistent."""

    def __init__(self, expected_size: int, expected: Fingerprint) -> None:
        self._expected_size = expected_size
        self._expected_fingerprint = expected
        self._buffer = bytearray(expected_size)
        self._received = 0
        self._sha256 = ""
        self._hash = hashlib.sha256()

    def add(self, chunk: KvChunk) -> None:
        if chunk.total_size != self._expected_size:
            raise DataLoss(
                f"KV stream says the state is {chunk.total_size} bytes; "
                f"the prefill node announced {self._expected_size}"
            )
        if chunk.offset != self._received:
            raise DataLoss(
                f"KV chunk at offset {chunk.offset}, expected offset {self._received} "
                "(chunk missing, repeated or out of order)"
            )
        if self._sha256:
            raise DataLoss("KV chunk after the last one")
        if chunk.offset == 0:
            if chunk.fingerprint is None:
                raise DataLoss("first KV chunk carries no fingerprint")
            check_fingerprint(chunk.fingerprint, self._expected_fingerprint)
        end = chunk.offset + len(chunk.data)
        if end > self._expected_size or not chunk.data:
            raise DataLoss(
                f"KV chunk of {len(chunk.data)} bytes at offset {chunk.offset} does not fit"
            )
        self._buffer[chunk.offset : end] = chunk.data
        self._hash.update(chunk.data)
        self._received = end
        self._sha256 = chunk.sha256

    def finish(self) -> memoryview:
        if self._received != self._expected_size:
            raise DataLoss(f"KV stream ended after {self._received} of {self._expected_size} bytes")
        if not self._sha256:
            raise DataLoss("KV stream ended without its checksum")
        if self._hash.hexdigest() != self._sha256:
            raise DataLoss("KV state checksum mismatch: the bytes were corrupted in transit")
        return memoryview(self._buffer)

    @property
    def received_bytes(self) -> int:
        return self._received


def check_fingerprint(got: Fingerprint, mine: Fingerprint) -> None:
    """Refuse a KV state whose producer's settings differ from this engine's, naming the
    setting and both values."""
    differs = got.mismatch(mine)
    if differs is not None:
        said = describe_mismatch(differs, "where the state was made", "on this node")
        raise FailedPrecondition(
            f"KV state fingerprint mismatch: {said}; a KV handoff needs the same model file "
            "and KV settings on both nodes (disagg doctor compares them)"
        )


def describe_mismatch(differs: tuple[str, object, object], where_a: str, where_b: str) -> str:
    """A Fingerprint.mismatch result in words: type_k is 'f16' <where_a>, 'q8_0' <where_b>."""
    name, a, b = differs
    return f"{name} is {_shown(name, a)} {where_a}, {_shown(name, b)} {where_b}"


def _shown(name: str, value: object) -> str:
    if name == "model_sha256" and isinstance(value, str):
        return f"{value[:12]}…" if value else "(unknown)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value) if isinstance(value, str) else str(value)
