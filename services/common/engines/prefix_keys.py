"""Keys of prompt prefixes: chains of block hashes, as the embedded engine's prefix cache
keys its entries (blocks of token ids) and the router tells prompts that start alike
(blocks of text, since it does not tokenize).

Each hash covers its block and, through the chain, every block before it: two prompts share
their first k hashes exactly when they share their first k blocks. The chain starts from a
salt (the model's fingerprint for token blocks), so equal hashes also mean the same model
and settings. Plain Python: the router imports it without llama.cpp.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Sequence

# Tokens of a prefix cache block: caches match, keep and hand over whole blocks.
PREFIX_BLOCK_TOKENS = 64


def chained_hashes(salt: str, data: bytes, block_bytes: int) -> list[bytes]:
    """One 16-byte hash per whole block of `data`, chained from the salt."""
    out = []
    chain = hashlib.sha256(salt.encode()).digest()
    for end in range(block_bytes, len(data) + 1, block_bytes):
        chain = hashlib.sha256(chain + data[end - block_bytes : end]).digest()
        out.append(chain[:16])
    return out


def block_hashes(
    salt: str, tokens: Sequence[int], block_tokens: int = PREFIX_BLOCK_TOKENS
) -> list[bytes]:
    """The chained hashes of a prompt's whole blocks of token ids (4 bytes each, little
    endian)."""
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    return chained_hashes(salt, data, 4 * block_tokens)


def reusable_blocks(
    hashes: Sequence[bytes], prompt_tokens: int, block_tokens: int = PREFIX_BLOCK_TOKENS
) -> Sequence[bytes]:
    """The prompt's blocks that may come from elsewhere (a cache, another node): its last
    token is always evaluated here, for its logits."""
    return hashes[: (prompt_tokens - 1) // block_tokens]


def common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many hashes two chains share from the first."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def leading_blocks(hashes: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of these chained hashes, from the first, are held."""
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n
