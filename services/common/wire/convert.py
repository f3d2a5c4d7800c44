"""Translation between protobuf messages and the plain types in `types.py`.

Servicers and node clients use these; nothing below them sees protobuf. The dataclasses
that mirror a message field for field (fingerprints, prefill results, KV sources, decode
summaries) convert by mirror.py's rules; the others here, by hand.
"""

from __future__ import annotations

import json
from collections.abc import MutableSequence
from dataclasses import asdict, fields
from typing import Any, Protocol

from disagg_mesh.proto.v1 import decode_pb2, node_pb2, prefill_pb2, types_pb2
from disagg_mesh.server.common.errors import InvalidArgument
from disagg_mesh.server.common.tools.calls import (
    ArgumentsPiece,
    CallStart,
    Piece,
    ToolCall,
)
from disagg_mesh.server.common.tools.requests import ToolRequest, read_tools
from disagg_mesh.server.common.types import (
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_REPEAT_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    ChatTurn,
    Continuation,
    DecodeStats,
    Fingerprint,
    FinishReason,
    HostUsage,
    KvReference,
    KvSource,
    KvTransferKind,
    ModelFacts,
    PrefillResult,
    PrefillStats,
    Prompt,
    ResponseFormat,
    Sampling,
    StageLimits,
    TextChunk,
    TokenChoice,
    TokenLogprob,
)
from disagg_mesh.server.common.wire.mirror import (
    duration,
    from_proto,
    register,
    register_enum,
    to_proto,
)


