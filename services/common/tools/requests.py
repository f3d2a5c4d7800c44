"""The tools a request offers and how it lets the model use them, read from OpenAI's shape
(`tools`, `tool_choice`, `parallel_tool_calls`), which Ollama's `tools` shares. Every
mistake is an InvalidArgument naming the field (`tools[1].function.name: ...`). Plain Python:
both HTTP doors and the gRPC servicer call it with their decoded JSON.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.tools.calls import Tool

# OpenAI's rule for a function's name.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    # "auto" (the model decides), "none" (no call), "required" (at least one call);
    # `function` names the one function the model must call.
    choice: str = "auto"
    function: str | None = None
    # Several calls at once allowed (OpenAI's parallel_tool_calls); None: not said, as the
    # format does by default (formats.py).
    parallel: bool | None = None

    @property
    def forced(self) -> bool:
        """Whether the answer must be a call (required, or a named function)."""
        return self.choice == "required" or self.function is not None

    def offered(self) -> tuple[Tool, ...]:
        """The tools the model may call: the named one alone, or all."""
        if self.function is not None:
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    def openai_shape(self) -> list[dict[str, Any]]:
        """The offered tools as OpenAI's `tools` (what chat templates and Ollama take)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in self.offered()
        ]


def read_tools(
    tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None, field: str = "tools"
) -> ToolRequest | None:
    """The request's tools (None when it offers none and names no choice)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidArgument(
                "tool_choice", f"{tool_choice!r} needs `{field}`, and there are none"
            )
        return None
    if not isinstance(tools, list):
        raise InvalidArgument(field, f"must be a list of functions, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(field, f"at most {MAX_TOOLS} tools, got {len(tools)}")
    read = tuple(_tool(entry, f"{field}[{i}]") for i, entry in enumerate(tools))
    names = [t.name for t in read]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidArgument(f"{field}[{i}].function.name", f"{name!r} is named twice")
    choice, function = _choice(tool_choice, set(names))
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidArgument(
            "parallel_tool_calls", f"must be true or false, got {parallel_tool_calls!r}"
        )
    return ToolRequest(read, choice, function, parallel_tool_calls)


def _tool(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise InvalidArgument(where, f"must be an object, got {type(entry).__name__}")
    if entry.get("type", "function") != "function":
        raise InvalidArgument(
            f"{where}.type", f'only "function" is supported, got {entry["type"]!r}'
        )
    function = entry.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f"{where}.function", "required, an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidArgument(
            f"{where}.function.name", f"1 to 64 letters, digits, _ or -, got {name!r}"
        )
    description = function.get("description", "")
    if not isinstance(description, str):
        raise InvalidArgument(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}.function.parameters", "must be a JSON Schema object")
    if parameters.get("type", "object") != "object":
        raise InvalidArgument(
            f"{where}.function.parameters.type",
            f"a function's parameters are an object, got {parameters.get('type')!r}",
        )
    return Tool(name, description, parameters)


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InvalidArgument(
                "tool_choice", f"one of {', '.join(CHOICES)} or a function, got {choice!r}"
            )
        return choice, None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            known = ", ".join(sorted(names))
            raise InvalidArgument(
                "tool_choice.function.name", f"{name!r} is not one of the tools ({known})"
            )
        return "required", str(name)
    raise InvalidArgument(
        "tool_choice",
        '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
    )
