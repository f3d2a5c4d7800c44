"""Hermes-style tool calls (Qwen2.5, Qwen3 and others), parsed as they stream:

    <tool_call>
    {"name": "run_tests", "arguments": {"code": "print(1)"}}
    </tool_call>

A call is known once its `</tool_call>` comes (its name sits inside the JSON, in any order),
so its start and its arguments go out together then; text around calls goes out as it
comes. A call whose JSON does not parse, or names no function, comes back as text; so does
one the answer ends inside of, unless what came is a whole call already.
"""

from __future__ import annotations

import json
from typing import Any

from disagg_mesh.server.common.tools.calls import (
    ArgumentsPiece,
    CallStart,
    HeldText,
    Piece,
    TextPiece,
    new_call_id,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a call's JSON, or None if it is not one."""
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class HermesParser:
    def __init__(self) -> None:
        self._held = HeldText((OPEN,))
        self._in_call = False
        self._body = ""
        self._index = -1
        # Whitespace right after a call is the format's, not text.
        self._after_call = False

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text:
            if self._in_call:
                self._body += text
                text = ""
                end = self._body.find(CLOSE)
                if end < 0:
                    break
                text = self._body[end + len(CLOSE) :]
                self._end_call(self._body[:end], out, closed=True)
            else:
                self._held.buffer += text
                text = ""
                if self._after_call:
                    self._held.buffer = self._held.buffer.lstrip()
                    if not self._held.buffer:
                        break
                    self._after_call = False
                at = self._held.buffer.find(OPEN)
                if at < 0:
                    safe = self._held.safe_prefix()
                    if safe:
                        out.append(TextPiece(safe))
                    break
                if at:
                    out.append(TextPiece(self._held.buffer[:at]))
                text = self._held.buffer[at + len(OPEN) :]
                self._held.buffer = ""
                self._in_call, self._body = True, ""
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._in_call:
            self._end_call(self._body, out, closed=False)
        elif self._held.buffer:
            out.append(TextPiece(self._held.buffer))
            self._held.buffer = ""
        return out

    def _end_call(self, body: str, out: list[Piece], closed: bool) -> None:
        self._in_call = False
        call = parse_call(body)
        if call is None:
            out.append(TextPiece(OPEN + body + (CLOSE if closed else "")))
            return
        self._index += 1
        self._after_call = True
        out.append(CallStart(self._index, new_call_id(), call[0]))
        out.append(ArgumentsPiece(self._index, call[1]))
