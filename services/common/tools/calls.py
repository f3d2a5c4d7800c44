"""Tool calls in plain Python: the tools a request offers, the calls a model makes, and the
pieces a streamed answer is cut into (as OpenAI streams them: a call's index, id and name
first, then its arguments' JSON in pieces, text apart).

A parser (hermes.py, qwen3_coder.py) is fed the model's text as it comes and gives back
these pieces; fed the same text cut anywhere, the pieces put together are the same.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and JSON Schema parameters."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def property_types(self, name: str) -> tuple[str, ...]:
        """The JSON Schema types of one parameter but null (a union's in its order;
        ("string",) when the schema does not say)."""
        schema = self.parameters.get("properties", {}).get(name, {})
        kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
        kinds = [str(k) for k in kind if k != "null"] if isinstance(kind, list) else [str(kind)]
        return tuple(kinds) or ("string",)


@dataclass(frozen=True)
class TextPiece:
    """Answer text outside any call."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call begins: its place among the answer's calls, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """The next piece of a call's arguments, a JSON object's text."""

    index: int
    text: str


Piece = TextPiece | CallStart | ArgumentsPiece


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # a JSON object's text

    def parsed_arguments(self) -> dict[str, Any]:
        value = json.loads(self.arguments or "{}")
        return value if isinstance(value, dict) else {}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def assemble(pieces: list[Piece]) -> tuple[str, list[ToolCall]]:
    """The answer's text and its calls, from its pieces (what a client reassembles)."""
    text: list[str] = []
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        if isinstance(piece, TextPiece):
            text.append(piece.text)
        elif isinstance(piece, CallStart):
            calls[piece.index] = ToolCall(piece.id, piece.name)
        else:
            calls[piece.index].arguments += piece.text
    return "".join(text), [calls[i] for i in sorted(calls)]


class ToolCallParser(Protocol):
    """Fed the model's text as it comes; gives back the pieces it can tell so far."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]:
        """The end of the answer: whatever was held back, as text or calls."""
        ...


class HeldText:
    """Text that may be the start of a marker is held back until the next text tells."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self._markers = markers
        self.buffer = ""

    def safe_prefix(self) -> str:
        """Take the part of the buffer that cannot begin any marker."""
        keep = 0
        for marker in self._markers:
            for n in range(min(len(marker) - 1, len(self.buffer)), 0, -1):
                if self.buffer.endswith(marker[:n]):
                    keep = max(keep, n)
                    break
        out, self.buffer = (
            self.buffer[: len(self.buffer) - keep],
            self.buffer[len(self.buffer) - keep :],
        )
        return out
