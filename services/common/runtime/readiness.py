"""Holding a node's logic until its model has loaded."""

from __future__ import annotations

from typing import Generic, TypeVar

from disagg_mesh.server.common.errors import Unavailable

T = TypeVar("T")


class Ready(Generic[T]):
    """Set once the node is ready; before that, calls get UNAVAILABLE (retryable)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._value: T | None = None

    def set(self, value: T) -> None:
        self._value = value

    def is_set(self) -> bool:
        return self._value is not None

    def get(self) -> T:
        if self._value is None:
            raise Unavailable(f"{self._what} is still loading its model; retry shortly")
        return self._value
