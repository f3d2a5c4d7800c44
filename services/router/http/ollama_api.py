"""Ollama's HTTP API on the router: /api/generate, /api/chat, /api/tags, /api/ps, /api/show,
/api/version, with Ollama's field names and units (durations in nanoseconds), our metrics
under "disagg". Both generation endpoints go through `Router.generate`, as gRPC does.

Ollama's semantics kept: /api/generate applies the model's chat template unless `raw` is
true (the prompt becomes a user turn, `system` a system turn); an empty prompt loads the
model and answers done_reason "load"; `options.num_predict` -1 or -2 (or unset) generates
until an end token or a full context, bounded by the mesh's max_tokens_limit. A reasoning
model's reasoning (gpt-oss) comes as `thinking` beside the answer; `think` is true, false or
a level ("low", "medium", "high", gpt-oss's reasoning effort). gpt-oss reasons whatever
`think` says (in Ollama too): false leaves its reasoning out of the reply.
"""

from __future__ import annotations

import datetime
import json
import re
from contextlib import aclosing
from typing import Any

from aiohttp import web

from disagg_mesh.server.common.config.topology import SchemaLimits
from disagg_mesh.server.common.errors import InvalidArgument, MeshError, NotFound
from disagg_mesh.server.common.structured.response_format import schema_text
from disagg_mesh.server.common.tools.calls import Piece, ToolCall, assemble
from disagg_mesh.server.common.tools.requests import read_tools
from disagg_mesh.server.common.types import (
    ChatTurn,
    FinishReason,
    ModelFacts,
    Prompt,
    ResponseFormat,
    Sampling,
)
from disagg_mesh.server.router.http.common import (
    Events,
    Fields,
    checked_sampling,
    collect,
    dry_run,
    first_event,
    json_body,
    logprob_json,
    mesh_fields,
    reasoning_effort,
    sampling,
    scoped,
)
from disagg_mesh.server.router.routing import Router, RouteSummary

MESH_VERSION = "0.1.0"  # disagg-mesh's own (pyproject.toml)
# The Ollama release whose API this door follows, which /api/version answers, as Ollama
# answers its own: clients gate what they use on it (VS Code's Copilot Chat refuses an
# Ollama before 0.6.4, which /api/show's capabilities came with). The door was written
# from ollama/ollama's source at v0.33.0-rc2 (server/routes.go, api/types.go, openai/), so
# the release before it; what Ollama serves beyond the door's paths (pulls, embeddings,
# images) is answered as not served here, naming it.
OLLAMA_API_VERSION = "0.32.15"
NDJSON = "application/x-ndjson"
# A duration as Go's time.ParseDuration reads it ("5m", "1h30m", "-1s", "0"), which Ollama
# uses for keep_alive strings.
GO_DURATION = re.compile(r"[-+]?(0|(([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h))+)")


def error_body(exc: MeshError, status: int) -> dict[str, Any]:
    if status == 404 and exc.code.name == "NOT_FOUND" and "is not served here" in exc.message:
        return {
            "error": f"{exc.message} (ollama pull does not apply: the mesh's topology "
            "lists the models it serves)"
        }
    return {"error": exc.message}


# The mesh's sampling fields that Ollama's requests carry outside `options` (door_field).
OUTSIDE_OPTIONS = {
    "max_tokens": "options.num_predict",
    "logprobs": "top_logprobs",
    "response_format": "format",
    "tools": "tools",
}


def field_name(name: str) -> str:
    """A sampling field as an Ollama request names it: "top_p" is options.top_p."""
    head = re.split(r"[.\[]", name, maxsplit=1)[0]
    return OUTSIDE_OPTIONS.get(head, f"options.{name}")


api = scoped("ollama", error_body, field_name=field_name)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return round(max(seconds, 0.0) * 1e9)


