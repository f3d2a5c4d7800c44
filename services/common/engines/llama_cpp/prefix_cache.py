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

Entries are keyed by block hashes (`prefix_keys.block_hashes`: a chain of SHA-256 over the
tokens, salted with the fingerprint), so a decode node can keep the prefix of a KV state it
loaded without knowing its tokens, and a prefill node can tell which decode node holds which
prefix: a prefix from another model or other KV settings never matches.

Models with sliding-window attention (gemma3, gpt-oss) keep only a window of each sequence in
those layers: llama.cpp reuses the cells of positions no later token of the sequence attends
to. An entry can then serve a prompt from position n only while its window layers still hold
every position a token at n attends to (`attended_from`), which the cache checks at each
lookup; entries are not folded into longer ones there, since a longer entry no longer holds
the window of a shorter one.

An entry no running slot shares is kept outside the context once other work starts (the
third way of #42, docs/batching.md): its sequence is exported as a one-sequence state's
bytes (llama.cpp's `llama_state_seq_get_data`, as a KV handoff's) and its cells freed
(parked while a slot holds cells: `Context.drop`), so that a prompt or a stream that does
not use it does not attend over its cells, masked out; a prompt starting with it loads the
bytes back into its sequence first (an 11 MB state in 1-5 ms on a 2-core AMD EPYC) and
shares its cells as before. An entry mostly like a prompt running or starting stays (its
cells are mostly that prompt's too). Not for sliding-window models, whose window layers'
cells an entry's state does not describe alone (`Entry.window_from`): theirs stay resident.

Only the engine thread changes a PrefixCache; `tokens` is a plain int that other threads may
read (the engine's load()).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from disagg_mesh.server.common.engines.llama_cpp.model import attended_from
from disagg_mesh.server.common.engines.prefix_keys import (
    PREFIX_BLOCK_TOKENS,
    common_prefix,
    reusable_blocks,
)


class Sequences(Protocol):
    """What the cache needs of the context."""

    def copy_prefix(self, source: int, target: int, tokens: int) -> None: ...

    def drop(self, seq: int) -> None: ...

    def pos_min(self, seq: int) -> int: ...

    def export_state(self, seq: int) -> memoryview: ...

    def import_state(self, seq: int, state: memoryview) -> int: ...


@dataclass(eq=False)
class Entry:
    seq: int
    # One hash per whole block held (prefix_keys.block_hashes): the entry holds positions
    # 0 .. len(hashes) * block_tokens - 1 of the prompt these hashes describe.
    hashes: tuple[bytes, ...]
    used: int
    # Sliding-window models: the sequence's window layers hold no position below this one
    # that the cache can count on (a state loaded with a prefix from elsewhere holds that
    # prefix's old window cells, then a gap up to its own window).
    window_from: int = 0
    # The slots sharing its cells now (it was copied into them, or kept from them).
    users: set[int] = field(default_factory=set)
    # Its KV as a one-sequence state's bytes, its cells freed (None: resident).
    stored: memoryview | None = None


class PrefixCache:
    def __init__(
        self,
        context: Sequences,
        seqs: Sequence[int],
        budget_tokens: int,
        block_tokens: int = PREFIX_BLOCK_TOKENS,
        window: int = 0,
        store: bool = True,
    ) -> None:
        """store: keep entries no slot shares outside the context (not for window models)."""
        self._ctx = context
        self.window = window
        self._store = store and not window
        self._free = list(seqs)
        self.budget_tokens = budget_tokens
        self.block_tokens = block_tokens
        self._entries: list[Entry] = []
        self._clock = itertools.count()
        # Tokens held (a prefix held by two entries counts twice), and those of them kept
        # outside the context.
        self.tokens = 0
        self.stored_tokens = 0

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int) -> tuple[Entry | None, int]:
        """The entry sharing the most whole blocks with a prompt of these block hashes, and
        how many tokens; at least one token is always left to evaluate (its logits are
        needed)."""
        usable = reusable_blocks(hashes, prompt_tokens, self.block_tokens)
        best: Entry | None = None
        best_n = 0
        for entry in self._entries:
            n = common_prefix(entry.hashes, usable) * self.block_tokens
            if n > best_n and self.serves(entry, n):
                best, best_n = entry, n
        return best, best_n

    def serves(self, entry: Entry, tokens: int) -> bool:
        """Whether the entry's first `tokens` positions are a complete KV for continuing from
        there: always, but for a sliding-window model whose window cells have gone."""
        return not self.window or self.window_from(entry) <= attended_from(tokens, self.window)

    def window_from(self, entry: Entry) -> int:
        """The lowest position from which the entry's window layers hold every position up to
        its end (see Entry.window_from)."""
        if not self.window:
            return 0
        lowest = self._ctx.pos_min(entry.seq)
        if lowest < 0:  # its window layers hold nothing
            return len(entry.hashes) * self.block_tokens
        return max(lowest, entry.window_from)

    def find(self, hashes: Sequence[bytes], tokens: int) -> Entry | None:
        """An entry holding the first `tokens` positions (whole blocks) of the prompt these
        hashes describe (the hash of the last of those blocks covers all before it)."""
        blocks = tokens // self.block_tokens
        if blocks == 0 or blocks > len(hashes) or tokens % self.block_tokens:
            return None
        return next(
            (
                e
                for e in self._entries
                if len(e.hashes) >= blocks and e.hashes[blocks - 1] == hashes[blocks - 1]
            ),
            None,
        )

    def use(self, entry: Entry, slot: int, tokens: int) -> bool:
        """Put the entry's first `tokens` into the slot; False when the entry was kept
        outside the context and llama.cpp found no room to load it back (it is gone)."""
        if not self.restore(entry):
            return False
        self._ctx.copy_prefix(entry.seq, slot, tokens)
        entry.used = next(self._clock)
        entry.users.add(slot)
        return True

    def restore(self, entry: Entry) -> bool:
        """The entry's cells back in the context if it was kept outside; False (and the
        entry dropped) when llama.cpp refused its state (no room for it)."""
        state = entry.stored
        if state is None:
            return True
        self._unstore(entry)
        if self._ctx.import_state(entry.seq, state) != len(state):
            self._drop(entry)
            return False
        return True

    def unshared(
        self, keep: Entry | None = None, live: Sequence[Sequence[bytes]] = ()
    ) -> list[Entry]:
        """The resident entries no slot shares, but `keep`, and but those starting with
        half their blocks or more as one of the `live` prompts' block hashes (the prompts
        running or starting now, whose cells are then mostly theirs too: moving such an
        entry out would copy it all and free few cells): those `store` would move out."""
        if not self._store:
            return []
        return [
            e
            for e in self._entries
            if e.stored is None
            and not e.users
            and e is not keep
            and all(2 * common_prefix(e.hashes, h) < len(e.hashes) for h in live)
        ]

    def store(self, entries: Sequence[Entry]) -> None:
        """Move these entries (of `unshared`) out of the context: each as its state's
        bytes, its cells freed."""
        for entry in entries:
            entry.stored = self._ctx.export_state(entry.seq)
            self._ctx.drop(entry.seq)
            self.stored_tokens += self._tokens(entry)

    def release(self, slot: int) -> None:
        """The slot has ended: it shares no entry's cells any more."""
        for entry in self._entries:
            entry.users.discard(slot)

    def keep(self, slot: int, hashes: Sequence[bytes], window_from: int = 0) -> int:
        """Keep the slot's first len(hashes) whole blocks resident (they hold those tokens),
        as many as the budget allows; returns the tokens now held. window_from: see Entry."""
        held = tuple(hashes[: self.budget_tokens // self.block_tokens])
        n = len(held) * self.block_tokens
        if n == 0:
            return 0
        for entry in self._entries:
            if common_prefix(entry.hashes, held) == len(held) and self.serves(entry, n):
                entry.used = next(self._clock)  # already held
                if entry.stored is not None and len(entry.hashes) == len(held):
                    # Outside the context, and the slot holds the same cells: share those.
                    self._unstore(entry)
                    self._ctx.copy_prefix(slot, entry.seq, n)
                    entry.users.add(slot)
                return n
        if not self.window:
            for entry in [e for e in self._entries if held[: len(e.hashes)] == e.hashes]:
                self._drop(entry)  # this one holds all of it, and more
        while self._entries and (self.tokens + n > self.budget_tokens or not self._free):
            self.evict()
        if not self._free:
            return 0
        seq = self._free.pop()
        self._ctx.copy_prefix(slot, seq, n)
        self._entries.append(Entry(seq, held, next(self._clock), window_from, {slot}))
        self.tokens += n
        return n

    def evict(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        self._drop(min(self._entries, key=lambda e: e.used))
        return True

    def free_cells(self) -> bool:
        """Free KV cells for a pass that found none: the least recently used resident entry
        no slot shares moves out of the context, else the least recently used resident
        entry is dropped (while a slot holds cells, theirs are parked: the caller frees the
        parked cells next); False when no entry holds cells."""
        unshared = self.unshared()
        if unshared:
            self.store([min(unshared, key=lambda e: e.used)])
            return True
        resident = [e for e in self._entries if e.stored is None]
        if not resident:
            return False
        self._drop(min(resident, key=lambda e: e.used))
        return True

    def _tokens(self, entry: Entry) -> int:
        return len(entry.hashes) * self.block_tokens

    def _unstore(self, entry: Entry) -> None:
        """The entry's bytes are no longer kept (its cells are back, or it is gone)."""
        if entry.stored is not None:
            entry.stored = None
            self.stored_tokens -= self._tokens(entry)

    def _drop(self, entry: Entry) -> None:
        self._entries.remove(entry)
        self.tokens -= self._tokens(entry)
        self._unstore(entry)
        self._ctx.drop(entry.seq)
        self._free.append(entry.seq)
