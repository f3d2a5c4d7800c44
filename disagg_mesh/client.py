"""Sync and asyncio clients of the router, over the generated stubs.

One channel per client, reused for every call. Errors come out as the small set of
exceptions in `errors.py`. `gather` runs several requests at once (the grader's two calls)
and returns their results in order; one failing request does not cancel the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import random
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from disagg_mesh.batch import BatchRequest, BatchResult, BatchRun, requests_from
from disagg_mesh.errors import MeshError, Unavailable, from_rpc_error
from disagg_mesh.metrics import Metrics
from disagg_mesh.proto.v1 import node_pb2, node_pb2_grpc, router_pb2, router_pb2_grpc, types_pb2
from disagg_mesh.routers import Routers

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 300.0
# Tokens per text delta for an answer read whole (generate, gather); the router's HTTP doors
# use the same for a request that does not stream.
WHOLE_ANSWER_INTERVAL_TOKENS = 16
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signed the router's certificate, and for mutual TLS our own."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same files for HTTPS (the routers' HTTP doors)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


@dataclass(frozen=True)
class GenerateCall:
    """One request: a prompt or chat messages (dicts with role and content; an assistant's
    tool_calls, a tool result's tool_call_id)."""

    model: str
    prompt: str = ""
    messages: Sequence[Mapping[str, Any]] = ()
    max_tokens: int = 512
    temperature: float | None = None  # None: the server's default (0.8); 0: greedy
    top_p: float | None = None
    seed: int | None = None  # None or -1 (Ollama's default): a random one
    stop: Sequence[str] = ()
    ignore_eos: bool = False  # end tokens never sampled: the answer runs to max_tokens
    timeout: float | None = None  # seconds; None: the client's
    # How hard a reasoning model (gpt-oss) thinks: "low", "medium" or "high"; None: its default.
    reasoning_effort: str | None = None
    # Structured output, as Ollama's `format`: "json" (any JSON object) or a JSON Schema
    # (a dict, e.g. a pydantic model's model_json_schema()); None: free text.
    format: str | Mapping[str, Any] | None = None
    # Tokens per text delta (the first token and the end go at once); None: 1 for stream(),
    # WHOLE_ANSWER_INTERVAL_TOKENS for generate() and gather(), which read the whole answer.
    stream_interval_tokens: int | None = None
    # Functions the model may call, in OpenAI's shape ({"type": "function", "function":
    # {"name", "description", "parameters"}}); the calls come back in Result.tool_calls
    # (stream(): ToolCallDelta items). tool_choice: "auto", "none", "required" or a
    # function's name.
    tools: Sequence[Mapping[str, Any]] = ()
    tool_choice: str = "auto"
    # Several calls in one answer; None: as the model's format does by default.
    parallel_tool_calls: bool | None = None
    # The candidates a sampled token comes from: the top_k most likely (0 or -1: any; None: 40),
    # none less likely than min_p times the most likely (None: 0.05).
    top_k: int | None = None
    min_p: float | None = None
    # Repetition penalties over the last repeat_last_n tokens of the prompt and answer (None:
    # 64; -1: the whole context), as llama-server's: repeat_penalty > 0 (None: 1.0, none),
    # frequency_penalty and presence_penalty in [-2, 2] (None: 0).
    repeat_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repeat_last_n: int | None = None
    # Token id -> bias in [-100, 100], added to its logit before any other sampling step
    # (OpenAI's logit_bias; embedded nodes only).
    logit_bias: Mapping[int, float] | None = None
    # Each token's log probability, and this many of the most likely tokens at its place
    # (0 to 20; Result.logprobs, stream()'s Logprobs items; gpt-oss: its answer's and its
    # calls' arguments' tokens); None: none. Embedded and Ollama (0.12.11+) nodes.
    logprobs: int | None = None
    # Messages too long for the node's context lose their oldest turns (the system messages
    # and the last turn kept) until they fit, as Ollama's /api/chat; False: INVALID_ARGUMENT.
    truncate_history: bool = False
    # Only the rendered prompt's last this many tokens are evaluated, as vLLM's
    # truncate_prompt_tokens (a chat's first turns go first); None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    # Fill in the middle: the prompt is the text before the gap (may be empty) and this the
    # text after it; the answer is what goes between. Models with FIM tokens (Qwen2.5-Coder,
    # Qwen3-Coder, ...); "": a plain prompt.
    suffix: str = ""

    def __post_init__(self) -> None:
        if (self.reasoning_effort or "") not in _EFFORTS:
            raise ValueError(
                f"reasoning_effort must be 'low', 'medium' or 'high', got {self.reasoning_effort!r}"
            )
        if not (self.format in (None, "json") or isinstance(self.format, Mapping)):
            raise ValueError(f'format must be "json" or a JSON Schema dict, got {self.format!r}')
        # What the wire's fields can hold (the router checks the ranges that make sense).
        for name in (
            "max_tokens",
            "top_k",
            "repeat_last_n",
            "logprobs",
            "stream_interval_tokens",
            "truncate_prompt_tokens",
        ):
            value = getattr(self, name)
            if value is not None and not -(2**31) <= value < 2**31:
                raise ValueError(f"{name} must fit in a 32-bit integer, got {value}")
        if self.seed is not None and not -1 <= self.seed < 2**32:
            raise ValueError(f"seed must be in 0..{2**32 - 1} (-1: random), got {self.seed}")
        for token in self.logit_bias or {}:
            if not 0 <= token < 2**31:
                raise ValueError(f"logit_bias: token ids must be in 0..{2**31 - 1}, got {token}")

    def _response_format(self) -> types_pb2.ResponseFormat | None:
        if self.format is None:
            return None
        if isinstance(self.format, Mapping):
            return types_pb2.ResponseFormat(
                type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
                json_schema=json.dumps(self.format),
            )
        return types_pb2.ResponseFormat(type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT)

    def to_proto(self) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(
            model=self.model,
            prompt=self.prompt,
            messages=[_message(m) for m in self.messages],
            sampling=types_pb2.SamplingParams(
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repeat_penalty=self.repeat_penalty,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                repeat_last_n=self.repeat_last_n,
                logit_bias=dict(self.logit_bias or {}),
                logprobs=self.logprobs,
                seed=None if self.seed == -1 else self.seed,
                stop=list(self.stop),
                ignore_eos=self.ignore_eos or None,
                response_format=self._response_format(),
                stream_interval_tokens=self.stream_interval_tokens,
                tools=self._tools(),
            ),
            reasoning_effort=_EFFORTS[self.reasoning_effort or ""],
            truncate_history=self.truncate_history,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            suffix=self.suffix,
        )

    def _tools(self) -> types_pb2.ToolSet | None:
        if not self.tools:
            return None
        choices = {
            "auto": types_pb2.TOOL_CHOICE_AUTO,
            "none": types_pb2.TOOL_CHOICE_NONE,
            "required": types_pb2.TOOL_CHOICE_REQUIRED,
        }
        definitions = []
        for tool in self.tools:
            function = tool.get("function", tool)
            parameters = function.get("parameters")
            definitions.append(
                types_pb2.ToolDefinition(
                    name=function.get("name", ""),
                    description=function.get("description", ""),
                    parameters_json_schema=json.dumps(parameters) if parameters else "",
                )
            )
        return types_pb2.ToolSet(
            definitions=definitions,
            choice=choices.get(self.tool_choice, types_pb2.TOOL_CHOICE_FUNCTION),
            function_name="" if self.tool_choice in choices else self.tool_choice,
            parallel_calls=self.parallel_tool_calls,
        )


def _message(m: Mapping[str, Any]) -> types_pb2.ChatMessage:
    """A chat message: role and content; an assistant's tool_calls (ToolCall or OpenAI's
    dicts) and a tool result's tool_call_id."""
    calls = []
    for call in m.get("tool_calls") or ():
        arguments: Any
        if isinstance(call, ToolCall):
            call_id, name, arguments = call.id, call.name, call.arguments
        else:
            function = call.get("function", call)
            call_id, name = call.get("id", ""), function["name"]
            arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(types_pb2.ToolCall(id=call_id, name=name, arguments_json=arguments))
    return types_pb2.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        tool_calls=calls,
        tool_call_id=m.get("tool_call_id", ""),
    )


