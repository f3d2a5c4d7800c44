"""A machine's cores, shared by the engine nodes on it.

llama.cpp's CPU threads spin while they wait: two busy nodes whose threads add up to more
than the cores slow each other down many times over, while a node alone on the machine is
fastest with every core. So the engine nodes of one host (those the topology puts on it with
no `n_threads` of their own) share a budget: each keeps one byte in a small shared file
saying whether it is busy, and before each step a busy node takes the cores divided by the
busy nodes (`llama_set_n_threads`). A request alone gets every core; many at once share them
without oversubscription. A node that dies busy leaves its byte set: the others then take
fewer cores than they could, never more, until it starts again and clears it.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from pathlib import Path


class HostThreads:
    def __init__(self, peers: list[str], name: str, cores: int, folder: Path | None = None):
        """peers: the names of the engine nodes sharing this host (name among them)."""
        ordered = sorted(peers)
        self._index = ordered.index(name)
        self._count = len(ordered)
        self.cores = cores
        key = hashlib.sha256("\n".join(ordered).encode()).hexdigest()[:16]
        shm = Path("/dev/shm")
        base = folder or (shm if shm.is_dir() else Path(tempfile.gettempdir()))
        self.path = base / f"disagg-mesh-threads-{os.getuid()}-{key}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self._count:
                os.ftruncate(fd, self._count)
            self._map = mmap.mmap(fd, self._count)
        finally:
            os.close(fd)
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        self._map[self._index] = 1 if busy else 0

    def threads(self) -> int:
        """This node's share of the cores now (counting itself as busy)."""
        others = sum(1 for i, b in enumerate(self._map[: self._count]) if b and i != self._index)
        return max(1, self.cores // (others + 1))

    def close(self) -> None:
        self.set_busy(False)
        self._map.close()
