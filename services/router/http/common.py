"""What both HTTP front doors share: the request scope (request id, bearer token, one log line
and a count per request), reading JSON bodies field by field, and mesh errors as HTTP
statuses. Plain Python and aiohttp; no protobuf."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog
from aiohttp import web

from disagg_mesh.server.common.errors import InvalidArgument, MeshError, retry_after
from disagg_mesh.server.common.runtime.auth import bearer_accepted
from disagg_mesh.server.common.runtime.observability import metrics
from disagg_mesh.server.common.runtime.observability.logging import REQUEST_ID_KEY, new_request_id
from disagg_mesh.server.common.tools.calls import Piece, ToolCall, assemble
from disagg_mesh.server.common.tools.requests import ToolRequest
from disagg_mesh.server.common.types import (
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_REPEAT_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    REASONING_EFFORTS,
    Prompt,
    ResponseFormat,
    Sampling,
    TextChunk,
    TokenChoice,
    TokenLogprob,
)
from disagg_mesh.server.common.validation import check_format
from disagg_mesh.server.router.routing import Router, RouteSummary

log = structlog.get_logger("http")

# gRPC status → HTTP status, as Ollama and OpenAI use them; anything else is 500 (e.g.
# FAILED_PRECONDITION: a node refused what the router sent, not the caller's fault). A full
# queue is 503 for Ollama ("server busy") and 429 for OpenAI (rate limit), which each SDK
# retries.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
}

# A generation request with this header set to 1 or true is read and checked as it would be
# served (its fields, the model, the prompt, the sampling) and answered {"valid": true}
# without running: how `disagg batch` checks a whole file before it starts.
DRY_RUN_HEADER = "X-Disagg-Dry-Run"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ErrorBody = Callable[[MeshError, int], dict[str, Any]]
# A door's name for a field of the mesh's SamplingParams, given the name after "sampling.".
FieldName = Callable[[str], str]


# The largest body a door reads (aiohttp's client_max_size): far past any node's context.
MAX_BODY_BYTES = 16 << 20


class BodyTooLarge(InvalidArgument):
    """A body over MAX_BODY_BYTES: HTTP's 413 (aiohttp's own answer is plain text)."""

    def __init__(self) -> None:
        super().__init__("body", f"is over the {MAX_BODY_BYTES >> 20} MiB a request may have")


def http_status(exc: MeshError) -> int:
    if isinstance(exc, BodyTooLarge):
        return 413
    return HTTP_STATUS.get(exc.code, 500)


class Unauthenticated(MeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


def door_field(exc: MeshError, name: FieldName) -> MeshError:
    """An INVALID_ARGUMENT naming a field of the mesh's SamplingParams ("sampling.top_p": the
    router's checks and a node's name gRPC's fields) named as the door's request has it
    instead ("top_p", "options.top_p"), a node's own check ending with the node; any other
    error as it is."""
    field = getattr(exc, "field", None)
    if exc.code != grpc.StatusCode.INVALID_ARGUMENT or not isinstance(field, str):
        return exc
    if not field.startswith("sampling."):
        return exc
    return renamed(exc, name(field.removeprefix("sampling.")))


def renamed(exc: MeshError, name: str) -> InvalidArgument:
    """An INVALID_ARGUMENT naming its field (`field`) naming `name` instead; a node's own
    check (the router's message starts with the node) ends with the node."""
    field = getattr(exc, "field", None) or ""
    node, _, problem = exc.message.partition(f"{field}: ")
    where = node.removesuffix(": ")
    return InvalidArgument(name, problem + (f" ({where})" if where else ""))


def scoped(
    api: str,
    error_body: ErrorBody,
    status_of: Callable[[MeshError], int] = http_status,
    field_name: FieldName | None = None,
) -> Callable[[Handler], Handler]:
    """Wrap a handler: request id (the caller's X-Request-Id, or a new one) bound to every
    log line and sent back as a header, the bearer token checked when the mesh has one,
    MeshErrors answered as error_body (a sampling field named by `field_name`: door_field),
    one log line and a count per request."""

    def wrap(handler: Handler) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            given = request.headers.get(REQUEST_ID_KEY, "")
            request_id = given if 0 < len(given) <= 128 else new_request_id()
            structlog.contextvars.bind_contextvars(request_id=request_id)
            path = f"{request.method} {request.path}"
            metrics.HTTP_IN_FLIGHT.labels(api).inc()
            started = time.perf_counter()
            status = 500
            try:
                _check_token(request)
                response = await handler(request)
                status = response.status
            except MeshError as raised:
                exc = door_field(raised, field_name) if field_name else raised
                status = status_of(exc)
                response = web.json_response(error_body(exc, status), status=status)
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy: when to retry
                    response.headers["Retry-After"] = str(math.ceil(retry_after(exc)))
            except (ConnectionResetError, asyncio.CancelledError) as exc:
                status = 499  # the client went away: its handler was cancelled
                log.info("http client gone", path=path, error=type(exc).__name__)
                raise
            finally:
                metrics.HTTP_IN_FLIGHT.labels(api).dec()
                metrics.HTTP_REQUESTS.labels(api, request.path, str(status)).inc()
                log.info(
                    "http done",
                    path=path,
                    status=status,
                    duration_ms=round((time.perf_counter() - started) * 1000, 2),
                )
                structlog.contextvars.unbind_contextvars("request_id")
            response.headers[REQUEST_ID_KEY] = request_id
            return response

        return handle

    return wrap


def _check_token(request: web.Request) -> None:
    if not bearer_accepted(request.headers.get("Authorization", "")):
        raise Unauthenticated("missing or invalid token: send Authorization: Bearer <token>")


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument("body", f"is not valid JSON: {exc}") from None
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge() from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


# Fields.refuse's default when the field has none: any value but an empty one is refused.
UNSET = object()


@dataclass
class Fields:
    """Typed reads of a JSON object; a wrong type is InvalidArgument naming the field."""

    body: dict[str, Any]
    prefix: str = ""

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def string(self, key: str, required: bool = False) -> str | None:
        value = self.body.get(key)
        if value is None:
            if required:
                raise InvalidArgument(self._name(key), "is required")
            return None
        if not isinstance(value, str):
            raise InvalidArgument(self._name(key), f"must be a string, got {value!r}")
        return value

    def number(self, key: str) -> float | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise InvalidArgument(self._name(key), f"must be a number, got {value!r}")
        return float(value)

    def integer(self, key: str) -> int | None:
        value = self.body.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(self._name(key), f"must be an integer, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidArgument(self._name(key), f"must be true or false, got {value!r}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        """A string or a list of strings (OpenAI's stop), as a tuple."""
        value = self.body.get(key)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise InvalidArgument(
            self._name(key), f"must be a string or a list of strings, got {value!r}"
        )

    def mapping(self, key: str) -> Fields:
        value = self.body.get(key)
        if value is None:
            return Fields({}, f"{self._name(key)}.")
        if not isinstance(value, dict):
            raise InvalidArgument(self._name(key), f"must be an object, got {value!r}")
        return Fields(value, f"{self._name(key)}.")

    def refuse(self, key: str, why: str, default: object = UNSET) -> None:
        """A field we do not support: refused when set, never silently ignored; given its
        `default` (the value that changes nothing, which clients may send unasked), when
        set to anything else (a boolean only as that boolean)."""
        value = self.body.get(key)
        if default is UNSET:
            unset = value in (None, False, [], {}, "")
        elif isinstance(value, bool) or isinstance(default, bool):
            unset = value is None or value is default
        else:
            unset = value is None or value == default
        if not unset:
            raise InvalidArgument(self._name(key), f"is not supported: {why}")


# Tokens per delta from the nodes for an answer the door sends whole: the caller sees none
# of them before the end, and each message through the mesh costs CPU time that a machine's
# cores would otherwise spend on tokens (Sampling.stream_interval_tokens).
WHOLE_ANSWER_INTERVAL_TOKENS = 16


def sampling(
    *,
    max_tokens: int | None,
    max_tokens_limit: int,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: tuple[str, ...],
    max_tokens_field: str,
    stream: bool,
    ignore_eos: bool = False,
    response_format: ResponseFormat | None = None,
    tools: ToolRequest | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repeat_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repeat_last_n: int | None = None,
    logit_bias: tuple[tuple[int, float], ...] = (),
    logprobs: int | None = None,
) -> Sampling:
    """A Sampling from an HTTP request; unset max_tokens (or Ollama's -1/-2) means until an
    end token or a full context, bounded by the mesh's max_tokens_limit. An answer sent
    whole (not streamed) comes from the nodes in deltas of WHOLE_ANSWER_INTERVAL_TOKENS."""
    if max_tokens is None or max_tokens in (-1, -2):
        max_tokens = max_tokens_limit
    elif not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidArgument(
            max_tokens_field, f"must be between 1 and {max_tokens_limit}, got {max_tokens}"
        )
    if seed == -1:  # Ollama's default, and llama-server's: a random seed
        seed = None
    if seed is not None and not 0 <= seed < 2**32:
        # The mesh's field; each door names it as its request does (door_field).
        raise InvalidArgument(
            "sampling.seed", f"must be in 0..{2**32 - 1} (-1: random), got {seed}"
        )
    return Sampling(
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=DEFAULT_TOP_P if top_p is None else top_p,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        response_format=response_format,
        stream_interval_tokens=1 if stream else WHOLE_ANSWER_INTERVAL_TOKENS,
        tools=tools,
        top_k=DEFAULT_TOP_K if top_k is None else top_k,
        min_p=DEFAULT_MIN_P if min_p is None else min_p,
        repeat_penalty=DEFAULT_REPEAT_PENALTY if repeat_penalty is None else repeat_penalty,
        frequency_penalty=frequency_penalty or 0.0,
        presence_penalty=presence_penalty or 0.0,
        repeat_last_n=DEFAULT_REPEAT_LAST_N if repeat_last_n is None else repeat_last_n,
        logit_bias=logit_bias,
        logprobs=logprobs,
    )


Events = AsyncGenerator[TextChunk | RouteSummary, None]
T = TypeVar("T")


def dry_run(
    request: web.Request, router: Router, model: str, prompt: Prompt, sampling: Sampling
) -> web.Response | None:
    """With DRY_RUN_HEADER: the router's own checks (NOT_FOUND for an unknown model,
    INVALID_ARGUMENT naming the field), then {"valid": true}; None: run the request."""
    if request.headers.get(DRY_RUN_HEADER, "").lower() not in ("1", "true"):
        return None
    router.check(model, prompt, sampling)
    return web.json_response({"valid": True, "model": model})


async def first_event(events: AsyncGenerator[T, None]) -> T:
    """The first event: errors before any text surface here, so they still get their own
    HTTP status (the response has not started yet)."""
    return await anext(events)


@dataclass(frozen=True)
class Collected:
    """A whole generation (stream: false): its answer, its reasoning, its summary, and
    the tool calls it made."""

    text: str
    reasoning: str
    summary: RouteSummary
    tool_calls: list[ToolCall] = field(default_factory=list)
    # With Sampling.logprobs: each token's.
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def collect(events: Events) -> Collected:
    parts: list[str] = []
    reasoning: list[str] = []
    pieces: list[Piece] = []
    logprobs: list[TokenLogprob] = []
    summary: RouteSummary | None = None
    async with aclosing(events) as stream:
        async for event in stream:
            if isinstance(event, RouteSummary):
                summary = event
            else:
                parts.append(event.text)
                reasoning.append(event.reasoning)
                pieces.extend(event.tool_calls)
                logprobs.extend(event.logprobs)
    assert summary is not None, "a generation ends with its summary"
    return Collected("".join(parts), "".join(reasoning), summary, assemble(pieces)[1], logprobs)


async def collect_all(choices: Sequence[Events]) -> list[Collected]:
    """Whole generations at once, in order; the first to fail fails them all (the others
    cancelled), with its own error."""
    if len(choices) == 1:
        return [await collect(choices[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(collect(c)) for c in choices]
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


Choice = tuple[int, TextChunk | RouteSummary]


async def merged(choices: Sequence[Events]) -> AsyncGenerator[Choice, None]:
    """The generations' events as they come, each with its generation's index; the first
    to fail ends them all (the others cancelled), with its own error."""
    if len(choices) == 1:  # no task of its own: the common case costs nothing more
        async with aclosing(choices[0]) as only:
            async for event in only:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TextChunk | RouteSummary | Exception | None]]
    queue = asyncio.Queue()

    async def pump(index: int, events: Events) -> None:
        try:
            async with aclosing(events) as stream:
                async for event in stream:
                    queue.put_nowait((index, event))
            queue.put_nowait((index, None))
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, events)) for i, events in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_text(piece: bytes) -> str:
    """A token's text (a piece that ends inside a character shows U+FFFD for it)."""
    return piece.decode("utf-8", errors="replace")


