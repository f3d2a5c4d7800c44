"""OpenAI's HTTP API on the router: /v1/chat/completions, /v1/completions, /v1/models.
`stream: true` answers server-sent events ending with `data: [DONE]`; responses carry
`usage`, and our metrics under "disagg"; errors are OpenAI's error object. Generation goes
through `Router.generate`, as gRPC does.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import aclosing
from typing import Any

import grpc
from aiohttp import web

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.errors import InvalidArgument, MeshError
from disagg_mesh.server.common.runtime.observability.logging import current_request_id
from disagg_mesh.server.common.structured.response_format import schema_text
from disagg_mesh.server.common.tools.calls import ArgumentsPiece, CallStart, Piece, ToolCall
from disagg_mesh.server.common.tools.requests import read_tools
from disagg_mesh.server.common.types import (
    ChatTurn,
    Prompt,
    ResponseFormat,
    Sampling,
    TokenLogprob,
)
from disagg_mesh.server.common.validation import MAX_TOP_LOGPROBS, PROMPT_TOO_LONG
from disagg_mesh.server.router.http.common import (
    Events,
    Fields,
    checked_sampling,
    collect_all,
    dry_run,
    first_event,
    http_status,
    json_body,
    logprob_json,
    merged,
    mesh_fields,
    reasoning_effort,
    renamed,
    sampling,
    scoped,
    token_text,
)
from disagg_mesh.server.router.routing import Router, RouteSummary

# OpenAI's error types by HTTP status (what its SDK turns into BadRequestError, ...).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def error_body(exc: MeshError, status: int) -> dict[str, Any]:
    """OpenAI's error object; a prompt longer than the context has OpenAI's own code for
    it (context_length_exceeded), which clients such as LiteLLM act on."""
    too_long = status == 400 and PROMPT_TOO_LONG.search(exc.message) is not None
    return {
        "error": {
            "message": exc.message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": getattr(exc, "field", None),
            "code": "context_length_exceeded" if too_long else exc.code.name.lower(),
        }
    }


def status_of(exc: MeshError) -> int:
    # A full queue is a rate limit to OpenAI's clients (429, which they retry).
    return 429 if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else http_status(exc)


# The mesh's sampling fields OpenAI's requests (with vLLM's extra ones) name otherwise.
FIELD_NAMES = {"repeat_penalty": "repetition_penalty"}

api = scoped("openai", error_body, status_of, lambda name: FIELD_NAMES.get(name, name))
SCHEMA_FIELD = "response_format.json_schema.schema"
# Choices a request may ask for (`n`): each takes a slot of its own while it generates.
MAX_CHOICES = 16


def _response_format(fields: Fields, limits: SchemaLimits) -> ResponseFormat | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", ...}}."""
    if not fields.body:
        return None
    kind = fields.string("type", required=True) or ""
    return output_format(kind, "response_format.type", "json_schema", fields, limits)