_EFFORTS = {
    "": types_pb2.REASONING_EFFORT_UNSPECIFIED,
    "low": types_pb2.REASONING_EFFORT_LOW,
    "medium": types_pb2.REASONING_EFFORT_MEDIUM,
    "high": types_pb2.REASONING_EFFORT_HIGH,
}


class Reasoning(str):
    """A piece of the model's reasoning (gpt-oss's analysis channel), apart from the answer:
    what `stream(..., reasoning=True)` yields beside the answer's text."""


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call as stream() yields it: the first of a call has its id and
    name, the next ones pieces of its arguments' JSON; index places it among the calls."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability (natural log, under the model's distribution)
    and the most likely tokens at its place, most likely first (GenerateCall.logprobs)."""

    token_id: int  # -1 from an Ollama node (its server gives the text, not the id)
    text: str  # its bytes as text (a piece ending inside a character: U+FFFD for it)
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


class Logprobs(tuple[TokenLogprob, ...]):
    """The log probabilities of a delta's tokens: what stream() yields after the delta's
    text, when the call asked for them."""


@dataclass
class ToolCall:
    """A call the model made; send it back in the assistant message's tool_calls, with a
    {"role": "tool", "tool_call_id": id, "content": result} message after it. (The client
    needs no server code: the nodes' own ToolCall is services/common/tools/calls.py.)"""

    id: str
    name: str
    arguments: str = ""  # a JSON object's text

    def parsed_arguments(self) -> dict[str, Any]:
        value = json.loads(self.arguments or "{}")
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Result:
    text: str
    metrics: Metrics
    request_id: str = ""
    # The model's reasoning before its answer (gpt-oss); "" for other models.
    reasoning: str = ""
    # The tool calls it made (finish reason "tool_calls"), when the call offered tools.
    tool_calls: tuple[ToolCall, ...] = ()
    # Each token's log probability, when the call asked for them (GenerateCall.logprobs).
    logprobs: tuple[TokenLogprob, ...] = ()


DEFAULT_COOLDOWN_S = 30.0
# Times a call the mesh answered busy (RESOURCE_EXHAUSTED) is tried again, as it says when:
# the trailing metadata key the routers send (services/common/errors.py), milliseconds.
# Longest wait between tries of a call the mesh answered busy without saying when.
BUSY_BACKOFF_MAX_S = 10.0
RETRY_AFTER_KEY = "retry-after-ms"
# Requests a batch keeps in flight when the decode nodes' free slots cannot be read.
DEFAULT_BATCH_CONCURRENCY = 8


def router_addresses(address: str | Sequence[str]) -> tuple[str, ...]:
    """Router addresses from a list, or from one comma-separated string."""
    parts = address.split(",") if isinstance(address, str) else list(address)
    addresses = tuple(p.strip() for p in parts if p.strip())
    if not addresses:
        raise ValueError("no router address given")
    return addresses


def _fails_over(code: grpc.StatusCode) -> bool:
    """A router that cannot be reached, or whose stream broke (a dead or restarting
    router), is worth another router; any other error is the request's own."""
    return code == grpc.StatusCode.UNAVAILABLE


@dataclass
class _Progress:
    """What the caller has of one generation: enough to resume it through another router
    (GenerateRequest.continuation) with nothing repeated and nothing lost."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    resume: router_pb2.ResumeInfo | None = None
    failed_router: str = ""
    failed_at: float = 0.0
    # Each router failover: the failed router and the seconds until the next text.
    failovers: list[tuple[str, float]] = field(default_factory=list)

    def request(self, call: GenerateCall) -> router_pb2.GenerateRequest:
        request = call.to_proto()
        if self.tokens:
            c = request.continuation
            c.generated_token_ids.extend(self.token_ids)
            c.generated_text = "".join(self.text)
            c.generated_tokens = self.tokens
            if self.resume is not None:
                c.first_token_from_prefill = self.resume.first_token_from_prefill
                if self.resume.HasField("prompt_cached_tokens"):
                    c.prompt_cached_tokens = self.resume.prompt_cached_tokens
            request.resumed_from_router = self.failed_router
        return request

    def failed(self, address: str) -> None:
        self.failed_router, self.failed_at = address, time.monotonic()

    def take(self, reply: router_pb2.GenerateResponse) -> None:
        if reply.HasField("resume"):
            self.resume = reply.resume
        if reply.HasField("delta"):
            if self.failed_at:
                self.failovers.append((self.failed_router, time.monotonic() - self.failed_at))
                self.failed_at = 0.0
            ids = list(reply.delta.token_ids)
            self.token_ids += ids
            self.text.append(reply.delta.text)
            self.tokens += len(ids) or 1

    def metrics(self, summary: router_pb2.GenerateSummary) -> Metrics:
        """The summary's metrics, each router failover's resume time measured here: from
        the failure to the next text the caller got."""
        metrics = Metrics.from_summary(summary)
        seconds = dict(self.failovers)
        migrations = tuple(
            dataclasses.replace(m, resume_time=seconds[m.failed_node[len("router ") :]])
            if m.failed_node.startswith("router ") and m.failed_node[len("router ") :] in seconds
            else m
            for m in metrics.migrations
        )
        return dataclasses.replace(metrics, migrations=migrations)


def _open_generate(
    settings: _Settings,
    routers: Routers,
    stubs: dict[str, Any],
    call: GenerateCall,
    progress: _Progress,
    deadline: float,
) -> tuple[str, Any]:
    """The next attempt of a call: the first router in order, the request with what the
    caller already has, and the time left of the call's deadline."""
    address = routers.order()[0]
    rpc = stubs[address].Generate(
        progress.request(call),
        timeout=max(deadline - time.monotonic(), 0.001),
        metadata=settings.metadata,
    )
    return address, rpc


def _busy_wait(exc: grpc.RpcError, progress: _Progress, busy: int, deadline: float) -> float | None:
    """Seconds to wait before trying a call the mesh answered busy (RESOURCE_EXHAUSTED:
    every slot and queue place taken, or a queue that would outlast the call) before any
    text came: the router's retry-after (trailing metadata), else an exponential backoff;
    None when not busy, or when the wait would pass the call's deadline (busy calls are
    tried again as long as the deadline allows: nothing is lost to a burst)."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or progress.tokens:
        return None
    call: Any = exc  # a grpc.Call too (typeshed cannot say so)
    trailer = call.trailing_metadata() if hasattr(call, "trailing_metadata") else ()
    said = dict(trailer or ()).get(RETRY_AFTER_KEY)
    if isinstance(said, str) and said.isdigit():
        wait = int(said) / 1000
    else:
        wait = min(0.25 * 2 ** min(busy, 16), BUSY_BACKOFF_MAX_S)
    wait *= random.uniform(1.0, 1.25)  # callers told the same do not come back at once
    return wait if time.monotonic() + wait < deadline else None


def _fail_over(
    exc: grpc.RpcError, routers: Routers, address: str, attempts: int, progress: _Progress
) -> None:
    """Set the router aside and go on through another, or raise the call's error."""
    code: grpc.StatusCode = exc.code()
    if not (_fails_over(code) and routers.may_fail_over(attempts)):
        raise from_rpc_error(exc, address) from None
    routers.failed(address)
    progress.failed(address)


@dataclass
class _Settings:
    addresses: tuple[str, ...]
    timeout: float
    tls: TlsFiles | None
    token: str | None
    metadata: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.token:
            self.metadata = (("authorization", f"Bearer {self.token}"),)


def _call(
    model: str | GenerateCall,
    prompt: str,
    kwargs: dict[str, Any],
) -> GenerateCall:
    return (
        model
        if isinstance(model, GenerateCall)
        else GenerateCall(model=model, prompt=prompt, **kwargs)
    )


def _whole(model: str | GenerateCall, prompt: str, kwargs: dict[str, Any]) -> GenerateCall:
    """The call for an answer read whole: text in deltas of WHOLE_ANSWER_INTERVAL_TOKENS
    unless the call says otherwise (fewer messages through the mesh, nothing lost)."""
    call = _call(model, prompt, kwargs)
    if call.stream_interval_tokens is not None:
        return call
    return dataclasses.replace(call, stream_interval_tokens=WHOLE_ANSWER_INTERVAL_TOKENS)


Item = str | Metrics | ToolCallDelta | Logprobs


def _items(reply: router_pb2.GenerateResponse, reasoning: bool, progress: _Progress) -> list[Item]:
    progress.take(reply)
    if not reply.HasField("delta"):
        return [progress.metrics(reply.summary)]
    delta = reply.delta
    thought = [Reasoning(delta.reasoning)] if reasoning and delta.reasoning else []
    calls = [ToolCallDelta(d.index, d.id, d.name, d.arguments_json) for d in delta.tool_calls]
    scores = [Logprobs(_logprob(lp.chosen, lp.top) for lp in delta.logprobs)]
    scores = scores if delta.logprobs else []
    if (thought or calls or scores) and not delta.text:
        return [*thought, *calls, *scores]
    return [*thought, delta.text, *calls, *scores]


def _logprob(chosen: types_pb2.TokenChoice, top: Iterable[types_pb2.TokenChoice]) -> TokenLogprob:
    return TokenLogprob(
        chosen.token_id,
        chosen.piece.decode("utf-8", errors="replace"),
        chosen.logprob,
        tuple(_logprob(c, ()) for c in top),
    )


class _Collector:
    """Builds a Result from a stream's items."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, ToolCall] = {}
        self.logprobs: list[TokenLogprob] = []
        self.metrics: Metrics | None = None

    def add(self, item: Item) -> None:
        if isinstance(item, Metrics):
            self.metrics = item
        elif isinstance(item, Logprobs):
            self.logprobs.extend(item)
        elif isinstance(item, ToolCallDelta):
            if item.name:
                self.calls[item.index] = ToolCall(item.id, item.name)
            self.calls[item.index].arguments += item.arguments
        elif isinstance(item, Reasoning):
            self.reasoning.append(item)
        else:
            self.parts.append(item)

    def result(self, address: str) -> Result:
        if self.metrics is None:
            raise MeshError(grpc.StatusCode.DATA_LOSS, "stream ended without metrics", address)
        return Result(
            "".join(self.parts),
            self.metrics,
            reasoning="".join(self.reasoning),
            tool_calls=tuple(self.calls[i] for i in sorted(self.calls)),
            logprobs=tuple(self.logprobs),
        )


class _Client:
    """What both clients hold: the settings, the routers' order and a channel and stub per
    router (`_channels`: grpc, or grpc.aio for the asyncio client)."""

    _channels_module: Any = grpc

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float,
        tls: TlsFiles | None,
        token: str | None,
        cooldown: float,
    ) -> None:
        self._settings = _Settings(router_addresses(address), timeout, tls, token)
        self._routers = Routers(self._settings.addresses, cooldown)
        self._channels = {a: self._open(a) for a in self._settings.addresses}
        self._stubs: dict[str, Any] = {
            a: router_pb2_grpc.RouterServiceStub(c) for a, c in self._channels.items()
        }

    def _open(self, address: str) -> Any:
        tls, channels = self._settings.tls, self._channels_module
        if tls is not None:
            return channels.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS)
        return channels.insecure_channel(address, options=CHANNEL_OPTIONS)


class AsyncMeshClient(_Client):
    """asyncio client. Use `async with AsyncMeshClient(...) as mesh:` or call close().

    address: one router, or several (a list, or one comma-separated string). A call that
    cannot reach a router goes to the next; a stream that breaks after text was delivered
    resumes through another router, which goes on as a migration does (nothing repeated,
    nothing lost); a router that failed is set aside for `cooldown` seconds. idle_timeout:
    a router that sends nothing for this many seconds once its stream has started is taken
    for hung (SIGSTOP, a frozen machine) and left for another; before the first text, and
    with None, the call's own deadline applies."""

    _channels_module = grpc.aio

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TlsFiles | None = None,
        token: str | None = None,
        idle_timeout: float | None = None,
        cooldown: float = DEFAULT_COOLDOWN_S,
    ) -> None:
        super().__init__(address, timeout, tls, token, cooldown)
        self._idle_timeout = idle_timeout

    async def __aenter__(self) -> AsyncMeshClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def stream(
        self, model: str | GenerateCall, prompt: str = "", reasoning: bool = False, **kwargs: Any
    ) -> AsyncIterator[Item]:
        """Text deltas as they arrive, then the Metrics. reasoning: the model's reasoning
        too, as `Reasoning` pieces (a str subclass) before the answer's; with
        GenerateCall.logprobs, each delta's tokens' as a `Logprobs` after its text."""
        call = _call(model, prompt, kwargs)
        s = self._settings
        deadline = time.monotonic() + (call.timeout or s.timeout)
        progress = _Progress()
        attempts = busy = 0
        while True:
            attempts += 1
            address, rpc = _open_generate(s, self._routers, self._stubs, call, progress, deadline)
            try:
                replies = 0
                while True:
                    reply = await self._next(rpc, address, bool(replies))
                    if reply is None:
                        break
                    replies += 1
                    for item in _items(reply, reasoning, progress):
                        yield item
                self._routers.succeeded(address)
                return
            except grpc.aio.AioRpcError as exc:
                wait = _busy_wait(exc, progress, busy, deadline)
                if wait is None:
                    _fail_over(exc, self._routers, address, attempts - busy, progress)
                else:  # the mesh is busy: the same call again when it says, no failover
                    busy += 1
                    await asyncio.sleep(wait)
            finally:
                rpc.cancel()

    async def _next(
        self, rpc: Any, address: str, started: bool
    ) -> router_pb2.GenerateResponse | None:
        """The stream's next reply (None at its end). Once a stream has started, a router
        silent for longer than the idle timeout counts as unreachable; before its first
        reply, only the call's deadline applies (evaluating a long prompt takes long)."""
        try:
            idle = self._idle_timeout if started else None
            reply = await asyncio.wait_for(rpc.read(), idle)
        except TimeoutError:
            raise _IdleRouter(address, self._idle_timeout or 0.0) from None
        if reply is grpc.aio.EOF:
            return None
        return reply  # type: ignore[no-any-return]

    async def generate(self, model: str | GenerateCall, prompt: str = "", **kwargs: Any) -> Result:
        """The whole text and its metrics."""
        collector = _Collector()
        async for item in self.stream(_whole(model, prompt, kwargs), reasoning=True):
            collector.add(item)
        return collector.result(",".join(self._settings.addresses))

    async def gather(
        self, *calls: GenerateCall, cancel_on_error: bool = False
    ) -> list[Result | MeshError]:
        """Run calls at once; results in order. A failed call's slot holds its MeshError,
        unless cancel_on_error, which cancels the others and raises the first error."""
        if cancel_on_error:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self.generate(c)) for c in calls]
            except BaseExceptionGroup as errors:
                raise errors.exceptions[0] from None
            return [t.result() for t in tasks]
        results = await asyncio.gather(*(self.generate(c) for c in calls), return_exceptions=True)
        out: list[Result | MeshError] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, MeshError):
                raise r
            out.append(r)
        return out

    async def batch(
        self,
        requests: Iterable[BatchRequest | Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        validate: bool = True,
    ) -> AsyncIterator[BatchResult]:
        """Run many requests, each result as it completes (BatchResult: its custom_id, HTTP
        status and the endpoint's whole answer). requests: BatchRequest, or dicts shaped as
        OpenAI's batch lines ({"custom_id", "url", "body"}; see disagg_mesh.batch).
        validate: a router checks every request before any runs (BatchInputError lists
        those it refused). concurrency: requests at once; None fills the free slots of the
        decode nodes serving the batch's models."""
        run = await self.batch_run(requests, concurrency=concurrency)
        if validate:
            await run.validate()
        async for result in run.results():
            yield result

    async def batch_run(
        self,
        requests: Iterable[BatchRequest | Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        group_prefixes: bool = True,
    ) -> BatchRun:
        """A batch ready to run through the routers' HTTP doors (as `batch`, for a caller
        that shows its progress: BatchRun.in_flight, BatchRun.results())."""
        items = requests_from(requests)
        doors, decode_nodes = await self._batch_doors()
        per_model: dict[str, int] = {}
        if concurrency is None:
            # Each model as many at once as its decode nodes have free slots: one gate for
            # all would fill with the slower model's requests, waiting at the router for
            # its nodes while the other model's nodes idle.
            for model in sorted({r.model for r in items}):
                free = await self._free_slots(sorted(decode_nodes.get(model, ())))
                per_model[model] = free or DEFAULT_BATCH_CONCURRENCY
            concurrency = sum(per_model.values())
        s = self._settings
        return BatchRun(
            items,
            Routers(tuple(doors), self._routers.cooldown_s),
            concurrency,
            headers={k.title(): v for k, v in s.metadata},
            ssl_context=s.tls.ssl_context() if s.tls else None,
            timeout_s=s.timeout,
            group_prefixes=group_prefixes,
            model_concurrency=per_model,
        )

    async def _batch_doors(self) -> tuple[list[str], dict[str, list[str]]]:
        """Each reachable router's HTTP door, in order, and each model's decode nodes."""
        doors: list[str] = []
        decode_nodes: dict[str, list[str]] = {}
        unreachable: list[str] = []
        for address in self._routers.order():
            try:
                reply = await self._stubs[address].ListModels(
                    router_pb2.ListModelsRequest(), timeout=10, metadata=self._settings.metadata
                )
            except grpc.aio.AioRpcError as exc:
                if not _fails_over(exc.code()):
                    raise from_rpc_error(exc, address) from None
                unreachable.append(address)
                continue
            if reply.http_url:
                doors.append(reply.http_url)
            for m in reply.models:
                decode_nodes.setdefault(m.model, [n.address for n in m.decode_nodes])
        if not doors:
            why = (
                f"no router reachable ({', '.join(unreachable)})"
                if len(unreachable) == len(self._settings.addresses)
                else "no router serves an HTTP door: set http_port on the router in the topology"
            )
            raise Unavailable(grpc.StatusCode.UNAVAILABLE, why, ",".join(self._settings.addresses))
        return doors, decode_nodes

    async def _free_slots(self, addresses: Sequence[str]) -> int:
        """Free slots of these nodes now (GetNodeInfo), those that answer; 0 if none do."""

        async def free(address: str) -> int:
            async with self._open(address) as channel:
                stub: Any = node_pb2_grpc.NodeServiceStub(channel)
                try:
                    info = await stub.GetNodeInfo(
                        node_pb2.GetNodeInfoRequest(), timeout=5, metadata=self._settings.metadata
                    )
                except grpc.aio.AioRpcError:
                    return 0
                return max(int(info.slots) - int(info.slots_busy), 0)

        return sum(await asyncio.gather(*(free(a) for a in addresses)))

    async def list_models(self) -> list[router_pb2.ModelRoute]:
        s = self._settings
        for attempt, address in enumerate(self._routers.order(), 1):
            try:
                reply = await self._stubs[address].ListModels(
                    router_pb2.ListModelsRequest(), timeout=10, metadata=s.metadata
                )
            except grpc.aio.AioRpcError as exc:
                if not _fails_over(exc.code()) or attempt == len(s.addresses):
                    raise from_rpc_error(exc, address) from None
                self._routers.failed(address)
                continue
            return list(reply.models)
        raise AssertionError("unreachable: a client has at least one router")


class MeshClient(_Client):
    """Blocking client. Use `with MeshClient(...) as mesh:` or call close(). Several router
    addresses fail over as with AsyncMeshClient (a hung router: at the call's deadline, as
    the blocking stream has no idle timeout)."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TlsFiles | None = None,
        token: str | None = None,
        cooldown: float = DEFAULT_COOLDOWN_S,
    ) -> None:
        super().__init__(address, timeout, tls, token, cooldown)

    def __enter__(self) -> MeshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def stream(
        self, model: str | GenerateCall, prompt: str = "", reasoning: bool = False, **kwargs: Any
    ) -> Iterator[Item]:
        """Text deltas as they arrive, then the Metrics. reasoning: the model's reasoning
        too, as `Reasoning` pieces (a str subclass) before the answer's; with
        GenerateCall.logprobs, each delta's tokens' as a `Logprobs` after its text."""
        call = _call(model, prompt, kwargs)
        s = self._settings
        deadline = time.monotonic() + (call.timeout or s.timeout)
        progress = _Progress()
        attempts = busy = 0
        while True:
            attempts += 1
            address, rpc = _open_generate(s, self._routers, self._stubs, call, progress, deadline)
            try:
                for reply in rpc:
                    yield from _items(reply, reasoning, progress)
                self._routers.succeeded(address)
                return
            except grpc.RpcError as exc:
                wait = _busy_wait(exc, progress, busy, deadline)
                if wait is None:
                    _fail_over(exc, self._routers, address, attempts - busy, progress)
                else:  # the mesh is busy: the same call again when it says, no failover
                    busy += 1
                    time.sleep(wait)
            finally:
                rpc.cancel()

    def generate(self, model: str | GenerateCall, prompt: str = "", **kwargs: Any) -> Result:
        """The whole text and its metrics."""
        collector = _Collector()
        for item in self.stream(_whole(model, prompt, kwargs), reasoning=True):
            collector.add(item)
        return collector.result(",".join(self._settings.addresses))

    def gather(self, *calls: GenerateCall) -> list[Result | MeshError]:
        """Run calls at once on threads; results in order, a failed call's slot holds its
        MeshError (the others go on)."""

        def one(call: GenerateCall) -> Result | MeshError:
            try:
                return self.generate(call)
            except MeshError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=max(len(calls), 1)) as pool:
            return list(pool.map(one, calls))

    def batch(
        self,
        requests: Iterable[BatchRequest | Mapping[str, Any]],
        *,
        concurrency: int | None = None,
        validate: bool = True,
    ) -> Iterator[BatchResult]:
        """As AsyncMeshClient.batch, each result as it completes (the batch runs on a thread
        of its own; leaving the loop early cancels what is in flight)."""
        s = self._settings
        items: queue.Queue[BatchResult | BaseException | None] = queue.Queue()
        loop = asyncio.new_event_loop()

        async def run() -> None:
            async with AsyncMeshClient(
                s.addresses,
                timeout=s.timeout,
                tls=s.tls,
                token=s.token,
                cooldown=self._routers.cooldown_s,
            ) as mesh:
                async for result in mesh.batch(
                    requests, concurrency=concurrency, validate=validate
                ):
                    items.put(result)

        task = loop.create_task(run())

        def worker() -> None:
            try:
                loop.run_until_complete(task)
                items.put(None)
            except BaseException as exc:  # handed to the caller's thread
                items.put(exc)
            finally:
                loop.close()

        thread = threading.Thread(target=worker, name="disagg-batch", daemon=True)
        thread.start()
        try:
            while (item := items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if thread.is_alive():
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop had just finished
                    pass
                thread.join()

    def list_models(self) -> list[router_pb2.ModelRoute]:
        s = self._settings
        for attempt, address in enumerate(self._routers.order(), 1):
            try:
                reply = self._stubs[address].ListModels(
                    router_pb2.ListModelsRequest(), timeout=10, metadata=s.metadata
                )
            except grpc.RpcError as exc:
                code: grpc.StatusCode = exc.code()
                if not _fails_over(code) or attempt == len(s.addresses):
                    raise from_rpc_error(exc, address) from None
                self._routers.failed(address)
                continue
            return list(reply.models)
        raise AssertionError("unreachable: a client has at least one router")


class _IdleRouter(grpc.aio.AioRpcError):
    """A router that sent nothing for longer than the client's idle timeout."""

    def __init__(self, address: str, seconds: float) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"router {address} sent nothing for {seconds:g} s (idle timeout)",
        )
