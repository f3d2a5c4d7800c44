"""What one step of the scheduler does, as a pure function of its slots (`plan_step`): which
slots get a token in the step's decode pass, and how far each prompting slot's prompt gets,
each in a pass of its own (the scheduler lets short pieces share one while it stays under
`SlotContext.alike_rows`). No llama.cpp here: the scheduler carries the plan out.

Each slot is in one phase (`SlotPhase`), set by the scheduler as it moves on: LOAD (a
decode node's KV state going into the slot), PROMPT (its prompt evaluated in pieces),
REPLAY (a prefill node evaluating an interrupted generation's tokens, one a step, streaming
nothing), GENERATE (a token a step, streamed).

How many prompt tokens each prompting slot evaluates while streams generate: the step's
prompt passes may take `max_slowdown - 1` times the step's decode pass, so the streams'
inter-token latency grows at most `max_slowdown` times. A prompt token's cost is read off
that slot's own last pass (it grows as the prompt does: each token attends to all before
it), so the share follows it. With no stream generating, every prompt gets its next
`n_batch` tokens, cut where the prompt alone would be cut, so its numbers are those it
would have alone."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

# Tokens of a prompt's first piece while streams generate, before its cost is known.
FIRST_PIECE = 8


def prompt_pieces(
    remaining: Sequence[int],
    seconds_per_token: Sequence[float | None],
    decode_pass_s: float | None,
    max_slowdown: float,
    n_batch: int,
) -> list[int]:
    """Tokens for each prompting slot, in the order they arrived: an equal share of the
    time each, then what is left to whoever can use it; every slot gets at least one
    token, and none more than n_batch."""
    if decode_pass_s is None:
        return [min(r, FIRST_PIECE, n_batch) for r in remaining]
    time_left = (max_slowdown - 1.0) * decode_pass_s
    share = time_left / max(len(remaining), 1)
    pieces = [0] * len(remaining)
    for allowance in (share, None):  # a fair share first, then the rest
        for i, (left, cost) in enumerate(zip(remaining, seconds_per_token, strict=True)):
            want = left - pieces[i]
            if want <= 0:
                continue
            if cost is None:
                take = min(want, FIRST_PIECE) if not pieces[i] else 0
            else:
                budget = time_left if allowance is None else min(allowance, time_left)
                take = min(want, int(budget / cost + 1e-6))
            take = min(take, n_batch - pieces[i])
            pieces[i] += take
            time_left -= take * (cost or 0.0)
    return [max(p, 1) for p in pieces]


class SlotPhase(enum.Enum):
    LOAD = "load"
    PROMPT = "prompt"
    REPLAY = "replay"
    GENERATE = "generate"


class Planned(Protocol):
    """What the plan reads of a slot."""

    @property
    def phase(self) -> SlotPhase: ...

    # Admission order (the oldest prompt first).
    @property
    def order(self) -> int: ...

    @property
    def prompt_tokens_total(self) -> int: ...

    # Prompt tokens evaluated so far, and those of them taken from the prefix cache (the
    # prompt's n_batch pieces start there).
    @property
    def evaluated(self) -> int: ...

    @property
    def cached(self) -> int: ...

    # Seconds per token of its last prompt pass (None: none yet).
    @property
    def prompt_token_s(self) -> float | None: ...


S = TypeVar("S", bound=Planned)


@dataclass(frozen=True)
class StepPlan(Generic[S]):
    # One token each, in one pass.
    decode: list[S]
    # Each slot's prompt evaluated up to that position, oldest first (in passes of their
    # own, short ones sharing one: Scheduler._prompt_groups).
    prompts: list[tuple[S, int]]


def plan_step(
    slots: Sequence[S],
    n_batch: int,
    decode_pass_s: float | None,
    max_slowdown: float,
) -> StepPlan[S]:
    """The step for these slots (those in use, in slot order); decode_pass_s: seconds of a
    decode pass lately (None: not measured yet)."""
    decode = [s for s in slots if s.phase in (SlotPhase.GENERATE, SlotPhase.REPLAY)]
    prompting = sorted((s for s in slots if s.phase is SlotPhase.PROMPT), key=lambda s: s.order)
    # A prefill replaying a continuation's tokens streams nothing: prompts need not make
    # room for it (and are cut as they would be without it).
    if not any(s.phase is SlotPhase.GENERATE for s in decode):
        ends = [
            min(
                s.prompt_tokens_total,
                s.cached + ((s.evaluated - s.cached) // n_batch + 1) * n_batch,
            )
            for s in prompting
        ]
    else:
        pieces = prompt_pieces(
            [s.prompt_tokens_total - s.evaluated for s in prompting],
            [s.prompt_token_s for s in prompting],
            decode_pass_s,
            max_slowdown,
            n_batch,
        )
        ends = [s.evaluated + n for s, n in zip(prompting, pieces, strict=True)]
    return StepPlan(decode, list(zip(prompting, ends, strict=True)))
