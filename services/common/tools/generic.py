"""Tool calls for a model whose chat template has none (SmolLM2, the embedded default), as
llama-server's generic format does them: the tools are described in a system message, and
the answer is one JSON object, either a call or a reply:

    {"tool_call": {"name": "run_tests", "arguments": {"code": "..."}}}
    {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}      (parallel calls)
    {"response": "the answer's text"}

schema() gives the JSON Schema the grammar sampler holds the answer to (only calls when the
choice is `required` or a named function, one function's when named); GenericParser reads
the answer back. Plain Python.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from disagg_mesh.server.common.tools.calls import (
    ArgumentsPiece,
    CallStart,
    Piece,
    TextPiece,
    Tool,
    new_call_id,
)

INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with "
    "`response` reply to the user's request"
)
INSTRUCTION_REQUIRED = "Respond in JSON format with `tool_call` (a request to call tools)"


def system_text(tools: Sequence[Tool], required: bool) -> str:
    """What the system message says: the tools, and how to answer."""
    described = [
        {"name": t.name, "description": t.description, "parameters": t.parameters or {}}
        for t in tools
    ]
    return (
        "You can call any of the following tools to satisfy the user's requests:\n"
        + json.dumps(described, indent=2, ensure_ascii=False)
        + "\n\n"
        + (INSTRUCTION_REQUIRED if required else INSTRUCTION)
    )


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """One call of one of these tools: {"name": ..., "arguments": {...}}, the arguments held
    to that tool's parameters (Hermes templates write their calls so too)."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "arguments": t.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for t in tools
        ]
    }


def schema(tools: Sequence[Tool], required: bool, parallel: bool) -> dict[str, Any]:
    """The answer's JSON Schema: a call of one of these tools (several, if parallel), or,
    unless required, a reply."""
    one_call = call_schema(tools)
    calls: dict[str, Any] = (
        {
            "type": "object",
            "properties": {"tool_calls": {"type": "array", "items": one_call, "minItems": 1}},
            "required": ["tool_calls"],
        }
        if parallel
        else {
            "type": "object",
            "properties": {"tool_call": one_call},
            "required": ["tool_call"],
        }
    )
    if required:
        return calls
    reply = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
    }
    return {"anyOf": [calls, reply]}


# What a reply starts with, as the grammar writes it (spaces optional): its text streams
# from the opening quote on.
REPLY_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')
REPLY_KEY = '{"response":"'
ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class GenericParser:
    """The answer is one JSON object: a reply's text streams as it comes (the JSON string
    decoded); calls are known when the object ends; anything else comes back as text."""

    def __init__(self) -> None:
        self._text = ""  # everything fed
        self._state = "start"  # start, reply (inside the string), after, whole
        self._pending = ""  # a reply's characters not decoded yet (an escape cut short)

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        if self._state == "start":
            found = REPLY_START.match(self._text)
            if found is not None:
                self._state = "reply"
                return self._reply(self._text[found.end() :])
            if not _may_start_reply(self._text):
                self._state = "whole"
            return []
        if self._state == "reply":
            return self._reply(text)
        return []

    def _reply(self, text: str) -> list[Piece]:
        """Decode the reply string's next characters, holding back an escape cut short."""
        chars, self._pending = self._pending + text, ""
        out: list[str] = []
        i = 0
        while i < len(chars):
            c = chars[i]
            if c == '"':
                self._state = "after"
                break
            if c != "\\":
                out.append(c)
                i += 1
                continue
            if i + 1 >= len(chars):
                self._pending = chars[i:]
                break
            kind = chars[i + 1]
            if kind == "u":
                point, used = _unicode_escape(chars, i)
                if used == 0:  # cut short: wait for the rest
                    self._pending = chars[i:]
                    break
                out.append(point)
                i += used
            else:
                out.append(ESCAPES.get(kind, kind))
                i += 2
        decoded = "".join(out)
        return [TextPiece(decoded)] if decoded else []

    def finish(self) -> list[Piece]:
        if self._state in ("reply", "after"):
            return []  # the reply's text went out as it came
        text, self._text = self._text, ""
        try:
            value: Any = json.loads(text)
        except ValueError:
            return [TextPiece(text)] if text else []
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return [TextPiece(value["response"])]
        calls = value.get("tool_calls") if isinstance(value, dict) else None
        if calls is None and isinstance(value, dict) and "tool_call" in value:
            calls = [value["tool_call"]]
        if not isinstance(calls, list) or not all(_is_call(c) for c in calls) or not calls:
            return [TextPiece(text)]
        out: list[Piece] = []
        for index, call in enumerate(calls):
            out.append(CallStart(index, new_call_id(), call["name"]))
            out.append(
                ArgumentsPiece(index, json.dumps(call.get("arguments", {}), ensure_ascii=False))
            )
        return out


def _unicode_escape(chars: str, i: int) -> tuple[str, int]:
    """The character a `\\uXXXX` escape at i stands for (a surrogate pair's two escapes
    together) and the characters it took; (.., 0) when the text is cut short."""
    if i + 6 > len(chars):
        return "", 0
    point = int(chars[i + 2 : i + 6], 16)
    if 0xD800 <= point < 0xDC00:  # a high surrogate: its low half follows
        if i + 12 > len(chars):
            return "", 0
        low = int(chars[i + 8 : i + 12], 16)
        return chr(0x10000 + ((point - 0xD800) << 10) + (low - 0xDC00)), 12
    return chr(point), 6


def _may_start_reply(text: str) -> bool:
    """Whether this text may still grow into a reply's start (spaces apart)."""
    squeezed = "".join(text.split())
    return REPLY_KEY.startswith(squeezed)


def _is_call(call: Any) -> bool:
    return (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments", {}), dict)
    )
