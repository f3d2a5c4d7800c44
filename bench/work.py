"""What each side of a benchmark ratio did, and the check that both did the same.

A ratio compares two ways of doing one piece of work. It means something only when both
sides evaluated the same prompt tokens, took the same number of them from a cache and
generated the same number of tokens: a mesh serving a prompt from its prefix cache against
a process evaluating it whole measures the cache, not the mesh. Every row records a `Work`
per side; `differences` names what differs, and the table prints a row's figure only when
nothing does (`make bench` then fails).

A row that measures a cache on purpose (row 10: with the prefix cache against without it)
says so with `cache_compared=True`: its sides may differ in cached tokens, nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Work:
    """One side's work, summed over everything the side's timed figure covers."""

    # Prompt tokens, cached or not.
    prompt_tokens: int = 0
    # Of those, tokens taken from a prefix cache instead of evaluated (or moved).
    cached_tokens: int = 0
    # Tokens generated (sampled).
    generated_tokens: int = 0
    # Bytes moved, for rows that time a transfer.
    bytes_moved: int = 0

    @classmethod
    def of(cls, served: Any) -> Work:
        """The work of one served request, from anything that counts it under the summary's
        names (a router or decode node summary, the client's Metrics)."""
        return cls(served.prompt_tokens, served.cached_prompt_tokens, served.completion_tokens)

    def __add__(self, other: Work) -> Work:
        return Work(
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.generated_tokens + other.generated_tokens,
            self.bytes_moved + other.bytes_moved,
        )


def total(works: list[Work]) -> Work:
    out = Work()
    for work in works:
        out = out + work
    return out


def differences(a: Work, b: Work, cache_compared: bool = False) -> list[str]:
    """What the two sides did differently, one phrase each; empty when the same."""
    found = []
    for name, x in asdict(a).items():
        y = getattr(b, name)
        if x != y and not (cache_compared and name == "cached_tokens"):
            found.append(f"{name.replace('_', ' ')} {x} vs {y}")
    return found


def record(
    names: tuple[str, str], a: Work, b: Work, cache_compared: bool = False
) -> dict[str, Any]:
    """The row's JSON entry: both sides' work and what differs."""
    return {
        names[0]: asdict(a),
        names[1]: asdict(b),
        "cache_compared": cache_compared,
        "differences": differences(a, b, cache_compared),
    }


def figure(text: str, entry: dict[str, Any] | None) -> str:
    """A row's figure, or why it is not shown."""
    if entry is None:
        return text
    if entry["differences"]:
        return (
            "NOT COMPARABLE: the sides did different work (" + "; ".join(entry["differences"]) + ")"
        )
    return text


def failures(results: dict[str, Any]) -> list[str]:
    """Every `work` entry anywhere in the results whose sides differ, by path."""
    found: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "work" and isinstance(value, dict) and value.get("differences"):
                    found.append(f"{path}: " + "; ".join(value["differences"]))
                else:
                    walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(results, "")
    return found
