"""Qwen3-Coder's tool calls, parsed as they stream:

    <tool_call>
    <function=run_tests>
    <parameter=code>
    def add(a, b): return a + b
    </parameter>
    </function>
    </tool_call>

A call starts (its name sent) once `<function=NAME>` is complete; each parameter goes out
as a piece of the arguments' JSON when its value ends; `</function>` closes the object.
Values are text; each is converted by its type in the function's schema (integer, number,
boolean, object, array; `null`), and kept as text where it does not convert or the schema
does not name it. One newline after `<parameter=P>` and before its end is the format's own,
not the value's. A `<function=` without `<tool_call>` around it is a call too (the model
sometimes leaves the wrapper out). Text around the calls is the answer's text; a call whose
name never closes comes back as text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from disagg_mesh.server.common.structured.gbnf import literal, renamed, text_without
from disagg_mesh.server.common.tools.calls import (
    ArgumentsPiece,
    CallStart,
    HeldText,
    Piece,
    TextPiece,
    Tool,
    new_call_id,
)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
# A name longer than this, or one with a newline, is not a name: the text goes out as text.
MAX_NAME = 256


def convert(value: str, kinds: Sequence[str]) -> Any:
    """A parameter's text as its schema's types say, or the text itself. A union's types
    are tried in turn, string last: as llama.cpp's Qwen3-Coder parser reads a union with
    string, another type's JSON is that type and anything else is text."""
    if value.strip().lower() == "null":
        return None
    for kind in sorted(kinds, key=lambda k: k == "string"):
        typed = _typed(value.strip(), kind)
        if typed is not None:
            return typed
    return value


def _typed(value: str, kind: str) -> Any:
    """The value as this JSON Schema type, or None where it is not one."""
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            if not math.isfinite(number):
                return None
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind in ("object", "array"):
            parsed = json.loads(value)
            return parsed if isinstance(parsed, dict if kind == "object" else list) else None
    except ValueError:
        pass
    return None


class Qwen3CoderParser:
    def __init__(self, tools: Mapping[str, Tool] | None = None) -> None:
        self._tools = dict(tools or {})
        self._state = "text"
        self._held = HeldText((CALL_OPEN, FUNCTION_OPEN))
        self._buffer = ""  # inside a call: what is not parsed yet
        self._raw = ""  # a call's text before its name closed (text again if it never does)
        self._index = -1
        self._tool: Tool | None = None
        self._params = 0
        self._param = ""
        # Whitespace right after a call is the format's, not text.
        self._after_call = False

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buffer += text
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state == "text":
            self._held.buffer += self._buffer
            self._buffer = ""
            if self._held.buffer:
                out.append(TextPiece(self._held.buffer))
                self._held.buffer = ""
        elif self._state in ("call", "name"):  # no name yet: it was text
            out.append(TextPiece(self._raw + self._buffer))
        elif self._state in ("function", "parameter_name", "value"):
            if self._state == "value":  # cut off inside a value: keep what came
                self._end_parameter(self._buffer, out)
            out.append(ArgumentsPiece(self._index, "}" if self._params else "{}"))
        self._state, self._buffer, self._raw = "text", "", ""
        return out

    # -- the states ------------------------------------------------------------------

    def _step(self, out: list[Piece]) -> bool:
        """Parse what the buffer allows; False when more text is needed."""
        state = self._state
        if state == "text":
            return self._text(out)
        if state == "call":  # after <tool_call>: a function, or the call's end
            return self._between(
                out, {FUNCTION_OPEN: "name", CALL_CLOSE: "text"}, on_other="text", raw=True
            )
        if state == "name":
            return self._name(out)
        if state == "function":  # between parameters
            return self._between(
                out, {PARAMETER_OPEN: "parameter_name", FUNCTION_CLOSE: "after"}, on_other="skip"
            )
        if state == "parameter_name":
            end = self._buffer.find(">")
            if end < 0:
                return False
            self._param = self._buffer[:end].strip()
            self._buffer = self._buffer[end + 1 :]
            self._state = "value"
            return True
        if state == "value":
            return self._value(out)
        # after: </function> seen; the call's end, another call, or text
        return self._between(
            out,
            {CALL_CLOSE: "text", FUNCTION_OPEN: "name", CALL_OPEN: "call"},
            on_other="text",
        )

    def _text(self, out: list[Piece]) -> bool:
        self._held.buffer += self._buffer
        self._buffer = ""
        if self._after_call:
            self._held.buffer = self._held.buffer.lstrip()
            if not self._held.buffer:
                return False
            self._after_call = False
        text = self._held.buffer
        starts = [(text.find(m), m) for m in (CALL_OPEN, FUNCTION_OPEN) if m in text]
        if not starts:
            safe = self._held.safe_prefix()
            if safe:
                out.append(TextPiece(safe))
            return False
        at, marker = min(starts)
        if at:
            out.append(TextPiece(text[:at]))
        self._held.buffer = ""
        self._buffer = text[at + len(marker) :]
        self._raw = marker
        self._state = "call" if marker == CALL_OPEN else "name"
        return True

    def _between(
        self, out: list[Piece], markers: dict[str, str], on_other: str, raw: bool = False
    ) -> bool:
        """Skip whitespace, then one of the markers (to its state), or wait for more."""
        stripped = self._buffer.lstrip()
        if raw:
            self._raw += self._buffer[: len(self._buffer) - len(stripped)]
        self._buffer = stripped
        if not stripped:
            return False
        for marker, state in markers.items():
            if stripped.startswith(marker):
                self._buffer = stripped[len(marker) :]
                if raw:  # still before a name: keep the text, in case it is text
                    self._raw += marker
                elif state in ("name", "call"):  # a new call after the last
                    self._raw = marker
                if state == "after":
                    out.append(ArgumentsPiece(self._index, "}" if self._params else "{}"))
                if state == "text" and not raw:
                    self._after_call = True
                self._state = state
                return True
        if any(marker.startswith(stripped) for marker in markers):
            return False  # a marker's beginning: wait for the rest
        if on_other == "skip":  # stray text between parameters: dropped up to the next tag
            nxt = stripped.find("<", 1)
            self._buffer = stripped[nxt:] if nxt > 0 else ""
            return bool(self._buffer)
        if raw:  # <tool_call> then something else: it was text
            out.append(TextPiece(self._raw))
            self._raw = ""
        self._state = on_other
        return True

    def _name(self, out: list[Piece]) -> bool:
        end = self._buffer.find(">")
        name = self._buffer[: end if end >= 0 else len(self._buffer)]
        if "\n" in name or "<" in name or len(name) > MAX_NAME:  # not a name: text
            out.append(TextPiece(self._raw + self._buffer))
            self._raw, self._buffer, self._state = "", "", "text"
            return False
        if end < 0:
            return False
        self._index += 1
        self._tool = self._tools.get(name.strip())
        self._params = 0
        out.append(CallStart(self._index, new_call_id(), name.strip()))
        self._raw, self._buffer = "", self._buffer[end + 1 :]
        self._state = "function"
        return True

    def _value(self, out: list[Piece]) -> bool:
        ends = [
            (self._buffer.find(m), m)
            for m in (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)
            if m in self._buffer
        ]
        if not ends:
            return False
        at, marker = min(ends)
        self._end_parameter(self._buffer[:at], out)
        # </parameter> is consumed; the others open what comes next.
        self._buffer = (
            self._buffer[at + len(marker) :] if marker == PARAMETER_CLOSE else (self._buffer[at:])
        )
        self._state = "function"
        return True

    def _end_parameter(self, value: str, out: list[Piece]) -> None:
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        tool = self._tool
        converted: Any = value  # a parameter the schema does not name stays text
        if tool is not None and self._param in tool.parameters.get("properties", {}):
            converted = convert(value, tool.property_types(self._param))
        lead = "{" if self._params == 0 else ", "
        out.append(
            ArgumentsPiece(
                self._index,
                f"{lead}{json.dumps(self._param)}: {json.dumps(converted, ensure_ascii=False)}",
            )
        )
        self._params += 1


