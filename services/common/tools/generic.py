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


class GenericParser:
    """The answer is one JSON object, known when it ends: its calls, or its reply as text;
    anything else comes back as text."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        return []

    def finish(self) -> list[Piece]:
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


def _is_call(call: Any) -> bool:
    return (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments", {}), dict)
    )
