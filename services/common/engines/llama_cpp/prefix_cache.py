"""Prompt prefixes kept resident in spare sequences of the slots' context (a prefix cache).

When a prompt has been evaluated, its whole blocks (`block_tokens` each, 64 by default, as
vLLM and SGLang match) stay in the KV cache under a sequence id of their own, past the
slots and the parked cells. A later prompt that starts with the same blocks gets them
copied into its slot (`llama_memory_seq_cp`: in a unified cache the cells are shared, not
copied) and evaluates only the rest. Least recently used entries go first when the token
budget or the sequence ids run out, or when the engine needs cells.

A prompt evaluated as cached prefix then suffix is cut into other pieces than the same
prompt evaluated from its start, and llama.cpp's numbers depend on the pieces: greedy text
can drift from a run without the cache after some tokens. It is identical to one process
that evaluated the prompt in the same pieces (tests/test_prefix_cache.py).

Only the engine thread uses a PrefixCache. The cache is per context, so per model file and
settings: a prefix from another model is never used (and `block_hashes` start from the
fingerprint, for comparisons across nodes).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

BLOCK_TOKENS = 64


class Sequences(Protocol):
    """What the cache needs of the context."""

    def copy_prefix(self, source: int, target: int, tokens: int) -> None: ...

    def drop(self, seq: int) -> None: ...


@dataclass(eq=False)
class Entry:
    seq: int
    tokens: tuple[int, ...]  # a whole number of blocks
    used: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def block_hashes(salt: str, tokens: Sequence[int], block_tokens: int) -> list[str]:
    """One hash per whole block, each covering every token before its end (a chain), salted
    with the fingerprint: equal hashes mean the same model, settings and tokens."""
    out = []
    chain = hashlib.sha256(salt.encode()).digest()
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[end - block_tokens : end])
        chain = hashlib.sha256(chain + block).digest()
        out.append(chain[:16].hex())
    return out


class PrefixCache:
    def __init__(
        self,
        context: Sequences,
        seqs: Sequence[int],
        budget_tokens: int,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        self._ctx = context
        self._free = list(seqs)
        self.budget_tokens = budget_tokens
        self.block_tokens = block_tokens
        self._entries: list[Entry] = []
        self._clock = itertools.count()

    @property
    def tokens(self) -> int:
        """Tokens held (a prefix held by two entries counts twice)."""
        return sum(len(e.tokens) for e in self._entries)

    @property
    def entries(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry sharing the most whole blocks with these tokens, and how many tokens;
        at least one token is always left to evaluate (its logits are needed)."""
        best: Entry | None = None
        best_n = 0
        for entry in self._entries:
            n = common_prefix(entry.tokens, tokens[: len(tokens) - 1])
            n -= n % self.block_tokens
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def use(self, entry: Entry, slot: int, tokens: int) -> None:
        """Put the entry's first `tokens` into the (empty) slot."""
        self._ctx.copy_prefix(entry.seq, slot, tokens)
        entry.used = next(self._clock)

    def keep(self, slot: int, tokens: Sequence[int]) -> None:
        """Keep the whole blocks of the slot's evaluated prompt resident."""
        n = len(tokens) - len(tokens) % self.block_tokens
        if n == 0 or n > self.budget_tokens:
            return
        prefix = tuple(tokens[:n])
        for entry in self._entries:
            if common_prefix(entry.tokens, prefix) == n:  # already held
                entry.used = next(self._clock)
                return
        for entry in [e for e in self._entries if prefix[: len(e.tokens)] == e.tokens]:
            self._drop(entry)  # this one holds all of it, and more
        while self._entries and (self.tokens + n > self.budget_tokens or not self._free):
            self.evict()
        if not self._free:
            return
        seq = self._free.pop()
        self._ctx.copy_prefix(slot, seq, n)
        self._entries.append(Entry(seq, prefix, next(self._clock)))

    def evict(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        self._drop(min(self._entries, key=lambda e: e.used))
        return True

    def _drop(self, entry: Entry) -> None:
        self._entries.remove(entry)
        self._ctx.drop(entry.seq)
        self._free.append(entry.seq)
