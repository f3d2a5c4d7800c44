"""The prefill node's store of KV states waiting to be fetched, and their chunks."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from disagg_mesh.server.common.errors import NotFound, ResourceExhausted
from disagg_mesh.server.common.types import Fingerprint

CHUNK_BYTES = 1 << 20
# Handles remembered after they are gone, so a second fetch can say why it fails.
_TOMBSTONES = 4096


@dataclass
class StoredKv:
    # The FetchKv stream, already serialized (see kv_wire.encode_state): fetching it copies
    # nothing more.
    messages: list[bytes]
    size_bytes: int
    expires_at: float


@dataclass(frozen=True)
class KvChunk:
    offset: int
    data: bytes | memoryview
    total_size: int
    # Set on the last chunk only.
    sha256: str = ""
    # Set on the first chunk only.
    fingerprint: Fingerprint | None = None


class KvStore:
    """States waiting to be fetched, bounded in bytes and in time."""

    def __init__(
        self, budget_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, StoredKv] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, messages: list[bytes], size: int) -> str:
        """Keep a state's serialized FetchKv messages; `size` is the state's bytes."""
        self.expire()
        if self.bytes_held + size > self.budget_bytes:
            raise ResourceExhausted(
                f"KV store full: {self.bytes_held} of {self.budget_bytes} bytes held by "
                f"{len(self._entries)} unfetched states, this one needs {size}; retry later"
            )
        handle = secrets.token_urlsafe(18)
        self._entries[handle] = StoredKv(
            messages=messages, size_bytes=size, expires_at=self._clock() + self.ttl_s
        )
        self.bytes_held += size
        return handle

    def take(self, handle: str) -> StoredKv:
        """Remove and return the state: a handle can be fetched once."""
        self.expire()
        entry = self._entries.pop(handle, None)
        if entry is None:
            why = self._gone.get(handle, "unknown (never issued here, or forgotten)")
            raise NotFound(f"KV handle {handle!r} is {why}")
        self._forget(handle, entry, "already fetched")
        return entry

    def expire(self) -> None:
        now = self._clock()
        for handle, entry in list(self._entries.items()):
            if entry.expires_at <= now:
                del self._entries[handle]
                self._forget(handle, entry, f"expired (not fetched within {self.ttl_s:g} s)")

    async def expire_periodically(self, every_s: float = 1.0) -> None:
        """Drop expired states even when no request comes (run as a task)."""
        while True:
            await asyncio.sleep(every_s)
            self.expire()

    def _forget(self, handle: str, entry: StoredKv, why: str) -> None:
        self.bytes_held -= entry.size_bytes
        self._gone[handle] = why
        while len(self._gone) > _TOMBSTONES:
            self._gone.popitem(last=False)


def split_chunks(
    data: memoryview, sha256: str, fingerprint: Fingerprint, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[KvChunk]:
    """A state as FetchKv sends it: views of at most chunk_bytes, the fingerprint on the
    first, the checksum of the whole on the last."""
    total = len(data)
    offsets = range(0, total, chunk_bytes)
    last = offsets[-1] if total else 0
    for offset in offsets:
        yield KvChunk(
            offset=offset,
            data=data[offset : offset + chunk_bytes],
            total_size=total,
            sha256=sha256 if offset == last else "",
            fingerprint=fingerprint if offset == 0 else None,
        )
