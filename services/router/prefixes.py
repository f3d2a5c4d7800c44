"""What the router believes each decode node holds in its prefix cache.

After a disaggregated request, the decode node keeps the prompt's whole blocks resident, so
the router records their hashes (from the prefill node's reply) under that node. The next
prefill call lists the decode nodes it may choose with what each is believed to hold; the
prefill node picks the one holding the longest prefix of its prompt and exports only the
rest of the KV state. A belief can be stale (the node evicted the blocks, or restarted):
the decode node then answers ABORTED and the router forgets what it believed of that node.

Hashes are salted with the model's fingerprint (engines/prefix_keys.py), so one table
serves every model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from disagg_mesh.server.common.engines.prefix_keys import chained_hashes, leading_blocks
from disagg_mesh.server.common.types import Prompt

# Characters of a prompt's text block (text_blocks): about 64 tokens.
TEXT_BLOCK_CHARS = 256
# Block hashes remembered per decode node (16 bytes each; 64 tokens each): 64 Ki tokens of
# prefixes, and at most 16 KiB per node in a prefill request.
MAX_HASHES_PER_NODE = 1024


class PrefixTable:
    def __init__(
        self, max_per_node: int = MAX_HASHES_PER_NODE, capacity: Mapping[str, int] | None = None
    ) -> None:
        """capacity: the blocks each node's cache holds at most (the router believes no more
        of it, the least recently learnt out first, as the node lets its least recently used
        blocks go)."""
        self._max = max_per_node
        self._capacity = dict(capacity or {})
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def learn(self, node: str, hashes: Iterable[bytes]) -> None:
        """The node now holds these blocks (most recent last; the oldest are forgotten)."""
        held = self._held.setdefault(node, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        most = min(self._max, self._capacity.get(node, self._max))
        while len(held) > most:
            held.popitem(last=False)

    def forget(self, node: str) -> None:
        self._held.pop(node, None)

    def held(self, node: str) -> tuple[bytes, ...]:
        return tuple(self._held.get(node, ()))

    def overlap(self, node: str, hashes: Sequence[bytes]) -> int:
        """How many of these chained hashes, from the first, the node is believed to hold."""
        return leading_blocks(hashes, self._held.get(node, {}))


def prompt_bytes(prompt: Prompt) -> bytes:
    """The prompt as the router sees it: its text, or its turns one after another (a
    fill-in-the-middle prompt's text marked, as the nodes' tokens start with a FIM token)."""
    if prompt.messages:
        return "".join(f"{m.role}\x00{m.content}\x00" for m in prompt.messages).encode()
    if prompt.suffix:
        return f"\x00fim\x00{prompt.text}".encode()
    return prompt.text.encode()


def text_blocks(model: str, data: bytes) -> list[bytes]:
    """Chained hashes of a prompt's bytes (prompt_bytes) in blocks of TEXT_BLOCK_CHARS: the
    router does not tokenize, so it tells prompts that start alike by their text (a node's
    own cache then matches tokens)."""
    return chained_hashes(model, data, TEXT_BLOCK_CHARS)
