"""How many prompt tokens each prompting slot evaluates in a step while streams generate.

The step's prompt passes may take `max_slowdown - 1` times the step's decode pass, so the
streams' inter-token latency grows at most `max_slowdown` times. A prompt token's cost is
read off that slot's own last pass (it grows as the prompt does: each token attends to all
before it), so the share follows it."""

from __future__ import annotations

from collections.abc import Sequence

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