def sampling_from_proto(msg: types_pb2.SamplingParams, max_tokens_limit: int) -> Sampling:
    """Unset max_tokens means as many as the mesh allows: generation then ends at an end
    token, a stop string or a full context, as Ollama's does."""
    return Sampling(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else max_tokens_limit,
        temperature=msg.temperature if msg.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=msg.top_p if msg.HasField("top_p") else DEFAULT_TOP_P,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        response_format=response_format_from_proto(msg.response_format),
        stream_interval_tokens=msg.stream_interval_tokens or 1,
        tools=tools_from_proto(msg.tools) if msg.HasField("tools") else None,
        top_k=msg.top_k if msg.HasField("top_k") else DEFAULT_TOP_K,
        min_p=msg.min_p if msg.HasField("min_p") else DEFAULT_MIN_P,
        repeat_penalty=(
            msg.repeat_penalty if msg.HasField("repeat_penalty") else DEFAULT_REPEAT_PENALTY
        ),
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        repeat_last_n=(
            msg.repeat_last_n if msg.HasField("repeat_last_n") else DEFAULT_REPEAT_LAST_N
        ),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


TOOLS_FIELD = "sampling.tools.definitions"
TOOL_CHOICES = {
    types_pb2.TOOL_CHOICE_UNSPECIFIED: "auto",
    types_pb2.TOOL_CHOICE_AUTO: "auto",
    types_pb2.TOOL_CHOICE_NONE: "none",
    types_pb2.TOOL_CHOICE_REQUIRED: "required",
}


def tools_from_proto(msg: types_pb2.ToolSet) -> ToolRequest | None:
    """Checked as the HTTP doors check OpenAI's `tools` (read_tools), fields named as here."""
    definitions: list[dict[str, Any]] = []
    for i, d in enumerate(msg.definitions):
        function: dict[str, Any] = {"name": d.name, "description": d.description}
        if d.parameters_json_schema:
            try:
                function["parameters"] = json.loads(d.parameters_json_schema)
            except ValueError as exc:
                raise InvalidArgument(
                    f"{TOOLS_FIELD}[{i}].parameters_json_schema", f"is not JSON: {exc}"
                ) from None
        definitions.append({"type": "function", "function": function})
    choice: Any
    if msg.choice == types_pb2.TOOL_CHOICE_FUNCTION:
        choice = {"type": "function", "function": {"name": msg.function_name}}
    elif msg.choice in TOOL_CHOICES:
        choice = TOOL_CHOICES[msg.choice]
    else:
        raise InvalidArgument("sampling.tools.choice", f"unknown value {msg.choice}")
    parallel = msg.parallel_calls if msg.HasField("parallel_calls") else None
    try:
        return read_tools(definitions, choice, parallel, field=TOOLS_FIELD)
    except InvalidArgument as exc:  # named as OpenAI's fields: name the proto's
        field = _proto_tool_field(exc.field)
        raise InvalidArgument(field, str(exc)[len(exc.field) + 2 :]) from None


def _proto_tool_field(field: str) -> str:
    """A field read_tools names as OpenAI's (`...[0].function.name`, `tool_choice`) as
    ToolSet's (`...[0].name`, `sampling.tools.choice`)."""
    for openai_name, proto_name in (
        ("tool_choice.function.name", "sampling.tools.function_name"),
        (".function.parameters", ".parameters_json_schema"),
        (".function.", "."),
        ("tool_choice", "sampling.tools.choice"),
        ("parallel_tool_calls", "sampling.tools.parallel_calls"),
    ):
        field = field.replace(openai_name, proto_name)
    return field


def tools_to_proto(tools: ToolRequest | None) -> types_pb2.ToolSet | None:
    if tools is None:
        return None
    choice = {v: k for k, v in TOOL_CHOICES.items() if k != types_pb2.TOOL_CHOICE_UNSPECIFIED}
    return types_pb2.ToolSet(
        definitions=[
            types_pb2.ToolDefinition(
                name=t.name,
                description=t.description,
                parameters_json_schema=json.dumps(t.parameters) if t.parameters else "",
            )
            for t in tools.tools
        ],
        choice=(
            types_pb2.TOOL_CHOICE_FUNCTION if tools.function is not None else choice[tools.choice]
        ),
        function_name=tools.function or "",
        parallel_calls=tools.parallel,
    )


def response_format_from_proto(msg: types_pb2.ResponseFormat) -> ResponseFormat | None:
    if msg.type == types_pb2.RESPONSE_FORMAT_TYPE_UNSPECIFIED:
        if msg.json_schema:
            raise InvalidArgument(
                "sampling.response_format.type", "is unset, but json_schema is given"
            )
        return None
    if msg.type == types_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT:
        return ResponseFormat()
    if msg.type == types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA:
        return ResponseFormat(json_schema=msg.json_schema)
    raise InvalidArgument("sampling.response_format.type", f"unknown value {msg.type}")


def response_format_to_proto(fmt: ResponseFormat | None) -> types_pb2.ResponseFormat | None:
    if fmt is None:
        return None
    if fmt.json_schema is None:
        return types_pb2.ResponseFormat(type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_OBJECT)
    return types_pb2.ResponseFormat(
        type=types_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema=fmt.json_schema
    )


def sampling_to_proto(sampling: Sampling) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop),
        ignore_eos=sampling.ignore_eos or None,
        response_format=response_format_to_proto(sampling.response_format),
        stream_interval_tokens=sampling.stream_interval_tokens,
        tools=tools_to_proto(sampling.tools),
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repeat_penalty=sampling.repeat_penalty,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        repeat_last_n=sampling.repeat_last_n,
        logit_bias=dict(sampling.logit_bias),
        logprobs=sampling.logprobs,
    )


REASONING_EFFORTS = {
    types_pb2.REASONING_EFFORT_UNSPECIFIED: "",
    types_pb2.REASONING_EFFORT_LOW: "low",
    types_pb2.REASONING_EFFORT_MEDIUM: "medium",
    types_pb2.REASONING_EFFORT_HIGH: "high",
}
REASONING_EFFORTS_TO_PROTO = {name: value for value, name in REASONING_EFFORTS.items()}


class PromptRequest(Protocol):
    """A request's prompt fields, as GenerateRequest, PrefillRequest and
    DecodeServiceGenerateRequest carry them."""

    prompt: str
    reasoning_effort: types_pb2.ReasoningEffort
    truncate_history: bool
    truncate_prompt_tokens: int
    suffix: str

    @property
    def messages(self) -> MutableSequence[types_pb2.ChatMessage]: ...