def _format(value: object, limits: SchemaLimits) -> ResponseFormat | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON Schema object."""
    if value is None or value == "":
        return None
    if value == "json":
        return ResponseFormat()
    if not isinstance(value, dict):
        raise InvalidArgument("format", f'must be "json" or a JSON Schema object, got {value!r}')
    return schema_text(value, "format", limits)


class OllamaApi:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.started = now()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/", self.root),
            web.post("/api/generate", api(self.generate)),
            web.post("/api/chat", api(self.chat)),
            web.get("/api/tags", api(self.tags)),
            web.get("/api/ps", api(self.ps)),
            web.post("/api/show", api(self.show)),
            web.get("/api/version", api(self.version)),
        ]

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(
            text="disagg-mesh router: Ollama API under /api, OpenAI under /v1, "
            "the dashboard at /dashboard"
        )

    # -- generation ------------------------------------------------------------------------

    def _sampling(self, model: str, body: Fields) -> Sampling:
        options = body.mapping("options")
        num_ctx = options.integer("num_ctx")
        n_ctx = self.router.n_ctx(model)
        if num_ctx is not None and num_ctx > n_ctx:
            raise InvalidArgument(
                "options.num_ctx",
                f"model {model!r} is served with a context of {n_ctx} tokens (the nodes' "
                f"n_ctx), less than the {num_ctx} asked for",
            )
        seed = options.integer("seed")
        return sampling(
            max_tokens=options.integer("num_predict"),
            max_tokens_limit=self.router.max_tokens_limit,
            temperature=options.number("temperature"),
            top_p=options.number("top_p"),
            top_k=options.integer("top_k"),
            min_p=options.number("min_p"),
            repeat_penalty=options.number("repeat_penalty"),
            frequency_penalty=options.number("frequency_penalty"),
            presence_penalty=options.number("presence_penalty"),
            repeat_last_n=options.integer("repeat_last_n"),
            logprobs=_logprobs(body),
            seed=seed,
            stop=options.strings("stop"),
            max_tokens_field="options.num_predict",
            stream=body.boolean("stream", True),
            response_format=_format(body.body.get("format"), self.router.schema_limits),
            tools=read_tools(body.body.get("tools")),
        )

    def _think(self, model: str, body: Fields) -> tuple[str, bool]:
        """`think`: the reasoning effort it names ("" for the model's default), and whether
        the reply carries the reasoning. True or a level for a model that does not reason
        is a 400, as in Ollama."""
        think = body.body.get("think")
        if think is None or think is False:
            return "", think is None
        effort = "" if think is True else reasoning_effort(think, "think")
        self.router.check_reasons(model, "think")
        return effort, True

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = Fields(await json_body(request))
        model = body.string("model", required=True) or ""
        for key, why in (
            ("tools", "tools need /api/chat"),
            ("images", "this mesh serves text models"),
            ("context", "send the conversation as messages to /api/chat instead"),
            ("template", "the model's own chat template is used"),
        ):
            body.refuse(key, why)
        _keep_alive(body)
        prompt_text = body.string("prompt") or ""
        system = body.string("system")
        stream = body.boolean("stream", True)
        truncate = body.boolean("truncate", True)  # a system turn and a user one: none to drop
        sampling_ = await checked_sampling(self.router, self._sampling(model, body), "format")
        effort, thinking = self._think(model, body)
        if not prompt_text and not system:
            self.router.n_ctx(model)  # NOT_FOUND for an unknown model, as Ollama
            return self._loaded(model, "response", stream)
        suffix = body.string("suffix") or ""
        raw = body.boolean("raw", False)
        if suffix and (raw or system):
            # Ollama would drop the suffix under raw, and the system prompt beside a suffix.
            raise InvalidArgument(
                "suffix",
                "fills in the middle with the model's own FIM format, which has no place for "
                + ("raw (put the FIM tokens in the prompt yourself instead)" if raw else "system"),
            )
        if suffix:
            prompt = Prompt(text=prompt_text, suffix=suffix)
        elif raw:
            prompt = Prompt(text=(system or "") + prompt_text)
        else:
            turns = ([ChatTurn("system", system)] if system else []) + [
                ChatTurn("user", prompt_text)
            ]
            prompt = Prompt(
                messages=tuple(turns),
                reasoning_effort=effort,
                truncate_history=truncate,
            )
        checked = dry_run(request, self.router, model, prompt, sampling_)
        if checked is not None:
            return checked
        events = self.router.generate(model, prompt, sampling_, None)
        return await self._answer(request, model, events, stream, "response", thinking)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = Fields(await json_body(request))
        model = body.string("model", required=True) or ""
        _keep_alive(body)
        stream = body.boolean("stream", True)
        sampling_ = await checked_sampling(self.router, self._sampling(model, body), "format")
        effort, thinking = self._think(model, body)
        raw_messages = body.body.get("messages")
        if raw_messages is None or raw_messages == []:
            self.router.n_ctx(model)
            return self._loaded(model, "message", stream)
        if not isinstance(raw_messages, list):
            raise InvalidArgument("messages", "must be a list of {role, content} objects")
        turns = _turns(raw_messages)
        # Ollama's `truncate` (on unless false): the oldest turns go when the chat is too long.
        prompt = Prompt(
            messages=tuple(turns),
            reasoning_effort=effort,
            truncate_history=body.boolean("truncate", True),
        )
        checked = dry_run(request, self.router, model, prompt, sampling_)
        if checked is not None:
            return checked
        events = self.router.generate(model, prompt, sampling_, None)
        return await self._answer(request, model, events, stream, "message", thinking)

    def _loaded(self, model: str, field: str, stream: bool) -> web.Response:
        """Ollama's answer to a request without a prompt: the model is ready."""
        empty: Any = "" if field == "response" else {"role": "assistant", "content": ""}
        line = {
            "model": model,
            "created_at": now(),
            field: empty,
            "done": True,
            "done_reason": "load",
        }
        if stream:
            return web.Response(text=_line(line), content_type=NDJSON)
        return web.json_response(line)

    def _piece(self, model: str, field: str, text: str, thinking: str = "") -> dict[str, Any]:
        """One line of the answer; `thinking` (reasoning) beside the text, as Ollama puts
        it: in the message for /api/chat, at the top for /api/generate."""
        line: dict[str, Any] = {"model": model, "created_at": now()}
        if field == "response":
            line["response"] = text
            if thinking:
                line["thinking"] = thinking
        else:
            line["message"] = {"role": "assistant", "content": text}
            if thinking:
                line["message"]["thinking"] = thinking
        line["done"] = False
        return line

    def _final(
        self, model: str, field: str, text: str, s: RouteSummary, thinking: str = ""
    ) -> dict[str, Any]:
        line = self._piece(model, field, text, thinking)
        line.update(
            done=True,
            # Ollama ends an answer with calls as any other: "stop".
            done_reason="stop"
            if s.finish_reason is FinishReason.TOOL_CALLS
            else s.finish_reason.value,
            total_duration=ns(s.total_seconds),
            load_duration=0,
            prompt_eval_count=s.prompt_tokens,
            prompt_eval_duration=ns(s.prefill_seconds),
            eval_count=s.completion_tokens,
            eval_duration=ns(s.decode_seconds),
            disagg=mesh_fields(s),
        )
        return line

    async def _answer(
        self,
        request: web.Request,
        model: str,
        events: Events,
        stream: bool,
        field: str,
        thinking: bool,
    ) -> web.StreamResponse:
        if not stream:
            got = await collect(events)
            reasoning = got.reasoning if thinking else ""
            line = self._final(model, field, got.text, got.summary, reasoning)
            if got.tool_calls:
                line["message"]["tool_calls"] = _ollama_calls(got.tool_calls)
            if got.logprobs:
                line["logprobs"] = [logprob_json(lp) for lp in got.logprobs]
            return web.json_response(line)
        async with aclosing(events):
            event = await first_event(events)  # errors before any text keep their status
            response = web.StreamResponse(headers={"Content-Type": NDJSON})
            await response.prepare(request)
            pieces: list[Piece] = []  # Ollama streams each call whole: sent before the end
            try:
                while True:
                    if isinstance(event, RouteSummary):
                        calls = assemble(pieces)[1]
                        if calls:
                            line = self._piece(model, field, "")
                            line["message"]["tool_calls"] = _ollama_calls(calls)
                            await response.write(_line(line).encode())
                        await response.write(_line(self._final(model, field, "", event)).encode())
                        break
                    reasoning = event.reasoning if thinking else ""
                    pieces.extend(event.tool_calls)
                    if event.text or reasoning or event.logprobs:
                        line = self._piece(model, field, event.text, reasoning)
                        if event.logprobs:
                            line["logprobs"] = [logprob_json(lp) for lp in event.logprobs]
                        await response.write(_line(line).encode())
                    event = await anext(events)
            except MeshError as exc:  # after text was sent: Ollama's error line ends the stream
                await response.write(_line({"error": exc.message}).encode())
            await response.write_eof()
            return response

    # -- models ----------------------------------------------------------------------------

    def _model_entry(self, name: str, facts: ModelFacts) -> dict[str, Any]:
        """A model as /api/tags lists it: its nodes' model file (family, size, quantization)
        as they said it is (Router.model_facts: empty until one has come up)."""
        node = self._first_node(name)
        return {
            "name": name,
            "model": name,
            "modified_at": self.started,
            "size": facts.file_size_bytes,
            "digest": "",
            "details": {
                "format": "gguf" if node.engine in ("llama_cpp", "ollama") else "",
                "family": facts.architecture,
                "families": [facts.architecture] if facts.architecture else None,
                "parameter_size": facts.parameter_size,
                "quantization_level": facts.quantization,
                "parent_model": "",
            },
        }

    def _first_node(self, name: str) -> Any:
        for route, prefill, decode in self.router.routes():
            if route.name == name:
                return (decode or prefill)[0]
        raise NotFound(f"model {name!r} not found (it is not in the mesh's topology)")

    async def tags(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "models": [
                    self._model_entry(r.name, self.router.model_facts(r.name))
                    for r, _, _ in self.router.routes()
                ]
            }
        )

    async def ps(self, request: web.Request) -> web.Response:
        running = []
        for route, prefill, decode in self.router.routes():
            if any(self.router.health.serving(n) for n in (*prefill, *decode)):
                engine = self.router.model_engine(route.name)
                entry = self._model_entry(route.name, engine.facts)
                entry.update(
                    expires_at="2999-01-01T00:00:00Z",
                    # The model's bytes on a GPU, as Ollama counts them (`ollama ps`: "100% GPU").
                    size_vram=round(entry["size"] * engine.gpu_share),
                    context_length=self.router.n_ctx(route.name),
                )
                running.append(entry)
        return web.json_response({"models": running})

    async def show(self, request: web.Request) -> web.Response:
        body = Fields(await json_body(request))
        name = body.string("model") or body.string("name") or ""
        if not name:
            raise InvalidArgument("model", "is required")
        node = self._first_node(name)
        route = next(r for r, _, _ in self.router.routes() if r.name == name)
        lines = [f"# served by disagg-mesh: chain {' -> '.join(route.chain)}"]
        lines += [f"# prefill: {n}" for n in route.prefill] + [
            f"# decode: {n}" for n in route.decode
        ]
        lines.append(f"FROM {node.model}")
        facts = self.router.model_facts(name)
        entry = self._model_entry(name, facts)
        return web.json_response(
            {
                "modelfile": "\n".join(lines) + "\n",
                "parameters": f"num_ctx {self.router.n_ctx(name)}",
                "template": facts.template,
                "details": entry["details"],
                "model_info": {**_model_info(facts), "disagg.chain": route.chain},
                # What the nodes said their model can do; until one has, what any can.
                "capabilities": list(facts.capabilities or ("completion", "tools")),
                "modified_at": self.started,
            }
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_API_VERSION, "disagg_mesh": MESH_VERSION})


