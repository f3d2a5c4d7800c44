"""The router's recent requests, per logical model: what the dashboard draws from.

Each finished request leaves one Done record (when it started and ended, its time to first
token, tokens, KV handoff, prefix-cache share, migrations and failed attempts); each failed
one its code. Figures over a window (the last 60 s by default) come from the records still
in it: rates, percentiles, the two pipelines' overlap. Plain Python, no protobuf.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from disagg_mesh.server.router.summary import RouteSummary

# Records older than this are dropped: the dashboard keeps an hour.
KEEP_S = 3600.0


@dataclass(frozen=True)
class Done:
    model: str
    started: float  # time.time()
    ended: float
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_handoff_s: float
    kv_bytes_moved: int
    migrations: int
    failovers: int
    # The longest a failure held the answer up: a failed attempt's time, a migration's resume.
    failover_s: float


@dataclass(frozen=True)
class Failed:
    model: str
    at: float
    code: str


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by nearest rank; None without values."""
    return _ranked(sorted(values), q)


def _ranked(ordered: list[float], q: float) -> float | None:
    """percentile() of values already in order."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def busy_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of these (start, end) spans."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


@dataclass
class ModelFigures:
    """One logical model over a window."""

    requests: int = 0
    failed: int = 0
    requests_per_second: float = 0.0
    tokens_per_second: float = 0.0
    ttft_seconds: dict[str, float | None] = field(default_factory=dict)
    total_seconds: dict[str, float | None] = field(default_factory=dict)
    kv_handoff_seconds_p50: float | None = None
    kv_megabytes_per_second: float | None = None
    prefix_cache_hit_rate: float | None = None
    migrations: int = 0
    failovers: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Hour:
    """The last hour's counts: what the error-rate and failover targets read."""

    done: int
    failed: int
    longest_failover_s: float | None  # None: no request failed over


R = TypeVar("R", Done, Failed)