def prompt_from_proto(request: PromptRequest) -> Prompt:
    if request.reasoning_effort not in REASONING_EFFORTS:
        raise InvalidArgument("reasoning_effort", f"unknown value {request.reasoning_effort}")
    if request.truncate_prompt_tokens < 0:
        raise InvalidArgument(
            "truncate_prompt_tokens",
            f"must be 0 (the whole prompt) or more, got {request.truncate_prompt_tokens}",
        )
    return Prompt(
        text=request.prompt,
        messages=tuple(_turn_from_proto(m) for m in request.messages),
        reasoning_effort=REASONING_EFFORTS[request.reasoning_effort],
        truncate_history=request.truncate_history,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        suffix=request.suffix,
    )


def prompt_to_proto(prompt: Prompt, request: PromptRequest) -> None:
    """Set the request's prompt fields from the prompt."""
    request.prompt = prompt.text
    request.messages.extend(prompt_messages_to_proto(prompt))
    request.reasoning_effort = REASONING_EFFORTS_TO_PROTO[prompt.reasoning_effort]
    request.truncate_history = prompt.truncate_history
    request.truncate_prompt_tokens = prompt.truncate_prompt_tokens
    request.suffix = prompt.suffix


def _turn_from_proto(m: types_pb2.ChatMessage) -> ChatTurn:
    calls = tuple(ToolCall(c.id, c.name, c.arguments_json) for c in m.tool_calls)
    return ChatTurn(m.role, m.content, calls, m.tool_call_id)


def prompt_messages_to_proto(prompt: Prompt) -> list[types_pb2.ChatMessage]:
    return [
        types_pb2.ChatMessage(
            role=m.role,
            content=m.content,
            tool_calls=[
                types_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments)
                for c in m.tool_calls
            ],
            tool_call_id=m.tool_call_id,
        )
        for m in prompt.messages
    ]


def _call_piece_to_proto(piece: Piece) -> types_pb2.ToolCallDelta:
    if isinstance(piece, CallStart):
        return types_pb2.ToolCallDelta(index=piece.index, id=piece.id, name=piece.name)
    assert isinstance(piece, ArgumentsPiece)
    return types_pb2.ToolCallDelta(index=piece.index, arguments_json=piece.text)


def _call_piece_from_proto(delta: types_pb2.ToolCallDelta) -> Piece:
    if delta.name:
        return CallStart(delta.index, delta.id, delta.name)
    return ArgumentsPiece(delta.index, delta.arguments_json)


def text_delta_to_proto(chunk: TextChunk) -> types_pb2.TextDelta:
    return types_pb2.TextDelta(
        text=chunk.text,
        token_ids=chunk.token_ids,
        reasoning=chunk.reasoning,
        tool_calls=[_call_piece_to_proto(p) for p in chunk.tool_calls],
        logprobs=[to_proto(lp) for lp in chunk.logprobs],
    )


def text_chunk_from_proto(delta: types_pb2.TextDelta) -> TextChunk:
    return TextChunk(
        text=delta.text,
        token_ids=list(delta.token_ids),
        reasoning=delta.reasoning,
        tool_calls=[_call_piece_from_proto(d) for d in delta.tool_calls],
        logprobs=[from_proto(lp, TokenLogprob) for lp in delta.logprobs],
    )


def continuation_from_proto(msg: types_pb2.Continuation) -> Continuation:
    return Continuation(
        generated_token_ids=tuple(msg.generated_token_ids),
        generated_text=msg.generated_text,
        first_token_from_prefill=msg.first_token_from_prefill,
        raw_prompt=msg.raw_prompt,
        generated_tokens=max(msg.generated_tokens, len(msg.generated_token_ids)),
        prompt_cached_tokens=(
            msg.prompt_cached_tokens if msg.HasField("prompt_cached_tokens") else None
        ),
    )


def continuation_to_proto(c: Continuation) -> types_pb2.Continuation:
    return types_pb2.Continuation(
        generated_token_ids=c.generated_token_ids,
        generated_text=c.generated_text,
        first_token_from_prefill=c.first_token_from_prefill,
        raw_prompt=c.raw_prompt,
        generated_tokens=c.generated_tokens,
        prompt_cached_tokens=c.prompt_cached_tokens,
    )