def call_rules(tools: Sequence[Tool], json_rules: Callable[[dict[str, Any]], str]) -> str:
    """GBNF, start rule `root`: one call of one of these tools written as Qwen3-Coder's
    template shows its calls (`<tool_call>\\n<function=NAME>\\n`, each parameter
    `<parameter=P>\\nVALUE\\n</parameter>\\n` in the schema's order, the required ones
    always, then `</function>\\n</tool_call>`). A string's value is text that never holds
    `\\n</parameter>` (an enum's: one of its values); any other type's is JSON its schema
    allows (json_rules: a schema's rules with start rule `root`, renamed apart here)."""
    rules: list[str] = []
    calls: list[str] = []
    for i, tool in enumerate(tools):
        properties = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or ())
        parts = [literal(f"{CALL_OPEN}\n{FUNCTION_OPEN}{tool.name}>\n")]
        for j, (name, spec) in enumerate(properties.items()):
            value = f"call{i}-p{j}"
            rules.append(_value_rule(value, spec if isinstance(spec, dict) else {}, json_rules))
            opened = literal(f"{PARAMETER_OPEN}{name}>\n")
            parameter = f"( {opened} {value} {literal(chr(10) + PARAMETER_CLOSE + chr(10))} )"
            parts.append(parameter if name in required else f"{parameter}?")
        parts.append(literal(f"{FUNCTION_CLOSE}\n{CALL_CLOSE}"))
        rules.append(f"call{i} ::= {' '.join(parts)}")
        calls.append(f"call{i}")
    return "\n".join([*rules, f"root ::= {' | '.join(calls)}"])


def _value_rule(
    name: str, spec: dict[str, Any], json_rules: Callable[[dict[str, Any]], str]
) -> str:
    kind = spec.get("type", "string")
    if kind == "string" and isinstance(spec.get("enum"), list):
        return f"{name} ::= {' | '.join(literal(str(v)) for v in spec['enum'])}"
    if kind == "string":
        return f"{name} ::= {text_without(chr(10) + PARAMETER_CLOSE)}"
    return f"{renamed(json_rules(spec), name + '-')}\n{name} ::= {name}-root"
