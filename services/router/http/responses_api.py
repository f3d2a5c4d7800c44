"""OpenAI's Responses API on the router: POST /v1/responses, without state, as Ollama serves
it (since 0.13.3: no `previous_response_id`, nothing stored) and vLLM too.

The request's `instructions` and `input` (a string, or items: messages, function calls and
their outputs) become chat turns; the answer is its output items: the model's reasoning
(a `reasoning` item with `reasoning_text` content, as OpenAI's spec has it for a model's
own reasoning, and as vLLM and gpt-oss's reference server send it), the message, and the
function calls. `stream: true` answers the API's server-sent events (`response.created`
... `response.completed`), each with its `sequence_number`. Errors are OpenAI's error
object, as on /v1/chat/completions. Generation goes through `Router.generate`, as gRPC
does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from disagg_mesh.server.common.errors import InvalidArgument, MeshError
from disagg_mesh.server.common.runtime.observability.logging import current_request_id
from disagg_mesh.server.common.tools.calls import ArgumentsPiece, CallStart, Piece
from disagg_mesh.server.common.tools.calls import ToolCall as Call
from disagg_mesh.server.common.tools.requests import ToolRequest, read_tools
from disagg_mesh.server.common.types import (
    ChatTurn,
    FinishReason,
    Prompt,
    ResponseFormat,
    Sampling,
    TextChunk,
)
from disagg_mesh.server.router.http.common import (
    Fields,
    checked_sampling,
    dry_run,
    first_event,
    json_body,
    mesh_fields,
    reasoning_effort,
    renamed,
    sampling,
    scoped,
)
from disagg_mesh.server.router.http.openai_api import (
    ROLES,
    error_body,
    output_format,
    status_of,
    text_parts,
)
from disagg_mesh.server.router.routing import Router, RouteSummary

# The mesh's sampling fields this API names otherwise.
FIELD_NAMES = {"max_tokens": "max_output_tokens"}
api = scoped("openai", error_body, status_of, lambda name: FIELD_NAMES.get(name, name))
SCHEMA_FIELD = "text.format.schema"
# A message's and a reasoning item's text events, and what they carry beside the text.
TEXT_EVENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "message": ("response.output_text", {"logprobs": []}),
    "reasoning": ("response.reasoning_text", {}),
}
# An input message's (or a call output's) parts.
TEXT_PARTS = ("input_text", "output_text")
STATELESS = "this mesh keeps no responses (as Ollama): send the whole conversation in `input`"


class ResponsesApi:
    def __init__(self, router: Router) -> None:
        self.router = router

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", api(self.create))]

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = Fields(await json_body(request))
        model = body.string("model", required=True) or ""
        _refuse_unserved(body)
        stream = body.boolean("stream", False)
        max_tokens = body.integer("max_output_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise InvalidArgument("max_output_tokens", f"must be at least 1, got {max_tokens}")
        temperature = body.number("temperature")
        if temperature is not None and not 0 <= temperature <= 2:
            raise InvalidArgument("temperature", f"must be in [0, 2], got {temperature}")
        sampling_ = sampling(
            max_tokens=max_tokens,
            max_tokens_limit=self.router.max_tokens_limit,
            temperature=temperature,
            top_p=body.number("top_p"),
            seed=None,
            stop=(),
            max_tokens_field="max_output_tokens",
            stream=stream,
            response_format=_text_format(body.mapping("text"), self.router),
            tools=_tools(body),
        )
        sampling_ = await checked_sampling(
            self.router, sampling_, SCHEMA_FIELD, tools_field="tools[{i}].parameters"
        )
        effort = reasoning_effort(body.mapping("reasoning").body.get("effort"), "reasoning.effort")
        if effort:
            self.router.check_reasons(model, "reasoning.effort")
        truncation = body.string("truncation") or "disabled"
        if truncation not in ("disabled", "auto"):
            raise InvalidArgument("truncation", f'must be "disabled" or "auto", got {truncation!r}')
        prompt = Prompt(
            messages=_turns(body),
            reasoning_effort=effort,
            # "auto": the oldest items dropped until the conversation fits, as Ollama's chat.
            truncate_history=truncation == "auto",
        )
        checked = dry_run(request, self.router, model, prompt, sampling_)
        if checked is not None:
            return checked
        answer = _Answer(_echo(body, model, sampling_, truncation))
        events = self.router.generate(model, prompt, sampling_, None)
        try:
            async with aclosing(events):
                event = await first_event(events)  # errors before any text: their status
                if not stream:
                    while not isinstance(event, RouteSummary):
                        await answer.take(event)
                        event = await anext(events)
                    return web.json_response(await answer.finish(event))
                return await _streamed(request, answer, event, events)
        except MeshError as exc:  # the prompt is the input
            if getattr(exc, "field", None) == "prompt":
                raise renamed(exc, "input") from None
            raise


async def _streamed(
    request: web.Request, answer: _Answer, event: TextChunk | RouteSummary, events: Any
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    sequence = 0

    async def send(kind: str, fields: dict[str, Any]) -> None:
        nonlocal sequence
        data = json.dumps({"type": kind, "sequence_number": sequence, **fields}, ensure_ascii=False)
        sequence += 1
        await response.write(f"event: {kind}\ndata: {data}\n\n".encode())

    answer.send = send
    await send("response.created", {"response": answer.response("in_progress")})
    await send("response.in_progress", {"response": answer.response("in_progress")})
    try:
        while not isinstance(event, RouteSummary):
            await answer.take(event)
            event = await anext(events)
        done = await answer.finish(event)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        await send(kind, {"response": done})
    except MeshError as exc:  # after the response began: it failed, with the error
        error = error_body(exc, 500)["error"]
        failed = answer.response("failed")
        failed["error"] = {"code": error["code"], "message": error["message"]}
        await send("response.failed", {"response": failed})
    await response.write_eof()
    return response


class _Answer:
    """The response's output items, built from the generation's events; each step sent as
    the API's stream events when `send` is set (stream: true), else nothing is sent until
    the whole response."""

    def __init__(self, echo: dict[str, Any]) -> None:
        self.echo = echo
        self.ident = f"resp_{current_request_id() or ''}"
        self.created = int(time.time())
        self.send: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None
        self.output: list[dict[str, Any]] = []  # the items done
        self.open: dict[str, Any] | None = None  # the item being written
        self.calls = 0
        self.reasoning_tokens = 0

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.echo["model"],
            "output": list(self.output),
            "usage": usage,
            **self.echo,
        }

    async def _emit(self, kind: str, **fields: Any) -> None:
        if self.send is not None:
            await self.send(kind, fields)

    async def take(self, chunk: TextChunk) -> None:
        if chunk.reasoning:
            if not chunk.text:
                self.reasoning_tokens += len(chunk.token_ids)
            await self._write("reasoning", chunk.reasoning)
        if chunk.text:
            await self._write("message", chunk.text)
        for piece in chunk.tool_calls:
            await self._call(piece)

    async def _begin(self, item: dict[str, Any], part: dict[str, Any] | None) -> None:
        await self._close()
        self.open = item
        index = len(self.output)
        await self._emit("response.output_item.added", output_index=index, item=dict(item))
        if part is not None:
            await self._emit(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            )
            item["content"].append(part)

    async def _write(self, kind: str, text: str) -> None:
        if self.open is None or self.open["type"] != kind:
            rid = current_request_id() or ""
            if kind == "message":
                item: dict[str, Any] = {
                    "id": f"msg_{rid}_{len(self.output)}",
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            else:
                item = {
                    "id": f"rs_{rid}_{len(self.output)}",
                    "type": "reasoning",
                    "summary": [],
                    "content": [],
                }
                part = {"type": "reasoning_text", "text": ""}
            await self._begin(item, part)
        assert self.open is not None
        self.open["content"][0]["text"] += text
        events, extra = TEXT_EVENTS[kind]
        await self._emit(
            f"{events}.delta",
            item_id=self.open["id"],
            output_index=len(self.output),
            content_index=0,
            delta=text,
            **extra,
        )

    async def _call(self, piece: Piece) -> None:
        if isinstance(piece, CallStart):
            item = {
                "id": f"fc_{current_request_id() or ''}_{piece.index}",
                "type": "function_call",
                "status": "in_progress",
                "call_id": piece.id,
                "name": piece.name,
                "arguments": "",
            }
            await self._begin(item, None)
            self.calls += 1
        elif isinstance(piece, ArgumentsPiece) and self.open is not None:
            self.open["arguments"] += piece.text
            await self._emit(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=len(self.output),
                delta=piece.text,
            )

    async def _close(self, status: str = "completed") -> None:
        """The open item done (`status`: "incomplete" for one cut by max_output_tokens):
        its closing events, then it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.output)
        kind = item["type"]
        if kind == "function_call":
            await self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:
            part = item["content"][0]
            events, extra = TEXT_EVENTS[kind]
            await self._emit(
                f"{events}.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                **extra,
            )
            await self._emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        item["status"] = status
        await self._emit("response.output_item.done", output_index=index, item=item)
        self.output.append(item)

    async def finish(self, summary: RouteSummary) -> dict[str, Any]:
        """The whole response: its last item closed (incomplete when max_output_tokens cut
        it; an answer that ended with no text and no call is an empty message, as
        OpenAI's), its status and usage."""
        cut = summary.finish_reason is FinishReason.LENGTH
        if not cut and not self.calls and not any(i["type"] == "message" for i in self.output):
            if self.open is None or self.open["type"] != "message":
                await self._write("message", "")
        await self._close("incomplete" if cut else "completed")
        usage = {
            "input_tokens": summary.prompt_tokens,
            "input_tokens_details": {"cached_tokens": summary.cached_prompt_tokens},
            "output_tokens": summary.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": summary.prompt_tokens + summary.completion_tokens,
        }
        done = self.response("incomplete" if cut else "completed", usage)
        if cut:
            done["incomplete_details"] = {"reason": "max_output_tokens"}
        done["disagg"] = mesh_fields(summary)
        return done