def output_format(
    kind: str, kind_field: str, spec_key: str, fields: Fields, limits: SchemaLimits
) -> ResponseFormat | None:
    """The format OpenAI's APIs name by `kind` ("text", "json_object", "json_schema"), its
    json_schema's name, schema and strict in `fields` (under `spec_key`, or in them when
    ""). A json_schema without its schema is any JSON object (chat's default)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat()
    if kind != "json_schema":
        raise InvalidArgument(
            kind_field, f'must be "text", "json_object" or "json_schema", got {kind!r}'
        )
    spec = fields.mapping(spec_key) if spec_key else fields
    spec.string("name", required=True)
    spec.boolean("strict", False)  # the grammar enforces the schema either way
    schema = spec.body.get("schema")
    if schema is None:  # OpenAI's default: any JSON object
        return ResponseFormat()
    field = f"{spec.prefix}schema"
    if not isinstance(schema, dict):
        raise InvalidArgument(field, f"must be an object, got {schema!r}")
    return schema_text(schema, field, limits)


# vLLM's extra parameters the mesh does not apply, with the value each takes by default
# (which clients written for vLLM may send unasked, and is accepted); any other value is a
# 400 naming the field, never silently ignored.
VLLM_UNAPPLIED: dict[str, tuple[object, str]] = {
    "use_beam_search": (False, "beam search is not implemented"),
    "length_penalty": (1.0, "beam search is not implemented"),
    "min_tokens": (0, "use ignore_eos for a fixed-length answer"),
    "stop_token_ids": ([], "use stop strings"),
    "include_stop_str_in_output": (False, "the text ends before its stop string"),
    "skip_special_tokens": (True, "the answer's text never holds special tokens"),
    "spaces_between_special_tokens": (True, "the answer's text never holds special tokens"),
    "prompt_logprobs": (None, "the prompt's own log probabilities are not computed"),
    "allowed_token_ids": (None, "use logit_bias"),
    "bad_words": ([], "use logit_bias"),
    "guided_choice": (None, "use response_format with a JSON schema (an enum)"),
    "guided_regex": (None, "use response_format with a JSON schema"),
    "guided_grammar": (None, "use response_format with a JSON schema"),
    "guided_whitespace_pattern": (None, "the grammar's own whitespace is used"),
    "structural_tag": (None, "use response_format or tools"),
    "structured_outputs": (None, "use response_format with a JSON schema"),
    "chat_template": (None, "the model's own chat template is used"),
    "chat_template_kwargs": ({}, "the model's own chat template is used as it is"),
    "documents": (None, "put the documents in the messages"),
    "mm_processor_kwargs": (None, "this mesh serves text models"),
    "priority": (0, "requests are served oldest first"),
    "return_tokens_as_token_ids": (False, "the tokens are given as text"),
    "logits_processors": (None, "use logit_bias"),
    "cache_salt": (None, "the nodes' prefix caches are not partitioned"),
    "kv_transfer_params": (None, "the mesh moves KV state itself"),
    "vllm_xargs": (None, "no extra arguments are read"),
}


def _vllm_unapplied(body: Fields) -> None:
    for key, (default, why) in VLLM_UNAPPLIED.items():
        body.refuse(key, f"{why} (vLLM's extra parameter)", default)


def _guided_json(body: Fields, limits: SchemaLimits) -> ResponseFormat | None:
    """vLLM's guided_json: a JSON Schema (an object, or its JSON text) the answer follows,
    as response_format's json_schema."""
    schema = body.body.get("guided_json")
    if schema is None:
        return None
    if body.body.get("response_format") not in (None, {"type": "text"}):
        raise InvalidArgument("guided_json", "set either guided_json or response_format")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidArgument("guided_json", f"is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidArgument("guided_json", f"must be a JSON Schema object, got {schema!r}")
    return schema_text(schema, "guided_json", limits)


def _schema_field(body: Fields) -> str:
    """Where the request's JSON Schema is, for an error about it."""
    return "guided_json" if body.body.get("guided_json") is not None else SCHEMA_FIELD


def _logit_bias(biases: Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (as JSON object keys) -> biases; the nodes check the
    ids against the model's vocabulary, the router the ranges."""
    pairs = []
    for key in biases.body:
        try:
            token = int(key)
        except ValueError:
            raise InvalidArgument(
                "logit_bias", f"keys must be token ids (integers), got {key!r}"
            ) from None
        bias = biases.number(key)
        if bias is None:
            raise InvalidArgument(f"logit_bias.{key}", "must be a number, got null")
        pairs.append((token, bias))
    return tuple(sorted(pairs))


def _n(body: Fields) -> int:
    """The choices asked for (`n`)."""
    n = body.integer("n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument("n", f"must be in 1..{MAX_CHOICES}, got {n}")
    return n or 1


def _logprobs(body: Fields, chat: bool) -> int | None:
    """How many of the most likely tokens to return beside each token's log probability
    (0: none; None: no log probabilities): chat's logprobs (true) and top_logprobs, or
    completions' logprobs (a number)."""
    if not chat:
        return body.integer("logprobs")
    top = body.integer("top_logprobs")
    if not body.boolean("logprobs", False):
        if top is not None:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        return None
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
    return top or 0


class OpenAiApi:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", api(self.chat_completions)),
            web.post("/v1/completions", api(self.completions)),
            web.get("/v1/models", api(self.models)),
            web.get("/v1/models/{model:.+}", api(self.model)),
        ]

    def _sampling(self, body: Fields, chat: bool) -> Sampling:
        _n(body)
        _vllm_unapplied(body)
        best_of = body.integer("best_of")
        if best_of not in (None, 1):
            raise InvalidArgument(
                "best_of", f"only 1 candidate per choice is supported, got {best_of}"
            )
        body.refuse("functions", "OpenAI's legacy field: use tools")
        if body.body.get("stream_options") is not None and not body.boolean("stream", False):
            # As OpenAI's API and vLLM answer it: the options of a stream there is not.
            raise InvalidArgument("stream_options", "is only allowed when stream is true")
        max_tokens = body.integer("max_completion_tokens")
        field = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, field = body.integer("max_tokens"), "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise InvalidArgument(field, f"must be at least 1, got {max_tokens}")
        temperature = body.number("temperature")
        if temperature is not None and not 0 <= temperature <= 2:
            raise InvalidArgument("temperature", f"must be in [0, 2], got {temperature}")
        return sampling(
            max_tokens=max_tokens,
            max_tokens_limit=self.router.max_tokens_limit,
            temperature=temperature,
            top_p=body.number("top_p"),
            # vLLM's extra parameters (the openai client's extra_body), as Ollama's options.
            top_k=body.integer("top_k"),
            min_p=body.number("min_p"),
            frequency_penalty=body.number("frequency_penalty"),
            presence_penalty=body.number("presence_penalty"),
            # vLLM's extra parameter; llama-server's name and window for it.
            repeat_penalty=body.number("repetition_penalty"),
            repeat_last_n=body.integer("repeat_last_n"),
            logit_bias=_logit_bias(body.mapping("logit_bias")),
            logprobs=_logprobs(body, chat),
            seed=body.integer("seed"),
            stop=body.strings("stop"),
            max_tokens_field=field,
            stream=body.boolean("stream", False),
            # vLLM's extra parameter (the openai client's extra_body): fixed-length answers.
            ignore_eos=body.boolean("ignore_eos", False),
            response_format=_guided_json(body, self.router.schema_limits)
            or _response_format(body.mapping("response_format"), self.router.schema_limits),
            tools=read_tools(
                body.body.get("tools"),
                body.body.get("tool_choice"),
                body.body.get("parallel_tool_calls"),
            ),
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = Fields(await json_body(request))
        model = body.string("model", required=True) or ""
        body.refuse("audio", "the mesh answers in text only")
        body.refuse("web_search_options", "the mesh does not search the web")
        body.refuse("echo", "vLLM's chat echo (the last message again) is not implemented")
        modalities = body.strings("modalities")
        if set(modalities) - {"text"}:
            raise InvalidArgument("modalities", f"only text is produced, got {list(modalities)}")
        sampling_ = await checked_sampling(
            self.router, self._sampling(body, chat=True), _schema_field(body)
        )
        messages = body.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages", "must be a non-empty list of messages")
        turns = [_turn(i, m) for i, m in enumerate(messages)]
        effort = reasoning_effort(body.body.get("reasoning_effort"), "reasoning_effort")
        if effort:
            self.router.check_reasons(model, "reasoning_effort")
        prompt = Prompt(
            messages=tuple(turns),
            reasoning_effort=effort,
            truncate_prompt_tokens=self._truncation(model, body),
        )
        checked = dry_run(request, self.router, model, prompt, sampling_)
        if checked is not None:
            return checked
        choices = self._choices(model, prompt, sampling_, _n(body))
        try:
            return await self._answer(request, body, model, choices, chat=True)
        except MeshError as exc:  # a chat's prompt is its messages
            if getattr(exc, "field", None) == "prompt":
                raise renamed(exc, "messages") from None
            raise

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = Fields(await json_body(request))
        model = body.string("model", required=True) or ""
        sampling_ = await checked_sampling(
            self.router, self._sampling(body, chat=False), _schema_field(body)
        )
        body.refuse("tools", "tools need /v1/chat/completions")
        # Fill in the middle, as OpenAI's legacy completions and llama-server's /infill.
        suffix = body.string("suffix") or ""
        echo = body.boolean("echo", False)
        if echo and sampling_.logprobs is not None:
            raise InvalidArgument(
                "echo", "is not supported with logprobs (the prompt's log probabilities)"
            )
        prompt = body.body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidArgument("prompt", "must be a string or a list of strings")
        n = _n(body)
        if len(texts) * n > MAX_CHOICES:
            raise InvalidArgument(
                "prompt",
                f"{len(texts)} prompts of {n} choices each: at most {MAX_CHOICES} choices a "
                "request",
            )
        keep = self._truncation(model, body)
        if echo and keep:
            raise InvalidArgument(
                "truncate_prompt_tokens", "is not supported with echo (the prompt echoed whole)"
            )
        if suffix and (echo or keep):
            raise InvalidArgument(
                "suffix",
                "is not supported with echo"
                if echo
                else "is not supported with truncate_prompt_tokens, which would cut the "
                "fill-in-the-middle tokens that frame the prompt",
            )
        prompts = [Prompt(text=t, truncate_prompt_tokens=keep, suffix=suffix) for t in texts]
        checked = [dry_run(request, self.router, model, one, sampling_) for one in prompts]
        if checked[-1] is not None:  # a dry run: every prompt checked
            return checked[-1]
        choices = [c for one in prompts for c in self._choices(model, one, sampling_, n)]
        echoes = [t for t in texts for _ in range(n)] if echo else []
        return await self._answer(request, body, model, choices, chat=False, echoes=echoes)

    def _truncation(self, model: str, body: Fields) -> int:
        """vLLM's truncate_prompt_tokens: only the prompt's last this many tokens are
        evaluated (-1: as many as the context holds beside one generated token); 0 unset."""
        keep = body.integer("truncate_prompt_tokens")
        if keep is None:
            return 0
        n_ctx = self.router.n_ctx(model)
        if keep == -1:
            return n_ctx - 1
        if not 1 <= keep <= n_ctx:
            raise InvalidArgument(
                "truncate_prompt_tokens",
                f"must be -1 or in 1..{n_ctx} (the context), got {keep}",
            )
        return keep

    def _choices(self, model: str, prompt: Prompt, sampling_: Sampling, n: int) -> list[Events]:
        """`n` generations of the prompt, at once (each its own seed, the request's + its
        index, so seeded choices differ too); a long prompt is evaluated once per node, as
        a burst's."""
        samplings = [sampling_] * n
        if sampling_.seed is not None:
            samplings = [
                dataclasses.replace(sampling_, seed=(sampling_.seed + i) % 2**32) for i in range(n)
            ]
        return [self.router.generate(model, prompt, s, None) for s in samplings]

    async def _answer(
        self,
        request: web.Request,
        body: Fields,
        model: str,
        choices: list[Events],
        chat: bool,
        echoes: list[str] | None = None,
    ) -> web.StreamResponse:
        """The generations as one answer of as many choices (`n`), whole or streamed;
        echoes: each choice's prompt, before its text (completions' echo)."""
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{current_request_id() or ''}"
        obj = "chat.completion" if chat else "text_completion"
        scored = _logprobs(body, chat) is not None
        several = len(choices) > 1
        if not body.boolean("stream", False):
            answers = []
            gots = await collect_all(choices)
            for index, got in enumerate(gots):
                s = got.summary
                choice: dict[str, Any] = {
                    "index": index,
                    "finish_reason": s.finish_reason.value,
                    "logprobs": _logprobs_json(got.logprobs, chat, 0)[0] if scored else None,
                }
                if chat:
                    # reasoning_content: the reasoning beside the answer, as vLLM and
                    # DeepSeek return it (OpenAI's own API does not return reasoning).
                    choice["message"] = {"role": "assistant", "content": got.text}
                    if got.reasoning:
                        choice["message"]["reasoning_content"] = got.reasoning
                    if got.tool_calls:
                        choice["message"]["content"] = got.text or None
                        choice["message"]["tool_calls"] = [
                            {
                                "id": c.id,
                                "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments},
                            }
                            for c in got.tool_calls
                        ]
                else:
                    choice["text"] = (echoes[index] if echoes else "") + got.text
                if several:  # each choice's own route; the top level's is the first's
                    choice["disagg"] = mesh_fields(s)
                answers.append(choice)
            return web.json_response(
                {
                    "id": ident,
                    "object": obj,
                    "created": int(time.time()),
                    "model": model,
                    "choices": answers,
                    "usage": _usage([got.summary for got in gots], _n(body)),
                    "disagg": mesh_fields(gots[0].summary),
                }
            )
        include_usage = body.mapping("stream_options").boolean("include_usage", False)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        # Each choice's: the characters of its answer so far (completions' text_offset).
        offsets = [0] * len(choices)

        def chunk(
            index: int,
            text: str | None,
            finish: str | None,
            first: bool = False,
            reasoning: str = "",
            calls: list[Piece] | None = None,
            logprobs: list[TokenLogprob] | None = None,
        ) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
            if logprobs:
                choice["logprobs"], offsets[index] = _logprobs_json(logprobs, chat, offsets[index])
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text is not None:
                    delta["content"] = text
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if calls:
                    delta["tool_calls"] = [_call_delta(p) for p in calls]
                choice["delta"] = delta
            else:
                choice["text"] = (echoes[index] if echoes and first else "") + (text or "")
            return {
                "id": ident,
                "object": chunk_obj,
                "created": created,
                "model": model,
                "choices": [choice],
            }

        events = merged(choices)
        async with aclosing(events):
            index, event = await first_event(events)  # errors before any text: their status
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            started: set[int] = set()  # the choices that sent their first chunk
            summaries: dict[int, RouteSummary] = {}
            try:
                while True:
                    if isinstance(event, RouteSummary):
                        summaries[index] = event
                        if echoes and index not in started:  # no text: the echo alone
                            await response.write(_event(chunk(index, None, None, first=True)))
                        last = chunk(index, None, event.finish_reason.value)
                        last["disagg"] = mesh_fields(event)
                        await response.write(_event(last))
                        if len(summaries) == len(choices):
                            if include_usage:
                                usage = chunk(0, None, None)
                                ordered = [summaries[i] for i in range(len(choices))]
                                usage.update(choices=[], usage=_usage(ordered, _n(body)))
                                await response.write(_event(usage))
                            break
                    else:
                        reasoning = event.reasoning if chat else ""
                        calls = event.tool_calls if chat else []
                        first = index not in started
                        if event.text or reasoning or first or event.logprobs:
                            piece = chunk(
                                index, event.text, None, first, reasoning, logprobs=event.logprobs
                            )
                            await response.write(_event(piece))
                            started.add(index)
                        for call in calls:  # one a chunk, after the text, as OpenAI sends them
                            await response.write(_event(chunk(index, None, None, calls=[call])))
                    index, event = await anext(events)
            except MeshError as exc:  # after text was sent: an error event ends the stream
                await response.write(_event(error_body(exc, 500)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [self._model(r.name) for r, _, _ in self.router.routes()]}
        )

    async def model(self, request: web.Request) -> web.Response:
        """One model (the `openai` client's models.retrieve); 404 naming those served."""
        return web.json_response(self._model(self.router.route(request.match_info["model"]).name))

    def _model(self, name: str) -> dict[str, Any]:
        """A model as OpenAI lists one, with vLLM's max_model_len: the context a request
        gets (its nodes' n_ctx), which clients read to fit their prompts."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "disagg-mesh",
            "max_model_len": self.router.n_ctx(name),
        }


def _turn(i: int, message: Any) -> ChatTurn:
    if not isinstance(message, dict):
        raise InvalidArgument(f"messages[{i}]", "must be an object")
    fields = Fields(message, f"messages[{i}].")
    role = fields.string("role", required=True) or ""
    if role not in ROLES:
        raise InvalidArgument(
            f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}"
        )
    content = _content(i, message.get("content"), role)
    if role == "assistant" and message.get("tool_calls") is not None:
        return ChatTurn("assistant", content, _calls(message["tool_calls"], f"messages[{i}]"))
    if role == "tool":
        call_id = fields.string("tool_call_id", required=True) or ""
        return ChatTurn("tool", content, tool_call_id=call_id)
    return ChatTurn(ROLES[role], content)


def _content(i: int, content: Any, role: str) -> str:
    """A message's text: a string or text parts; none only for an assistant's (its calls
    alone), as OpenAI's API has it."""
    if content is None:
        if role != "assistant":
            raise InvalidArgument(f"messages[{i}].content", f"is required in a {role} message")
        return ""
    return text_parts(content, f"messages[{i}].content", ("text",))


def text_parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """Content as OpenAI's APIs send it: a string, or a list of text parts of these types
    (chat's "text"; the Responses API's "input_text" and "output_text"), joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(where, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise InvalidArgument(
                f"{where}[{j}]", f"only {' and '.join(kinds)} parts are supported, got {kind!r}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidArgument(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _calls(value: Any, message: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls, as OpenAI's API returned them."""
    where = f"{message}.tool_calls"
    if not isinstance(value, list):
        raise InvalidArgument(where, "must be a list of calls")
    calls = []
    for j, call in enumerate(value):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise InvalidArgument(f"{where}[{j}]", 'must be {"id", "type", "function"}')
        fields = Fields(call["function"], f"{where}[{j}].function.")
        name = fields.string("name", required=True) or ""
        arguments = call["function"].get("arguments", "{}")
        if isinstance(arguments, dict):  # as Ollama sends them
            arguments = json.dumps(arguments)
        if not isinstance(arguments, str):
            raise InvalidArgument(f"{where}[{j}].function.arguments", "must be a JSON string")
        calls.append(ToolCall(str(call.get("id") or f"call_{j}"), name, arguments))
    return tuple(calls)


def _call_delta(piece: Piece) -> dict[str, Any]:
    """A streamed piece of a call, as OpenAI streams them."""
    if isinstance(piece, CallStart):
        return {
            "index": piece.index,
            "id": piece.id,
            "type": "function",
            "function": {"name": piece.name, "arguments": ""},
        }
    assert isinstance(piece, ArgumentsPiece)
    return {"index": piece.index, "function": {"arguments": piece.text}}


def _logprobs_json(
    logprobs: list[TokenLogprob], chat: bool, offset: int
) -> tuple[dict[str, Any], int]:
    """The tokens' log probabilities as OpenAI writes them: chat's content list, or
    completions' parallel lists (text_offset counting from `offset`, the characters of the
    answer before them); and the offset after them."""
    if chat:
        return {"content": [logprob_json(lp) for lp in logprobs], "refusal": None}, offset
    texts = [token_text(lp.chosen.piece) for lp in logprobs]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [lp.chosen.logprob for lp in logprobs],
        "top_logprobs": [{token_text(c.piece): c.logprob for c in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }, offset


def _usage(summaries: list[RouteSummary], n: int) -> dict[str, Any]:
    """Every choice's tokens; each prompt (the first of each n choices) counted once, as
    OpenAI counts them."""
    prompts = summaries[::n]
    prompt = sum(s.prompt_tokens for s in prompts)
    completion = sum(s.completion_tokens for s in summaries)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's own field: prompt tokens served from a cache (the prefill node's prefix
        # cache here) instead of evaluated.
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_prompt_tokens for s in prompts)},
    }


def _event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()
