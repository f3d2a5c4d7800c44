"""How a model takes tools and makes calls, chosen from its chat template (never its name),
as llama.cpp's common_chat does:

- `qwen3_coder`: the template writes `<function=NAME><parameter=P>` (Qwen3-Coder)
- `hermes`:      the template writes `<tool_call>` (Qwen2.5/Qwen3, Hermes 2/3, ...)
- `harmony`:     gpt-oss (its harmony tokens)
- `generic`:     any other template (SmolLM2, gemma3): the tools in a system message, the
                 answer one JSON object held to a grammar (generic.py)

A node renders a request's messages for its format (turns(), template_tools()), holds the
answer to a grammar where the format needs one (response_format()) and parses the calls
from the text as it streams (parser()). Plain Python.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any

from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.tools import generic
from disagg_mesh.server.common.tools.calls import ToolCall, ToolCallParser
from disagg_mesh.server.common.tools.hermes import CLOSE as HERMES_CLOSE
from disagg_mesh.server.common.tools.hermes import OPEN as HERMES_OPEN
from disagg_mesh.server.common.tools.hermes import HermesParser
from disagg_mesh.server.common.tools.qwen3_coder import Qwen3CoderParser
from disagg_mesh.server.common.tools.requests import ToolRequest
from disagg_mesh.server.common.types import ChatTurn, ResponseFormat


class ToolFormat(enum.Enum):
    GENERIC = "generic"
    HERMES = "hermes"
    QWEN3_CODER = "qwen3_coder"
    HARMONY = "harmony"


def tool_format(template: str, harmony: bool) -> ToolFormat:
    if harmony:
        return ToolFormat.HARMONY
    if "<function=" in template and "<parameter=" in template:
        return ToolFormat.QWEN3_CODER
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    return ToolFormat.GENERIC


def active(tools: ToolRequest | None) -> ToolRequest | None:
    """The tools the model is told of and may call (None: none, or tool_choice none)."""
    return None if tools is None or tools.choice == "none" else tools


def turns(
    messages: Sequence[ChatTurn], fmt: ToolFormat, tools: ToolRequest | None
) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: calls and tool results in OpenAI's
    shape for a template with tools, or written out as JSON for the generic format."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # the calls so far: id -> function
    for i, m in enumerate(messages):
        names.update((c.id, c.name) for c in m.tool_calls)
        if m.role == "tool" and fmt is ToolFormat.GENERIC:
            response = {"tool_call_id": m.tool_call_id, "content": m.content}
            out.append({"role": "user", "content": json.dumps({"tool_response": response})})
        elif m.tool_calls and fmt is ToolFormat.GENERIC:
            # As the generic format's answers are written: one call alone, several a list.
            calls = [{"name": c.name, "arguments": _arguments(c, i)} for c in m.tool_calls]
            written = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
            out.append({"role": "assistant", "content": json.dumps(written)})
        else:
            turn: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                turn["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _arguments(c, i)},
                    }
                    for c in m.tool_calls
                ]
            if m.role == "tool":  # the name too, for templates that write it (harmony)
                turn["tool_call_id"] = m.tool_call_id
                turn["name"] = names.get(m.tool_call_id) or next(reversed(names.values()), "")
            out.append(turn)
    offered = active(tools)
    if offered is not None and fmt is ToolFormat.GENERIC:
        text = generic.system_text(offered.offered(), offered.forced)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def template_tools(fmt: ToolFormat, tools: ToolRequest | None) -> list[dict[str, Any]] | None:
    """The `tools` a template with tools renders (None: none, or the generic format)."""
    offered = active(tools)
    if offered is None or fmt is ToolFormat.GENERIC:
        return None
    return offered.openai_shape()


def response_format(fmt: ToolFormat, tools: ToolRequest | None) -> ResponseFormat | None:
    """The grammar the answer is held to (None: free)."""
    offered = active(tools)
    if offered is None:
        return None
    if fmt is ToolFormat.HARMONY and offered.forced:
        return ResponseFormat(calls=_calls(offered), calls_format="harmony")
    if fmt is ToolFormat.QWEN3_CODER and offered.forced:
        return ResponseFormat(calls=_calls(offered), calls_format="qwen3_coder")
    if fmt is ToolFormat.HERMES and offered.forced:
        # As the template shows the model: <tool_call>\n{"name", "arguments"}\n</tool_call>.
        return ResponseFormat(
            json.dumps(generic.call_schema(offered.offered()), sort_keys=True),
            before=f"{HERMES_OPEN}\n",
            after=f"\n{HERMES_CLOSE}",
            repeated=offered.parallel is True,
        )
    if fmt is not ToolFormat.GENERIC:
        return None
    # One call unless the request asks for several, as llama-server's generic format.
    schema = generic.schema(offered.offered(), offered.forced, offered.parallel is True)
    return ResponseFormat(json.dumps(schema, sort_keys=True))


def parser(fmt: ToolFormat, tools: ToolRequest | None) -> ToolCallParser | None:
    """Reads the calls out of the answer's text (None: the text is the answer)."""
    offered = active(tools)
    if offered is None:
        return None
    if fmt is ToolFormat.GENERIC:
        return generic.GenericParser()
    if fmt is ToolFormat.HERMES:
        return HermesParser()
    if fmt is ToolFormat.QWEN3_CODER:
        return Qwen3CoderParser({t.name: t for t in offered.tools})
    return None


def _calls(tools: ToolRequest) -> tuple[tuple[str, str], ...]:
    return tuple((t.name, json.dumps(t.parameters or {"type": "object"})) for t in tools.offered())


def _arguments(call: ToolCall, i: int) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError as exc:
        raise InvalidArgument(
            f"messages[{i}].tool_calls", f"arguments of {call.name!r} are not JSON: {exc}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidArgument(
            f"messages[{i}].tool_calls", f"arguments of {call.name!r} must be a JSON object"
        )
    return value
