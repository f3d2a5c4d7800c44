"""Ollama (the `ollama` package's AsyncClient): the engine for the user's machines.

What Ollama's HTTP API can and cannot do for disaggregation:
- It exposes no KV cache. `/api/generate` returns `context`, a list of token ids, not KV
  state. Given `context`, a server detokenizes it and evaluates it again in full; only its
  own prefix cache can save work. So an Ollama prefill node hands over token ids
  (`KvTransferKind.TOKEN_IDS`) and the decode node's prompt evaluation is reported.
- `num_predict: 1` evaluates the whole prompt and samples one token (`0` is not
  "prefill only"). `/api/chat` returns no `context`, so chat messages cannot be handed over:
  the prefill node refuses them (FAILED_PRECONDITION) and the router's chain moves on.
- Every `*_duration` is nanoseconds; `prompt_eval_count` counts cached tokens too.
- Errors: an HTTP error is `ResponseError` with `.status_code`; an `{"error": …}` line
  mid-stream is `ResponseError` with status -1; an unreachable server is `ConnectionError`,
  or a raw `httpx.ConnectError` on a stream's first read; timeouts are raw httpx timeouts.
  `_mapped_errors` turns each into the mesh's errors, in one place.
- Closing a stream stops generation on the server: the caller's cancellation closes it.
- What the model can do (`capabilities`: completion, tools, insert, thinking) and its sizes
  come from `/api/show`, asked once per model digest; an older server without
  `capabilities` leaves them unknown, and Ollama itself refuses what its model cannot do.
- Log probabilities (Ollama 0.12.11 and later: `logprobs`, `top_logprobs`): each streamed
  line's `logprobs` holds its tokens' entries (text and log probability, no token id). An
  older server ignores the fields: a reply with text and no entries is refused.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from array import array
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import ollama
import structlog

from disagg_mesh.server.common.engines.base import (
    BusyTime,
    EngineLoad,
    Generation,
    Placement,
    PrefillOutput,
    TokenRates,
)
from disagg_mesh.server.common.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from disagg_mesh.server.common.tools import formats
from disagg_mesh.server.common.tools.calls import ArgumentsPiece, CallStart, Piece, new_call_id
from disagg_mesh.server.common.tools.requests import ToolRequest
from disagg_mesh.server.common.types import (
    ChatTurn,
    Continuation,
    DecodeCandidate,
    Fingerprint,
    FinishReason,
    GenerationEnd,
    KvReference,
    KvTransferKind,
    ModelFacts,
    Prompt,
    ResponseFormat,
    Sampling,
    StageLimits,
    TextChunk,
    TokenChoice,
    TokenLogprob,
)

ENGINE_VERSION = "ollama"
# Renders the new part of a request as nothing, so the prompt is exactly the detokenized
# `context`: the decode node continues the prefill node's text instead of a new chat turn.
CONTINUE_TEMPLATE = "{{ .Prompt }}"
NS = 1e9
_NO_STATE_CONTINUATION = (
    "an Ollama node cannot take a continuation with a KV state (continuation with kv, or "
    "PrefillRequest.continuation): Ollama moves token ids, not KV; give the decode node "
    "the continuation with the prompt instead"
)
_NO_CONSTRAINED_HANDOFF = (
    "an Ollama node cannot go on with a structured-output (response_format) generation "
    "another node started: Ollama would start its grammar again from the handed-over text; "
    "the generation runs whole on one node (decode_only, direct_ollama)"
)
# Ollama gives a token's text, not its id.
UNKNOWN_TOKEN_ID = -1
# Ollama's 400 for a capability its model lacks ("... does not support insert"; CheckCapabilities
# in its server/images.go, and routes.go's for thinking): the request field that asked for it.
_CAPABILITY_FIELDS = {"insert": "suffix", "tools": "tools", "thinking": "reasoning_effort"}

log = structlog.get_logger("engine")


class OllamaEngine:
    kv_transfer = KvTransferKind.TOKEN_IDS

    def __init__(
        self,
        url: str,
        model: str,
        n_ctx: int,
        max_in_flight: int,
        keep_alive: str = "30m",
        timeout_s: float = 120.0,
    ) -> None:
        self.url = url
        self.model = model
        self.n_ctx = n_ctx
        self.keep_alive = keep_alive
        self._client = ollama.AsyncClient(host=url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._busy_time = BusyTime()
        self._rates = TokenRates()
        # The model's digest is learned from the server (problem() refreshes it).
        self.fingerprint = Fingerprint("", n_ctx, ENGINE_VERSION)
        # Ollama places the model itself (its /api/ps tells how much sits in VRAM).
        self.placement = Placement()
        # What /api/tags and /api/show say of the model (problem() refreshes it; /api/show
        # is asked again only when the model's digest changes).
        self.model_facts = ModelFacts()
        self._shown: tuple[str, ModelFacts] = ("", ModelFacts())
        self.loaded_in_memory = False

    # -- health ----------------------------------------------------------------------------

    async def problem(self) -> str | None:
        try:
            async with self._mapped_errors():
                tags = await self._client.list()
                running = await self._client.ps()
        except MeshError as exc:
            return exc.message
        entry = next((m for m in tags.models if m.model == self.model), None)
        if entry is None or entry.digest is None:
            return (
                f"model {self.model!r} is not on the Ollama server at {self.url} "
                f"(ollama pull {self.model})"
            )
        self.fingerprint = Fingerprint(entry.digest, self.n_ctx, ENGINE_VERSION)
        if self._shown[0] != entry.digest:
            self._shown = (entry.digest, await self._show())
        details = entry.details
        self.model_facts = replace(
            self._shown[1],
            architecture=(details.family if details else None) or "",
            parameter_size=(details.parameter_size if details else None) or "",
            quantization=(details.quantization_level if details else None) or "",
            file_size_bytes=entry.size or 0,
        )
        self.loaded_in_memory = any(m.model == self.model for m in running.models)
        return None

    async def _show(self) -> ModelFacts:
        """What /api/show says the model can do and its GGUF's sizes; empty where the server
        cannot say (an older one has no `capabilities`), which the health check survives."""
        try:
            async with self._mapped_errors():
                shown = await self._client.show(self.model)
        except (MeshError, ValueError) as exc:  # ValueError: pydantic's, a reply unlike Ollama's
            log.warning("ollama show failed", node_url=self.url, model=self.model, error=str(exc))
            return ModelFacts()
        info = shown.modelinfo or {}
        arch = str(info.get("general.architecture") or "")

        def number(key: str) -> int:
            value = info.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        return ModelFacts(
            parameter_count=number("general.parameter_count"),
            trained_context_tokens=number(f"{arch}.context_length"),
            embedding_length=number(f"{arch}.embedding_length"),
            capabilities=tuple(shown.capabilities or ()),
            template=shown.template or "",
        )

    # -- prefill ---------------------------------------------------------------------------

    async def prefill(
        self,
        prompt: Prompt,
        sampling: Sampling,
        candidates: Sequence[DecodeCandidate] = (),
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> PrefillOutput:
        """Ollama exposes no KV cache: its token ids always move whole (candidates unused).
        Nor its queue: limits are left to the call's deadline, which covers both."""
        self._check_prompt(prompt)
        if continuation is not None:
            raise FailedPrecondition(_NO_STATE_CONTINUATION)
        if sampling.response_format is not None:
            raise FailedPrecondition(_NO_CONSTRAINED_HANDOFF)
        if prompt.messages:
            raise FailedPrecondition(
                "an Ollama prefill node cannot hand over chat messages: Ollama's chat API "
                "returns no context; route this model with decode_only"
            )
        started = time.perf_counter()
        async with self._admitted(), self._mapped_errors():
            reply = await self._client.generate(
                model=self.model,
                prompt=prompt.text,
                suffix=prompt.suffix,
                options=self._options(sampling, num_predict=1),
                keep_alive=self.keep_alive,
                **_logprob_fields(sampling),
            )
        self._rates.add(reply.prompt_eval_count or 0, reply.eval_count or 0)
        ids = list(reply.context or [])
        if not ids:
            raise Unavailable(f"Ollama at {self.url} returned no context for the prompt")
        first_logprobs = self._logprobs(sampling, reply, bool(reply.response))
        state = memoryview(_ids_to_bytes(ids))
        return PrefillOutput(
            kv_state=state,
            kv_sha256=hashlib.sha256(state).hexdigest(),
            first_token_id=ids[-1],
            first_token_text=reply.response or "",
            first_token_logprobs=tuple(first_logprobs[:1]),
            prompt_tokens=reply.prompt_eval_count or 0,
            prefill_seconds=time.perf_counter() - started,
        )

    # -- decode ----------------------------------------------------------------------------

    async def continue_from_state(
        self,
        kv_state: memoryview,
        reference: KvReference,
        sampling: Sampling,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> Generation:
        """limits: left to the call's deadline (Ollama's queue is not visible)."""
        if continuation is not None:
            raise FailedPrecondition(_NO_STATE_CONTINUATION)
        ids = _bytes_to_ids(kv_state)
        completion = 0
        if reference.first_token_text:
            completion = 1
            yield TextChunk(
                text=reference.first_token_text,
                logprobs=list(reference.first_token_logprobs[:1]),
            )
        if sampling.max_tokens <= completion:
            yield GenerationEnd(
                completion, FinishReason.LENGTH, prompt_tokens=reference.prompt_tokens
            )
            return
        async with self._admitted():
            async for item in self._stream(
                self._client.generate(
                    model=self.model,
                    prompt="",
                    context=ids,
                    template=CONTINUE_TEMPLATE,
                    options=self._options(sampling, num_predict=sampling.max_tokens - completion),
                    keep_alive=self.keep_alive,
                    stream=True,
                    **_logprob_fields(sampling),
                ),
                sampling,
                already=completion,
            ):
                yield item

    async def generate(
        self,
        prompt: Prompt,
        sampling: Sampling,
        continuation: Continuation | None = None,
        limits: StageLimits | None = None,
    ) -> Generation:
        """A whole generation; with a continuation, the rest of one another node started:
        raw /api/generate of the prompt text plus the generated text when the prompt had no
        chat template, else /api/chat with the generated text as an open assistant turn
        (Ollama's template renders the turns as for the original request and leaves the
        last assistant turn open, so the model continues it). limits: as
        continue_from_state's."""
        self._check_prompt(prompt)
        if continuation is not None and sampling.response_format is not None:
            raise FailedPrecondition(_NO_CONSTRAINED_HANDOFF)
        if continuation is not None and prompt.suffix:
            raise FailedPrecondition(
                f"an Ollama node (at {self.url}) cannot go on with a fill-in-the-middle answer "
                "another node began: Ollama frames the suffix with its template, which a raw "
                "prompt cannot reach"
            )
        already = 0 if continuation is None else continuation.generated_tokens
        left = sampling.max_tokens - already
        if left <= 0:
            yield GenerationEnd(already, FinishReason.LENGTH)
            return
        options = self._options(sampling, num_predict=left)
        tools = _ollama_tools(sampling.tools)
        if tools and continuation is not None:
            raise FailedPrecondition(
                f"an Ollama node (at {self.url}) cannot go on with an answer that may call "
                "tools: Ollama would parse its calls from the handed-over text again"
            )
        if tools and not prompt.messages:
            raise InvalidArgument("tools", "need chat messages, not prompt text")
        turns = [_ollama_turn(m, prompt.messages) for m in prompt.messages]
        text = prompt.text
        if continuation is not None:
            if continuation.raw_prompt and not turns:
                text += continuation.generated_text
            else:
                turns = turns or [{"role": "user", "content": prompt.text}]
                if prompt.continues_last_turn:  # that message goes on, still open
                    turns[-1]["content"] += continuation.generated_text
                else:
                    turns.append({"role": "assistant", "content": continuation.generated_text})
        request: Any
        # gpt-oss's reasoning effort is Ollama's `think` level; unset, Ollama's default.
        think: Any = prompt.reasoning_effort or None
        fmt = ollama_format(sampling.response_format)
        async with self._admitted():
            if turns:
                request = self._client.chat(
                    model=self.model,
                    messages=turns,
                    tools=tools,
                    options=options,
                    keep_alive=self.keep_alive,
                    stream=True,
                    think=think,
                    format=fmt,
                    **_logprob_fields(sampling),
                )
            else:
                request = self._client.generate(
                    model=self.model,
                    prompt=text,
                    suffix=prompt.suffix,
                    raw=continuation is not None,
                    options=options,
                    keep_alive=self.keep_alive,
                    stream=True,
                    format=fmt,
                    **_logprob_fields(sampling),
                )
            async for item in self._stream(request, sampling, already=already):
                yield item

    async def _stream(self, request: Any, sampling: Sampling, already: int) -> Generation:
        """Relay an NDJSON stream of /api/generate or /api/chat as chunks, then the end."""
        async with self._mapped_errors():
            parts: AsyncIterator[Any] = await request
            calls = 0
            answered = False  # text sent
            try:
                async for part in parts:
                    message = part if hasattr(part, "response") else part.message
                    text = part.response if message is part else message.content
                    # A thinking model's reasoning (gpt-oss), apart from the answer.
                    thinking = message.thinking or ""
                    # Ollama parses a model's calls itself and sends each one whole.
                    pieces: list[Piece] = []
                    for call in (getattr(message, "tool_calls", None) or []) if message else []:
                        arguments = json.dumps(dict(call.function.arguments or {}))
                        pieces.append(CallStart(calls, new_call_id(), call.function.name))
                        pieces.append(ArgumentsPiece(calls, arguments))
                        calls += 1
                    # The answer's tokens' (a line of reasoning alone has its own: not read).
                    logprobs = (
                        self._logprobs(sampling, part, bool(text) and not answered)
                        if text or not thinking
                        else []
                    )
                    answered = answered or bool(text)
                    if text or thinking or pieces or logprobs:
                        yield TextChunk(
                            text=text or "",
                            reasoning=thinking,
                            tool_calls=pieces,
                            logprobs=logprobs,
                        )
                    if part.done:
                        self._rates.add(part.prompt_eval_count or 0, part.eval_count or 0)
                        yield GenerationEnd(
                            completion_tokens=already + (part.eval_count or 0),
                            finish_reason=(
                                FinishReason.LENGTH
                                if part.done_reason == "length"
                                else FinishReason.STOP
                            ).with_calls(calls > 0),
                            prompt_tokens=part.prompt_eval_count or 0,
                            # The decode side's own prompt evaluation: with token ids
                            # this is the prefill done again.
                            prompt_eval_seconds=(part.prompt_eval_duration or 0) / NS,
                            decode_seconds=(part.eval_duration or 0) / NS,
                        )
                        return
            finally:
                # Closing the response stops generation on the Ollama server.
                aclose = getattr(parts, "aclose", None)
                if aclose is not None:
                    await aclose()
        raise Unavailable(f"Ollama at {self.url} ended the stream without its final message")

    def load(self) -> EngineLoad:
        """Requests in flight to Ollama (its own parallelism is OLLAMA_NUM_PARALLEL on the
        server), and tokens per second from its replies' counts."""
        prompt_tps, decode_tps = self._rates.per_second()
        busy_s, slot_busy_s = self._busy_time.totals()
        return EngineLoad(
            slots=self._max_in_flight,
            slots_busy=self._in_flight,
            queue_depth=0,
            max_queue=0,
            prompt_tokens_per_second=prompt_tps,
            decode_tokens_per_second=decode_tps,
            busy_seconds=busy_s,
            slot_busy_seconds=slot_busy_s,
        )

    # -- helpers ---------------------------------------------------------------------------

    def _logprobs(self, sampling: Sampling, reply: Any, first_text: bool) -> list[TokenLogprob]:
        """A reply's (or streamed line's) log probabilities, when the request asked for them;
        FailedPrecondition when its first text came without any (an Ollama older than
        0.12.11 ignores the request's fields)."""
        if sampling.logprobs is None:
            return []
        entries = reply.logprobs or []
        if first_text and not entries:
            raise FailedPrecondition(
                f"sampling.logprobs: the Ollama server at {self.url} returned no log "
                "probabilities (they need Ollama 0.12.11 or later); upgrade it, or route the "
                "model to embedded llama.cpp nodes"
            )
        return [
            TokenLogprob(
                _choice(entry),
                tuple(_choice(top) for top in (entry.top_logprobs or ())[: sampling.logprobs]),
            )
            for entry in entries
        ]

    def _check_prompt(self, prompt: Prompt) -> None:
        if prompt.suffix and not prompt.text:
            raise InvalidArgument(
                "prompt",
                f"must hold the text before the gap for the Ollama engine at {self.url} to "
                "fill in the middle (Ollama answers an empty prompt by loading the model)",
            )
        if prompt.truncate_prompt_tokens:
            raise InvalidArgument(
                "truncate_prompt_tokens",
                f"is not supported by the Ollama engine at {self.url} (Ollama has no such "
                "option); route the model to embedded llama.cpp nodes",
            )

    def _options(self, sampling: Sampling, num_predict: int) -> dict[str, Any]:
        if sampling.tools is not None and sampling.tools.forced:
            raise FailedPrecondition(
                f'tool_choice: Ollama (at {self.url}) has no tool_choice, so "required" or a '
                "named function cannot be held to; use auto, or route the model to embedded "
                "llama.cpp nodes"
            )
        unsupported = (
            ("ignore_eos", sampling.ignore_eos, "Ollama has no such option"),
            ("logit_bias", bool(sampling.logit_bias), "Ollama has no such option"),
        )
        for name, asked, why in unsupported:
            if asked:
                raise InvalidArgument(
                    f"sampling.{name}",
                    f"is not supported by the Ollama engine at {self.url} ({why}); route the "
                    "model to embedded llama.cpp nodes",
                )
        options: dict[str, Any] = {
            "num_predict": num_predict,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": max(sampling.top_k, 0),  # vLLM's -1 (no limit) is Ollama's 0
            "min_p": sampling.min_p,
        }
        if self.n_ctx > 0:  # 0: the server's own setting
            options["num_ctx"] = self.n_ctx
        if sampling.seed is not None:
            options["seed"] = sampling.seed
        if sampling.stop:
            options["stop"] = list(sampling.stop)
        if sampling.penalized:  # else the server's own (its Go engine applies none)
            options["repeat_penalty"] = sampling.repeat_penalty
            options["frequency_penalty"] = sampling.frequency_penalty
            options["presence_penalty"] = sampling.presence_penalty
            options["repeat_last_n"] = sampling.repeat_last_n
        return options

    @asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        if self._in_flight >= self._max_in_flight:
            raise ResourceExhausted(
                f"node busy: {self._in_flight} requests already in flight to Ollama; retry later"
            )
        self._in_flight += 1
        self._busy_time.set(self._in_flight)
        try:
            yield
        finally:
            self._in_flight -= 1
            self._busy_time.set(self._in_flight)

    @asynccontextmanager
    async def _mapped_errors(self) -> AsyncIterator[None]:
        where = f"Ollama at {self.url}"
        try:
            yield
        except ollama.ResponseError as exc:
            message = f"{where}: {exc.error}"
            if exc.status_code == 404:
                raise NotFound(message) from None
            if exc.status_code == 400:
                # Ollama's refusal of what its model cannot do names the field that asked.
                said = str(exc.error)
                field = next(
                    (f for c, f in _CAPABILITY_FIELDS.items() if f"does not support {c}" in said),
                    "prompt",
                )
                raise InvalidArgument(field, message) from None
            if exc.status_code == 429:
                raise ResourceExhausted(message) from None
            raise Unavailable(
                message if exc.status_code >= 0 else f"{where} failed mid-stream: {exc.error}"
            ) from None
        except (ConnectionError, httpx.ConnectError):
            raise Unavailable(f"{where} is unreachable") from None
        except httpx.TimeoutException as exc:
            raise Unavailable(f"{where} timed out ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise Unavailable(f"{where} dropped the connection: {type(exc).__name__}") from None

    async def close(self) -> None:
        await self._client.close()  # type: ignore[no-untyped-call]


def _logprob_fields(sampling: Sampling) -> dict[str, Any]:
    """Ollama's request fields for log probabilities (none unless asked)."""
    if sampling.logprobs is None:
        return {}
    return {"logprobs": True, "top_logprobs": sampling.logprobs}


def _choice(entry: Any) -> TokenChoice:
    """An Ollama log-probability entry (its `bytes`, when sent, are not kept by the ollama
    package: the token's text stands for them)."""
    return TokenChoice(UNKNOWN_TOKEN_ID, str(entry.token).encode(), float(entry.logprob))


def _ids_to_bytes(ids: list[int]) -> bytes:
    packed = array("I", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _bytes_to_ids(data: memoryview) -> list[int]:
    if len(data) % 4:
        raise DataLoss(f"token-id state of {len(data)} bytes is not a whole number of ids")
    packed = array("I")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def ollama_format(fmt: ResponseFormat | None) -> Any:
    """Ollama's `format`: "json" for any JSON object, the schema itself for a schema."""
    if fmt is None:
        return None
    return "json" if fmt.json_schema is None else json.loads(fmt.json_schema)


def _ollama_tools(tools: ToolRequest | None) -> list[dict[str, Any]] | None:
    """The request's tools as Ollama's /api/chat takes them (OpenAI's shape)."""
    offered = formats.active(tools)
    return None if offered is None else offered.openai_shape()


def _ollama_turn(turn: ChatTurn, turns: Sequence[ChatTurn]) -> dict[str, Any]:
    """A chat turn as Ollama takes it: an assistant's calls with their arguments as objects,
    a tool's result with the name of the tool it answers (Ollama's calls have no id)."""
    out: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        out["tool_calls"] = [
            {"function": {"name": c.name, "arguments": c.parsed_arguments()}}
            for c in turn.tool_calls
        ]
    if turn.role == "tool":
        names = {c.id: c.name for t in turns for c in t.tool_calls}
        out["tool_name"] = names.get(turn.tool_call_id, "")
    return out
