import datetime

from disagg_mesh.proto.v1 import types_pb2 as _types_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_METHOD_UNSPECIFIED: _ClassVar[RouteMethod]
    ROUTE_METHOD_DISAGGREGATED: _ClassVar[RouteMethod]
    ROUTE_METHOD_DECODE_ONLY: _ClassVar[RouteMethod]
    ROUTE_METHOD_DIRECT_OLLAMA: _ClassVar[RouteMethod]
ROUTE_METHOD_UNSPECIFIED: RouteMethod
ROUTE_METHOD_DISAGGREGATED: RouteMethod
ROUTE_METHOD_DECODE_ONLY: RouteMethod
ROUTE_METHOD_DIRECT_OLLAMA: RouteMethod

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "sampling", "reasoning_effort", "continuation", "resumed_from_router", "truncate_history", "truncate_prompt_tokens", "suffix")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_ROUTER_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    sampling: _types_pb2.SamplingParams
    reasoning_effort: _types_pb2.ReasoningEffort
    continuation: _types_pb2.Continuation
    resumed_from_router: str
    truncate_history: bool
    truncate_prompt_tokens: int
    suffix: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., reasoning_effort: _Optional[_Union[_types_pb2.ReasoningEffort, str]] = ..., continuation: _Optional[_Union[_types_pb2.Continuation, _Mapping]] = ..., resumed_from_router: _Optional[str] = ..., truncate_history: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., suffix: _Optional[str] = ...) -> None: ...

class ResumeInfo(_message.Message):
    __slots__ = ("first_token_from_prefill", "prompt_cached_tokens")
    FIRST_TOKEN_FROM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_from_prefill: bool
    prompt_cached_tokens: int
    def __init__(self, first_token_from_prefill: _Optional[bool] = ..., prompt_cached_tokens: _Optional[int] = ...) -> None: ...

class FailedAttempt(_message.Message):
    __slots__ = ("method", "node", "code", "message", "duration")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    method: RouteMethod
    node: str
    code: str
    message: str
    duration: _duration_pb2.Duration
    def __init__(self, method: _Optional[_Union[RouteMethod, str]] = ..., node: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("failed_node", "code", "tokens_delivered", "resumed_on", "resume_duration", "via_prefill_node", "reason")
    FAILED_NODE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_ON_FIELD_NUMBER: _ClassVar[int]
    RESUME_DURATION_FIELD_NUMBER: _ClassVar[int]
    VIA_PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    failed_node: str
    code: str
    tokens_delivered: int
    resumed_on: str
    resume_duration: _duration_pb2.Duration
    via_prefill_node: str
    reason: str
    def __init__(self, failed_node: _Optional[str] = ..., code: _Optional[str] = ..., tokens_delivered: _Optional[int] = ..., resumed_on: _Optional[str] = ..., resume_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., via_prefill_node: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "finish_reason", "method", "kv_transfer", "prefill_duration", "prefill_tokens_per_second", "kv_transfer_duration", "kv_transfer_bytes", "kv_load_duration", "time_to_first_token", "decode_duration", "decode_tokens_per_second", "total_duration", "prefill_node", "prefill_address", "decode_node", "decode_address", "failed_attempts", "decode_prompt_eval_duration", "migrations", "cached_prompt_tokens", "decode_cached_prompt_tokens", "kv_state_bytes", "route_reason")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DURATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_DURATION_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_DURATION_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_DURATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DURATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILED_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PROMPT_EVAL_DURATION_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTE_REASON_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: _types_pb2.FinishReason
    method: RouteMethod
    kv_transfer: _types_pb2.KvTransfer
    prefill_duration: _duration_pb2.Duration
    prefill_tokens_per_second: float
    kv_transfer_duration: _duration_pb2.Duration
    kv_transfer_bytes: int
    kv_load_duration: _duration_pb2.Duration
    time_to_first_token: _duration_pb2.Duration
    decode_duration: _duration_pb2.Duration
    decode_tokens_per_second: float
    total_duration: _duration_pb2.Duration
    prefill_node: str
    prefill_address: str
    decode_node: str
    decode_address: str
    failed_attempts: _containers.RepeatedCompositeFieldContainer[FailedAttempt]
    decode_prompt_eval_duration: _duration_pb2.Duration
    migrations: _containers.RepeatedCompositeFieldContainer[Migration]
    cached_prompt_tokens: int
    decode_cached_prompt_tokens: int
    kv_state_bytes: int
    route_reason: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., method: _Optional[_Union[RouteMethod, str]] = ..., kv_transfer: _Optional[_Union[_types_pb2.KvTransfer, str]] = ..., prefill_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., prefill_tokens_per_second: _Optional[float] = ..., kv_transfer_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_load_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_token: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., decode_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., decode_tokens_per_second: _Optional[float] = ..., total_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., prefill_node: _Optional[str] = ..., prefill_address: _Optional[str] = ..., decode_node: _Optional[str] = ..., decode_address: _Optional[str] = ..., failed_attempts: _Optional[_Iterable[_Union[FailedAttempt, _Mapping]]] = ..., decode_prompt_eval_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., migrations: _Optional[_Iterable[_Union[Migration, _Mapping]]] = ..., cached_prompt_tokens: _Optional[int] = ..., decode_cached_prompt_tokens: _Optional[int] = ..., kv_state_bytes: _Optional[int] = ..., route_reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "summary", "resume")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    delta: _types_pb2.TextDelta
    summary: GenerateSummary
    resume: ResumeInfo
    def __init__(self, delta: _Optional[_Union[_types_pb2.TextDelta, _Mapping]] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ..., resume: _Optional[_Union[ResumeInfo, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("name", "address", "engine", "engine_model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    engine: str
    engine_model: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., engine: _Optional[str] = ..., engine_model: _Optional[str] = ...) -> None: ...

class ModelRoute(_message.Message):
    __slots__ = ("model", "prefill_nodes", "decode_nodes", "prefill_deadline", "decode_deadline")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODES_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    DECODE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    model: str
    prefill_nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    decode_nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    prefill_deadline: _duration_pb2.Duration
    decode_deadline: _duration_pb2.Duration
    def __init__(self, model: _Optional[str] = ..., prefill_nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., decode_nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., prefill_deadline: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., decode_deadline: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "http_url")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelRoute]
    http_url: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelRoute, _Mapping]]] = ..., http_url: _Optional[str] = ...) -> None: ...