LimitedRequest = prefill_pb2.PrefillRequest | decode_pb2.DecodeServiceGenerateRequest


def limits_from_proto(msg: LimitedRequest) -> StageLimits:
    """The request's queue_timeout and work_timeout (unset: None)."""

    def seconds(field: str) -> float | None:
        if not msg.HasField(field):
            return None
        value: float = getattr(msg, field).ToTimedelta().total_seconds()
        if value <= 0:
            raise InvalidArgument(field, f"must be positive, not {value:g} s")
        return value

    return StageLimits(queue_s=seconds("queue_timeout"), work_s=seconds("work_timeout"))


def limits_to_proto(limits: StageLimits, msg: LimitedRequest) -> None:
    """Set the request's queue_timeout and work_timeout (those that are not None)."""
    if limits.queue_s is not None:
        msg.queue_timeout.CopyFrom(duration(limits.queue_s))
    if limits.work_s is not None:
        msg.work_timeout.CopyFrom(duration(limits.work_s))


def fingerprint_from_proto(msg: types_pb2.KvFingerprint) -> Fingerprint:
    return from_proto(msg, Fingerprint)


def fingerprint_to_proto(fp: Fingerprint) -> types_pb2.KvFingerprint:
    result: types_pb2.KvFingerprint = to_proto(fp)
    return result


FINISH_REASON_TO_PROTO = {
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.TOOL_CALLS: types_pb2.FINISH_REASON_TOOL_CALLS,
}

KV_TRANSFER_TO_PROTO = {
    KvTransferKind.NONE: types_pb2.KV_TRANSFER_NONE,
    KvTransferKind.STATE: types_pb2.KV_TRANSFER_STATE,
    KvTransferKind.TOKEN_IDS: types_pb2.KV_TRANSFER_TOKEN_IDS,
}


def decode_stats_to_proto(stats: DecodeStats) -> decode_pb2.DecodeSummary:
    result: decode_pb2.DecodeSummary = to_proto(stats)
    return result


def decode_stats_from_proto(msg: decode_pb2.DecodeSummary) -> DecodeStats:
    return from_proto(msg, DecodeStats)


# The dataclasses of types.py that mirror a message field for field (mirror.py).
register_enum(FinishReason, FINISH_REASON_TO_PROTO)
register_enum(KvTransferKind, KV_TRANSFER_TO_PROTO)
register(Fingerprint, types_pb2.KvFingerprint)
register(ModelFacts, node_pb2.ModelFacts)
register(TokenChoice, types_pb2.TokenChoice)
register(TokenLogprob, types_pb2.TokenLogprob)
register(DecodeStats, decode_pb2.DecodeSummary)
register(KvReference, types_pb2.KvReference, open_message="open_message_token_ids")
register(PrefillStats, prefill_pb2.PrefillStats)
# Both carry a KvReference (and PrefillResponse its PrefillStats) and, for nodes of earlier
# versions, their values flat (mirror.py), but for the reference's fields added since.
REFERENCE_ONLY = ("penalty_token_ids", "first_token_logprobs")
register(
    KvSource,
    decode_pb2.KvSource,
    grouped=("reference",),
    flat_renames={"kv_prefix_tokens": "prefix_tokens"},
    group_only=REFERENCE_ONLY,
)
register(
    PrefillResult,
    prefill_pb2.PrefillResponse,
    grouped=("reference", "stats"),
    group_only=REFERENCE_ONLY,
    open_message="open_message_token_ids",
)


def host_to_proto(h: HostUsage) -> node_pb2.HostUsage:
    return node_pb2.HostUsage(**{**asdict(h), "unavailable": list(h.unavailable)})


def host_from_proto(h: node_pb2.HostUsage) -> HostUsage:
    values = {f.name: getattr(h, f.name) for f in fields(HostUsage)}
    return HostUsage(**{**values, "unavailable": tuple(h.unavailable)})
