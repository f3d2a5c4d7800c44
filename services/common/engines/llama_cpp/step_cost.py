"""How long a step of the batch loop takes for how many rows: a straight line fitted to the
recent steps, so the loop can tell how many prompt tokens fit beside the generating ones."""

from __future__ import annotations

# Prompt tokens a step takes while streams generate, before any step has been timed.
FIRST_PROMPT_BUDGET = 8


class StepCost:
    """Seconds of one step as `fixed + per_row * rows`, fitted by least squares over the
    steps seen, each older step weighing `forget` times the next (about the last 1 /
    (1 - forget) steps count)."""

    def __init__(self, forget: float = 0.9) -> None:
        self._forget = forget
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        f = self._forget
        self._n = f * self._n + 1.0
        self._x = f * self._x + rows
        self._y = f * self._y + seconds
        self._xx = f * self._xx + rows * rows
        self._xy = f * self._xy + rows * seconds

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per row); a line through zero when the steps seen do not
        tell the two apart (all of one size, or a fit that would go below zero)."""
        mean_x, mean_y = self._x / self._n, self._y / self._n
        spread = self._xx / self._n - mean_x * mean_x
        if spread > 1e-6 * max(mean_x * mean_x, 1.0):
            per_row = (self._xy / self._n - mean_x * mean_y) / spread
            fixed = mean_y - per_row * mean_x
            if per_row > 0 and fixed >= 0:
                return fixed, per_row
        return 0.0, self._xy / self._xx

    def prompt_budget(self, generating: int, max_slowdown: float) -> int:
        """Prompt tokens to add to a step of `generating` rows so that it takes at most
        `max_slowdown` times as long as that step alone (at least one)."""
        if self._n == 0.0 or self._xx == 0.0:
            return FIRST_PROMPT_BUDGET
        fixed, per_row = self.line()
        alone = fixed + per_row * generating
        share = (max_slowdown - 1.0) * alone / max(per_row, 1e-9)
        return max(1, int(share + 1e-6))  # + 1e-6: 5.9999999 tokens are 6
