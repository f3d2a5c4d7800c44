"""The routers a client may call, in order, and those it sets aside for a while after a
failure (as the mesh does with its nodes): gRPC addresses for calls, HTTP doors for
batches."""

from __future__ import annotations

import time


class Routers:
    """The routers a client may call, in order, and those it sets aside for a while after a
    failure (as the mesh does with its nodes)."""

    def __init__(self, addresses: tuple[str, ...], cooldown_s: float) -> None:
        self.addresses = addresses
        self.cooldown_s = cooldown_s
        self._down_until: dict[str, float] = {}

    def order(self) -> list[str]:
        """Routers not set aside first, in order; then the others, soonest back first."""
        now = time.monotonic()
        up = [a for a in self.addresses if self._down_until.get(a, 0.0) <= now]
        down = sorted((a for a in self.addresses if a not in up), key=lambda a: self._down_until[a])
        return up + down

    def failed(self, address: str) -> None:
        self._down_until[address] = time.monotonic() + self.cooldown_s

    def succeeded(self, address: str) -> None:
        self._down_until.pop(address, None)

    def may_fail_over(self, attempts: int) -> bool:
        return len(self.addresses) > 1 and attempts < 2 * len(self.addresses)