def logprob_json(logprob: TokenLogprob) -> dict[str, Any]:
    """A token's log probability and the most likely tokens', as OpenAI's chat and Ollama
    write them: token text, logprob, the token's bytes, top_logprobs."""

    def one(choice: TokenChoice) -> dict[str, Any]:
        return {
            "token": token_text(choice.piece),
            "logprob": choice.logprob,
            "bytes": list(choice.piece),
        }

    return {**one(logprob.chosen), "top_logprobs": [one(c) for c in logprob.top]}


async def checked_sampling(
    router: Router,
    sampling: Sampling,
    field: str,
    tools_field: str = "tools[{i}].function.parameters",
) -> Sampling:
    """The sampling, its response format's and tools' schemas checked off the event loop
    against the mesh's limits: InvalidArgument naming the door's `field` (a tool's:
    `tools_field`) and the keyword."""
    await check_format(sampling, router.schema_limits, field, tools_field)
    return sampling


def reasoning_effort(value: object, field: str) -> str:
    """A reasoning effort a request names ("low", "medium", "high"; None: "")."""
    if value is None:
        return ""
    if value not in REASONING_EFFORTS:
        raise InvalidArgument(
            field, f"must be one of {', '.join(map(repr, REASONING_EFFORTS))}, got {value!r}"
        )
    return str(value)


def mesh_fields(s: RouteSummary) -> dict[str, Any]:
    """Our metrics beside each API's own fields (durations in seconds)."""
    return {
        "method": s.method.value,
        "prefill_node": s.prefill_node,
        "decode_node": s.decode_node,
        "kv_transfer": s.kv_transfer.value,
        "cached_prompt_tokens": s.cached_prompt_tokens,
        "decode_cached_prompt_tokens": s.decode_cached_prompt_tokens,
        "kv_transfer_bytes": s.kv_transfer_bytes,
        "kv_transfer_seconds": s.kv_transfer_seconds,
        "kv_load_seconds": s.kv_load_seconds,
        "time_to_first_token_seconds": s.time_to_first_token_seconds,
        "failed_attempts": [
            {"method": f.method.value, "node": f.node, "code": f.code, "message": f.message}
            for f in s.failed_attempts
        ],
    }
