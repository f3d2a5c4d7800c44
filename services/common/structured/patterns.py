"""How complex a JSON Schema `pattern` is for llama.cpp's grammar, read before it is
converted: its repetition bounds, and the product of bounded repetitions nested in one
another.

The converter unrolls `x{1,n}` into n nested optional copies of x, and llama.cpp's grammar
follows every position the text so far could be at in parallel (one stack each). A single
`[a-z]{1,1000}` stays cheap (~6 ms a token here, measured on the whole vocabulary); nested
ones multiply: `([a-z]{1,10}){1,10}` 24 ms, `([a-z]{1,30}){1,30}` 214 ms,
`(([a-z]{1,10}){1,10}){1,10}` 1.7 s a token. Unbounded `+` and `*` loop on one position and
cost nothing of the kind (`(([a-z]+)+ )+`: 12 ms).

The reading is lenient: what it does not understand it skips, and llama.cpp's converter
refuses what it cannot translate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PatternCost:
    # The largest {m,n} bound written in the pattern.
    largest_bound: int
    # The largest product of the bounds of repetitions nested in one another (1: none).
    nested_repetition: int


@dataclass
class _Unit:
    # Product of the bounded repetitions inside (1: none).
    product: int = 1
    # Whether its text may have more than one length (it holds a repetition).
    variable: bool = False


class _Reader:
    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.i = 0
        self.largest = 0
        self.nested = 1

    def sequence(self) -> _Unit:
        """Alternatives up to a ')' or the end: the largest of their units."""
        out = _Unit()
        while self.i < len(self.text) and self.text[self.i] != ")":
            if self.text[self.i] == "|":
                self.i += 1
                continue
            unit = self.quantified(self.atom())
            out.product = max(out.product, unit.product)
            out.variable |= unit.variable
        return out

    def atom(self) -> _Unit:
        c = self.text[self.i]
        self.i += 1
        if c == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            inner = self.sequence()
            self.i += 1  # the ')' (or past the end)
            return inner
        if c == "[":
            if self.i < len(self.text) and self.text[self.i] == "]":
                self.i += 1
            while self.i < len(self.text) and self.text[self.i] != "]":
                self.i += 2 if self.text[self.i] == "\\" else 1
            self.i += 1
        elif c == "\\":
            self.i += 1
        return _Unit()

    def quantified(self, unit: _Unit) -> _Unit:
        if self.i >= len(self.text):
            return unit
        c = self.text[self.i]
        if c in "*+?":
            self.i += 1
            return _Unit(unit.product, True)
        if c != "{":
            return unit
        end = self.text.find("}", self.i)
        if end < 0:
            return unit
        body = self.text[self.i + 1 : end]
        self.i = end + 1
        low, _, high = body.partition(",")
        numbers = [int(n) for n in (low, high) if n.strip().isdigit()]
        if not numbers:
            return unit
        bound = max(numbers)
        self.largest = max(self.largest, bound)
        if unit.variable:  # a repetition of something that itself repeats
            product = bound * unit.product
            self.nested = max(self.nested, product)
            return _Unit(product, True)
        return _Unit(bound, True)


def pattern_cost(pattern: str) -> PatternCost:
    reader = _Reader(pattern)
    while reader.i < len(reader.text):
        reader.sequence()
        reader.i += 1  # an unmatched ')'
    return PatternCost(reader.largest, reader.nested)
