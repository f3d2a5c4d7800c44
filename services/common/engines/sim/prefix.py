"""The simulated engine's prompt caches: which of a prompt's tokens need no evaluation.

A prompt is cut into blocks of BLOCK_TOKENS simulated tokens (the profile's bytes a token,
4 by default), each named
by a hash chained over the blocks before it, so two prompts share a block only when they
share everything up to its end.

- `BlockCache` (`prefix_cache = "blocks"`): the embedded engine's prefix cache, node-wide:
  blocks of earlier prompts kept after their requests, least recently used out first, up to
  `max_tokens`; a prompt reuses the blocks it starts with, whichever slot held them.
- `SlotCache` (`prefix_cache = "per-slot"`): Ollama's: each slot keeps its last prompt,
  and a request reuses only what it shares with the prompt of the slot it gets (the free
  slot sharing the most, as Ollama's runner picks one).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from disagg_mesh.server.common.engines.prefix_keys import common_prefix

BYTES_PER_TOKEN = 4
BLOCK_TOKENS = 64
BLOCK_HASH_BYTES = 16

Blocks = tuple[bytes, ...]


def prompt_blocks(text: bytes, bytes_per_token: float = BYTES_PER_TOKEN) -> Blocks:
    """The chained hashes of a prompt's whole blocks."""
    size = max(round(BLOCK_TOKENS * bytes_per_token), 1)
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(text) - size + 1, size):
        previous = hashlib.blake2b(
            previous + text[start : start + size], digest_size=BLOCK_HASH_BYTES
        ).digest()
        hashes.append(previous)
    return tuple(hashes)


class BlockCache:
    """Blocks kept node-wide, least recently used out first."""

    def __init__(self, max_tokens: int) -> None:
        self._max_blocks = max_tokens // BLOCK_TOKENS
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    @property
    def tokens(self) -> int:
        return len(self._blocks) * BLOCK_TOKENS

    def cached_tokens(self, blocks: Blocks) -> int:
        """Tokens of the prompt's start the cache holds (marked as just used)."""
        n = 0
        for block in blocks:
            if block not in self._blocks:
                break
            self._blocks.move_to_end(block)
            n += 1
        return n * BLOCK_TOKENS

    def keep(self, blocks: Blocks) -> None:
        if not self._max_blocks:
            return
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)


class SlotCache:
    """Each slot's last prompt."""

    def __init__(self, slots: int) -> None:
        self._last: list[Blocks] = [() for _ in range(slots)]

    def best(self, free: Sequence[int], blocks: Blocks) -> int:
        """The free slot whose last prompt shares the most with this one."""
        return max(free, key=lambda slot: common_prefix(self._last[slot], blocks))

    def cached_tokens(self, slot: int, blocks: Blocks) -> int:
        return common_prefix(self._last[slot], blocks) * BLOCK_TOKENS

    def keep(self, slot: int, blocks: Blocks) -> None:
        self._last[slot] = blocks