def _model_info(facts: ModelFacts) -> dict[str, Any]:
    """The GGUF keys Ollama's /api/show gives in model_info, those the nodes told."""
    arch = facts.architecture
    info: dict[str, Any] = {"general.architecture": arch}
    if facts.parameter_count:
        info["general.parameter_count"] = facts.parameter_count
    if arch and facts.trained_context_tokens:
        info[f"{arch}.context_length"] = facts.trained_context_tokens
    if arch and facts.embedding_length:
        info[f"{arch}.embedding_length"] = facts.embedding_length
    return info


def _keep_alive(body: Fields) -> None:
    """Ollama's keep_alive, checked as Ollama reads it: seconds (a number; negative: for
    ever) or a Go duration ("5m", "-1h", "0"); the ollama client sends keep_alive=0 as 0.0.
    Then left alone: the mesh's nodes keep their models loaded."""
    value = body.body.get("keep_alive")
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return
    if isinstance(value, str) and GO_DURATION.fullmatch(value):
        return
    raise InvalidArgument(
        "keep_alive",
        'must be a number of seconds or a duration such as "5m", "1h30m" or "-1h" '
        f"(negative: for ever), got {value!r}",
    )


def _turns(messages: list[Any]) -> list[ChatTurn]:
    """Ollama's chat messages. Its calls carry no ids: each gets one here, and a tool
    message answers the call it names (`tool_name`), else the first one not yet answered."""
    turns: list[ChatTurn] = []
    unanswered: list[ToolCall] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{i}]", "must be an object")
        fields = Fields(message, f"messages[{i}].")
        fields.refuse("images", "this mesh serves text models")
        fields.string("thinking")  # an earlier turn's reasoning: harmony drops it
        role = fields.string("role", required=True) or ""
        content = fields.string("content") or ""
        calls = _read_calls(message.get("tool_calls"), i)
        unanswered.extend(calls)
        call_id = ""
        if role == "tool":
            name = fields.string("tool_name") or fields.string("name")
            answered = next((c for c in unanswered if name in (None, c.name)), None)
            if answered is None:
                raise InvalidArgument(
                    f"messages[{i}]",
                    "a tool result with no assistant tool call before it"
                    + (f" to {name!r}" if name else ""),
                )
            unanswered.remove(answered)
            call_id = answered.id
        turns.append(ChatTurn(role, content, calls, call_id))
    return turns


def _read_calls(value: Any, i: int) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise InvalidArgument(where, "must be a list of calls")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(f"{where}[{j}]", 'must be {"function": {"name", "arguments"}}')
        arguments = function.get("arguments", {})
        if not isinstance(arguments, dict):
            raise InvalidArgument(f"{where}[{j}].function.arguments", "must be an object")
        calls.append(ToolCall(f"call_{i}_{j}", function["name"], json.dumps(arguments)))
    return tuple(calls)


def _logprobs(body: Fields) -> int | None:
    """Ollama's logprobs (true) and top_logprobs: how many of the most likely tokens beside
    each token's (None: no log probabilities)."""
    top = body.integer("top_logprobs")
    if not body.boolean("logprobs", False):
        if top:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def _ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as Ollama returns them: arguments as an object (as the model wrote them when
    they are not one)."""
    out = []
    for index, call in enumerate(calls):
        try:
            arguments: Any = call.parsed_arguments()
        except ValueError:
            arguments = call.arguments
        out.append({"function": {"index": index, "name": call.name, "arguments": arguments}})
    return out


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
