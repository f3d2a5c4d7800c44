"""A query of death stays one failure.

A request that kills the node holding it (a crash, or its connection dropped mid-call) would
be fed by the fallback chain to the next node, and the next, until none is left. Instead:
- a request whose node died while holding it, before any text was sent, is tried once more
  elsewhere; if that node dies too, the request fails with an error naming both nodes
  (FAILED_PRECONDITION: the same request would do the same again);
- the router then refuses the request's fingerprint (model + sampling, its schema included)
  for `mesh.query_of_death_quarantine_s`, at once, without sending it to a node; but only
  when it alone was held by both nodes as they died: requests that were merely beside it
  (cut by the same deaths, retried beside it) fail the same way without being refused later,
  and so do requests that share a fingerprint with it but were elsewhere.
Requests on other nodes are not touched. Each death and each refusal is logged and counted
(`disagg_router_queries_of_death_total`).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import structlog

from disagg_mesh.server.common.errors import FailedPrecondition, MeshError
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.types import Sampling

log = structlog.get_logger("router")

# What a call's UNAVAILABLE says when the connection went away during it (the node died or
# was killed holding the request), as opposed to a node that could not be reached at all or
# that answered UNAVAILABLE itself (loading, stopping).
DROPPED = (
    "Socket closed",
    "Connection reset",
    "Broken pipe",
    "RST_STREAM",
    "GOAWAY",
    "Stream removed",
    "Connection aborted",
    "Received http2 header with status",
)
# A request released by a node this recently still counts as held when it dies: calls cut
# by one death end within moments of each other.
RECENT_S = 2.0
_ids = itertools.count(1)


class QueryOfDeath(FailedPrecondition):
    """Two nodes died holding the request, or its fingerprint is refused: final."""


def dropped(exc: MeshError) -> bool:
    """The node's connection dropped while the call was in flight."""
    return exc.code == grpc.StatusCode.UNAVAILABLE and any(m in exc.message for m in DROPPED)


def fingerprint(model: str, sampling: Sampling) -> str:
    """Model + sampling (its response format's schema included), hashed."""
    return hashlib.sha256(f"{model}\n{sampling!r}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Death:
    node: str
    # The requests (their ids) the node held, or had just let go, when it died.
    held: frozenset[int]


@dataclass
class Deaths:
    """Which requests each node holds, the deaths a request has met, and the refused
    fingerprints."""

    quarantine_s: float = 300.0
    _held: dict[str, Counter[int]] = field(default_factory=dict)
    _released: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    # fingerprint -> (refused until, why)
    _refused: dict[str, tuple[float, str]] = field(default_factory=dict)

    @staticmethod
    def new_id() -> int:
        return next(_ids)

    @contextmanager
    def holding(self, node: str, request_id: int) -> Iterator[None]:
        held = self._held.setdefault(node, Counter())
        held[request_id] += 1
        try:
            yield
        finally:
            held[request_id] -= 1
            if held[request_id] <= 0:
                del held[request_id]
            now = time.monotonic()
            recent = self._released.setdefault(node, deque())
            recent.append((now, request_id))
            while recent[0][0] < now - RECENT_S:
                recent.popleft()

    def _held_by(self, node: str, request_id: int) -> frozenset[int]:
        now = time.monotonic()
        recent = {r for t, r in self._released.get(node, []) if t >= now - RECENT_S}
        return frozenset({request_id, *self._held.get(node, ()), *recent})

    def check(self, fp: str) -> None:
        """FailedPrecondition at once for a refused fingerprint."""
        refused = self._refused.get(fp)
        if refused is None:
            return
        until, why = refused
        left = until - time.monotonic()
        if left <= 0:
            del self._refused[fp]
            return
        metrics.query_of_death("refused")
        raise QueryOfDeath(
            f"{why}; the same request (fingerprint {fp}: model, sampling and schema) is refused "
            f"for {left:.0f} s more instead of being sent to another node"
        )

    def died(self, deaths: list[Death], node: str, request_id: int, fp: str) -> None:
        """The node died holding the request, whose earlier deaths are `deaths` (this one is
        appended). At the second, FailedPrecondition naming both nodes, and the fingerprint
        refused if only this request was held by both."""
        deaths.append(Death(node, self._held_by(node, request_id)))
        metrics.query_of_death("node_died")
        log.warning("node died holding the request", node=node, deaths=len(deaths), fingerprint=fp)
        if len(deaths) < 2:
            return
        first, second = deaths[0], deaths[-1]
        nodes = (
            f"node {first.node} died twice"
            if first.node == second.node
            else f"nodes {first.node} and {second.node} each died"
        )
        why = (
            f"{nodes} (connection lost) while holding this request before it sent any text; "
            "it was not sent to a third node"
        )
        suspects = first.held & second.held
        if suspects == {request_id}:
            self._refused[fp] = (time.monotonic() + self.quarantine_s, why)
            metrics.query_of_death("quarantined")
            log.error(
                "query of death: fingerprint refused",
                nodes=[first.node, second.node],
                fingerprint=fp,
                quarantine_s=self.quarantine_s,
            )
            raise QueryOfDeath(
                f"{why}; the same request (fingerprint {fp}) is refused for {self.quarantine_s:g} s"
            )
        metrics.query_of_death("failed")
        log.error(
            "request failed after two node deaths",
            nodes=[first.node, second.node],
            fingerprint=fp,
            held_by_both=len(suspects),
        )
        raise QueryOfDeath(
            f"{why} (other requests were held by both too, so its fingerprint is not refused)"
        )
