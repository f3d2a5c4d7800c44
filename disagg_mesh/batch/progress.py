"""What a batch shows while it runs, and its summary at the end.

On a terminal, a live bar (rich): done / failed / in flight, generated tokens per second and
an ETA. Elsewhere (a log file, a pipe, CI), a plain line every PLAIN_EVERY_S seconds and at
the end.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from disagg_mesh.batch.results import BatchResult

PLAIN_EVERY_S = 5.0


class Tally:
    """This run's counts: results so far, tokens generated, rate, ETA."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.results: list[BatchResult] = []
        self.started = time.monotonic()

    def add(self, result: BatchResult) -> None:
        self.results.append(result)

    @property
    def done(self) -> int:
        return len(self.results)

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.results)

    def tokens_per_second(self) -> float:
        elapsed = time.monotonic() - self.started
        tokens = sum(r.completion_tokens for r in self.results)
        return tokens / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        """Seconds left at the pace so far; None before the first result."""
        if not self.results:
            return None
        elapsed = time.monotonic() - self.started
        return elapsed / self.done * (self.total - self.done)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Display:
    """Progress on `stream`: a rich bar when it is a terminal, plain lines otherwise."""

    def __init__(self, tally: Tally, stream: IO[str]) -> None:
        self.tally = tally
        self.stream = stream
        self._said_at = 0.0
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        if stream.isatty():
            self._bar = Progress(
                TextColumn("[bold]batch"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[counts]}"),
                TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
                console=Console(file=stream),
                refresh_per_second=4,
            )
            self._task = self._bar.add_task("batch", total=tally.total, counts="", eta="")

    def __enter__(self) -> Display:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self.show(0)
            self._bar.stop()

    def counts(self, in_flight: int) -> str:
        t = self.tally
        return (
            f"{t.done - t.failed} ok, {t.failed} failed, {in_flight} in flight, "
            f"{t.tokens_per_second():.0f} tok/s"
        )

    def show(self, in_flight: int) -> None:
        t = self.tally
        if self._bar is not None and self._task is not None:
            self._bar.update(
                self._task, completed=t.done, counts=self.counts(in_flight), eta=clock(t.eta_s())
            )
            return
        now = time.monotonic()
        if not (t.done or in_flight):  # not started yet
            return
        if now - self._said_at >= PLAIN_EVERY_S or t.done == t.total:
            self._said_at = now
            print(
                f"batch: {t.done}/{t.total} done ({self.counts(in_flight)}), "
                f"ETA {clock(t.eta_s())}",
                file=self.stream,
                flush=True,
            )


def summary_rows(results: Sequence[BatchResult]) -> list[dict[str, str]]:
    """Per model: requests, failures by code, p50/p95 latency, prompt tokens and how many
    of them came from the prefix cache."""
    rows = []
    for model in sorted({r.model for r in results}):
        mine = [r for r in results if r.model == model]
        failures = Counter(r.failure for r in mine if not r.ok)
        latencies = sorted(r.latency_s for r in mine)
        prompt = sum(r.prompt_tokens for r in mine if r.ok)
        cached = sum(r.cached_prompt_tokens for r in mine if r.ok)
        rows.append(
            {
                "model": model,
                "requests": str(len(mine)),
                "failed": ", ".join(f"{n}x {code}" for code, n in sorted(failures.items())) or "0",
                "p50": f"{_percentile(latencies, 50):.2f} s",
                "p95": f"{_percentile(latencies, 95):.2f} s",
                "prompt tokens": str(prompt),
                "from cache": f"{cached} ({cached / prompt:.0%})" if prompt else "0",
            }
        )
    return rows


def _percentile(sorted_values: Sequence[float], p: int) -> float:
    if len(sorted_values) < 2:
        return sorted_values[0] if sorted_values else 0.0
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[p - 1]