class Records:
    """Done and failed requests kept for an hour, in the order they ended, and the figures
    over a window of them. A window is read from its newest end, so a tick costs what the
    window holds, not the hour (at 40 requests a second, 144,000 records)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.done: deque[Done] = deque()
        self.failed: deque[Failed] = deque()
        # The done records with a failover, the only ones the hour's longest reads.
        self._failed_over: deque[Done] = deque()

    def add(self, done: Iterable[Done], failed: Iterable[Failed]) -> None:
        """Records another router served (its dashboard's /api/dashboard/requests)."""
        for d in done:
            self._add_done(d)
        for f in failed:
            _place(self.failed, f)
        self._trim(self._clock())

    def _add_done(self, record: Done) -> None:
        _place(self.done, record)
        if record.failover_s > 0:
            _place(self._failed_over, record)

    def _trim(self, now: float) -> None:
        for records in (self.done, self.failed, self._failed_over):
            while records and now - _at(records[0]) > KEEP_S:
                records.popleft()

    def since(self, seconds: float) -> tuple[list[Done], list[Failed]]:
        start = self._clock() - seconds
        return _newer(self.done, start, True), _newer(self.failed, start, True)

    def after(self, t: float) -> tuple[list[Done], list[Failed]]:
        """Records that ended after t (what a peer router has not pulled yet)."""
        return _newer(self.done, t, False), _newer(self.failed, t, False)

    def hour(self) -> Hour:
        """The counts over the last hour (KEEP_S)."""
        self._trim(self._clock())
        return Hour(
            len(self.done),
            len(self.failed),
            max((d.failover_s for d in self._failed_over), default=None),
        )

    def figures(self, models: list[str], window_s: float) -> dict[str, ModelFigures]:
        return figures(*self.since(window_s), models, window_s)

    def parallel_efficiency(self, window_s: float) -> float | None:
        return parallel_efficiency(self.since(window_s)[0])


class Merged(Records):
    """Several routers' records as one: the whole mesh's traffic."""

    def __init__(self, parts: list[Records], clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self._parts = parts

    def since(self, seconds: float) -> tuple[list[Done], list[Failed]]:
        done: list[Done] = []
        failed: list[Failed] = []
        for part in self._parts:
            d, f = part.since(seconds)
            done += d
            failed += f
        return done, failed

    def hour(self) -> Hour:
        hours = [part.hour() for part in self._parts]
        return Hour(
            sum(h.done for h in hours),
            sum(h.failed for h in hours),
            max((h.longest_failover_s for h in hours if h.longest_failover_s), default=None),
        )


class Recent(Records):
    """This router's own requests, recorded as they finish."""

    def served(self, model: str, s: RouteSummary) -> None:
        now = self._clock()
        failover_s = max(
            [a.seconds for a in s.failed_attempts] + [m.resume_seconds for m in s.migrations],
            default=0.0,
        )
        self._add_done(
            Done(
                model=model,
                started=now - s.total_seconds,
                ended=now,
                ttft_s=s.time_to_first_token_seconds,
                total_s=s.total_seconds,
                prompt_tokens=s.prompt_tokens,
                completion_tokens=s.completion_tokens,
                # The prompt tokens no node evaluated again: the prefill node's cache (the
                # decode node's, for decode_only).
                cached_tokens=s.cached_prompt_tokens,
                kv_handoff_s=s.kv_transfer_seconds + s.kv_load_seconds,
                kv_bytes_moved=s.kv_transfer_bytes,
                migrations=len(s.migrations),
                failovers=len(s.failed_attempts),
                failover_s=failover_s,
            )
        )
        self._trim(now)

    def refused(self, model: str, code: str) -> None:
        now = self._clock()
        _place(self.failed, Failed(model, now, code))
        self._trim(now)


def figures(
    done: list[Done], failed: list[Failed], models: list[str], window_s: float
) -> dict[str, ModelFigures]:
    """Each logical model's figures from the records of a window of window_s seconds."""
    out = {}
    for model in models:
        mine = [d for d in done if d.model == model]
        errors = Counter(f.code for f in failed if f.model == model)
        handoffs = [d for d in mine if d.kv_bytes_moved > 0]
        handoff_s = sum(d.kv_handoff_s for d in handoffs)
        prompt = sum(d.prompt_tokens for d in mine)
        out[model] = ModelFigures(
            requests=len(mine),
            failed=sum(errors.values()),
            requests_per_second=len(mine) / window_s,
            tokens_per_second=sum(d.completion_tokens for d in mine) / window_s,
            ttft_seconds=_quantiles([d.ttft_s for d in mine]),
            total_seconds=_quantiles([d.total_s for d in mine]),
            kv_handoff_seconds_p50=percentile([d.kv_handoff_s for d in handoffs], 50),
            kv_megabytes_per_second=(
                sum(d.kv_bytes_moved for d in handoffs) / 1e6 / handoff_s if handoff_s > 0 else None
            ),
            prefix_cache_hit_rate=(sum(d.cached_tokens for d in mine) / prompt if prompt else None),
            migrations=sum(d.migrations for d in mine),
            failovers=sum(d.failovers for d in mine),
            errors=dict(errors),
        )
    return out


def parallel_efficiency(done: list[Done]) -> float | None:
    """The seeds' parallel efficiency: the logical models' busy time added up (each model's
    requests as one union of spans), over the time any was busy. 2.0: two pipelines ran side
    by side all along; 1.0: one after the other. None when fewer than two models served."""
    by_model: dict[str, list[tuple[float, float]]] = {}
    for d in done:
        by_model.setdefault(d.model, []).append((d.started, d.ended))
    if len(by_model) < 2:
        return None
    union = busy_seconds(span for spans in by_model.values() for span in spans)
    if union <= 0:
        return None
    return sum(busy_seconds(spans) for spans in by_model.values()) / union


def _at(record: Done | Failed) -> float:
    return record.ended if isinstance(record, Done) else record.at


def _place(records: deque[R], record: R) -> None:
    """Add a record in end order: at the end, or (ended before the newest: another router's,
    or the clock stepped back) searched for from the end."""
    at = _at(record)
    i = len(records)
    while i and _at(records[i - 1]) > at:
        i -= 1
    records.insert(i, record)


def _newer(records: deque[R], t: float, inclusive: bool) -> list[R]:
    """The records that ended after t (at t too if inclusive), oldest first, read from the
    newest end."""
    out = []
    for record in reversed(records):
        at = _at(record)
        if at < t or (at == t and not inclusive):
            break
        out.append(record)
    out.reverse()
    return out


def _quantiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {f"p{q}": _ranked(ordered, q) for q in (50, 95, 99)}