def _refuse_unserved(body: Fields) -> None:
    """Fields this mesh does not serve: refused naming them, never silently ignored."""
    body.refuse("previous_response_id", STATELESS)
    body.refuse("conversation", STATELESS)
    body.refuse("background", "responses are answered in the request that asks for them")
    body.refuse("prompt", "no prompt templates are stored here: send `input`")
    body.refuse("max_tool_calls", "the model's own calls are all returned")
    body.refuse("top_logprobs", "log probabilities: use /v1/chat/completions", 0)
    # What else to return: reasoning's encrypted content, which this mesh has none of.
    for i, asked in enumerate(body.strings("include")):
        if asked != "reasoning.encrypted_content":
            raise InvalidArgument(f"include[{i}]", f"{asked!r} is not supported")
    verbosity = body.mapping("text").string("verbosity")
    if verbosity not in (None, "medium"):
        raise InvalidArgument("text.verbosity", "only the model's own length (medium) is served")


def _text_format(text: Fields, router: Router) -> ResponseFormat | None:
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "name", "schema", "strict"} (flat, where chat nests them under json_schema)."""
    spec = text.mapping("format")
    kind = spec.string("type") or "text"
    return output_format(kind, "text.format.type", "", spec, router.schema_limits)


def _tools(body: Fields) -> ToolRequest | None:
    """The API's flat functions ({"type": "function", "name", "parameters", ...}) and
    tool_choice ({"type": "function", "name"}), read as chat's, errors naming the flat
    fields."""
    tools = body.body.get("tools")
    choice = body.body.get("tool_choice")
    nested_tools = tools
    if isinstance(tools, list):
        nested_tools = []
        for i, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("type", "function") != "function":
                raise InvalidArgument(
                    f"tools[{i}].type",
                    f'only "function" tools are served here, got {tool["type"]!r}',
                )
            nested_tools.append(
                {"type": "function", "function": tool} if isinstance(tool, dict) else tool
            )
    nested_choice = choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidArgument(
                "tool_choice",
                '"auto", "none", "required" or {"type": "function", "name": ...}',
            )
        nested_choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return read_tools(nested_tools, nested_choice, body.body.get("parallel_tool_calls"))
    except InvalidArgument as exc:  # chat's nested names, as this API has them
        raise renamed(exc, exc.field.replace(".function", "")) from None


def _turns(body: Fields) -> tuple[ChatTurn, ...]:
    """`instructions` (a system turn first) and `input`: a string (the user's turn) or a
    list of items."""
    turns: list[ChatTurn] = []
    instructions = body.string("instructions")
    if instructions:
        turns.append(ChatTurn("system", instructions))
    given = body.body.get("input")
    if isinstance(given, str):
        turns.append(ChatTurn("user", given))
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            _item(turns, item, f"input[{i}]")
    else:
        raise InvalidArgument("input", "must be a string or a non-empty list of items")
    if not any(t.role != "system" for t in turns):
        raise InvalidArgument("input", "has no message beside the instructions")
    return tuple(turns)


def _item(turns: list[ChatTurn], item: Any, where: str) -> None:
    """One input item as chat turns: a message, an earlier function call (joined to the
    assistant turn before it) or a call's output; an earlier reasoning item is left out
    (the chat template renders the answers, not their reasoning)."""
    if not isinstance(item, dict):
        raise InvalidArgument(where, "must be an object")
    fields = Fields(item, f"{where}.")
    kind = fields.string("type") or ("message" if "role" in item else None)
    if kind == "message":
        role = fields.string("role", required=True) or ""
        if role not in ROLES or role == "tool":
            raise InvalidArgument(
                f"{where}.role",
                f"must be one of user, system, developer, assistant, got {role!r}",
            )
        turns.append(
            ChatTurn(ROLES[role], text_parts(item.get("content"), f"{where}.content", TEXT_PARTS))
        )
    elif kind == "function_call":
        call = Call(
            fields.string("call_id", required=True) or "",
            fields.string("name", required=True) or "",
            fields.string("arguments") or "{}",
        )
        last = turns[-1] if turns else None
        if last is not None and last.role == "assistant":
            turns[-1] = replace(last, tool_calls=(*last.tool_calls, call))
        else:
            turns.append(ChatTurn("assistant", "", (call,)))
    elif kind == "function_call_output":
        call_id = fields.string("call_id", required=True) or ""
        output = text_parts(item.get("output"), f"{where}.output", TEXT_PARTS)
        turns.append(ChatTurn("tool", output, tool_call_id=call_id))
    elif kind == "reasoning":
        return
    elif kind == "item_reference":
        raise InvalidArgument(f"{where}.type", f"item_reference is not supported: {STATELESS}")
    elif kind is None:
        raise InvalidArgument(f"{where}.type", "is required (or a message's role)")
    else:
        raise InvalidArgument(
            f"{where}.type",
            f"must be message, function_call, function_call_output or reasoning, got {kind!r}",
        )


def _echo(body: Fields, model: str, sampling_: Sampling, truncation: str) -> dict[str, Any]:
    """The request's settings, as the response echoes them."""
    tools = body.body.get("tools") or []
    reasoning = body.mapping("reasoning").body
    text_format = body.mapping("text").body.get("format") or {"type": "text"}
    metadata = body.mapping("metadata").body
    return {
        "model": model,
        "instructions": body.string("instructions"),
        "max_output_tokens": body.integer("max_output_tokens"),
        "parallel_tool_calls": body.boolean("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": False,
        "temperature": sampling_.temperature,
        "text": {"format": text_format},
        "tool_choice": body.body.get("tool_choice") or "auto",
        "tools": tools,
        "top_p": sampling_.top_p,
        "truncation": truncation,
        "metadata": metadata,
    }
