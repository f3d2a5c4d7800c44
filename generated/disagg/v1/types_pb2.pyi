from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_UNSPECIFIED: _ClassVar[ToolChoice]
    TOOL_CHOICE_AUTO: _ClassVar[ToolChoice]
    TOOL_CHOICE_NONE: _ClassVar[ToolChoice]
    TOOL_CHOICE_REQUIRED: _ClassVar[ToolChoice]
    TOOL_CHOICE_FUNCTION: _ClassVar[ToolChoice]

class ResponseFormatType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESPONSE_FORMAT_TYPE_UNSPECIFIED: _ClassVar[ResponseFormatType]
    RESPONSE_FORMAT_TYPE_JSON_OBJECT: _ClassVar[ResponseFormatType]
    RESPONSE_FORMAT_TYPE_JSON_SCHEMA: _ClassVar[ResponseFormatType]

class ReasoningEffort(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASONING_EFFORT_UNSPECIFIED: _ClassVar[ReasoningEffort]
    REASONING_EFFORT_LOW: _ClassVar[ReasoningEffort]
    REASONING_EFFORT_MEDIUM: _ClassVar[ReasoningEffort]
    REASONING_EFFORT_HIGH: _ClassVar[ReasoningEffort]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class KvTransfer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_UNSPECIFIED: _ClassVar[KvTransfer]
    KV_TRANSFER_NONE: _ClassVar[KvTransfer]
    KV_TRANSFER_STATE: _ClassVar[KvTransfer]
    KV_TRANSFER_TOKEN_IDS: _ClassVar[KvTransfer]
TOOL_CHOICE_UNSPECIFIED: ToolChoice
TOOL_CHOICE_AUTO: ToolChoice
TOOL_CHOICE_NONE: ToolChoice
TOOL_CHOICE_REQUIRED: ToolChoice
TOOL_CHOICE_FUNCTION: ToolChoice
RESPONSE_FORMAT_TYPE_UNSPECIFIED: ResponseFormatType
RESPONSE_FORMAT_TYPE_JSON_OBJECT: ResponseFormatType
RESPONSE_FORMAT_TYPE_JSON_SCHEMA: ResponseFormatType
REASONING_EFFORT_UNSPECIFIED: ReasoningEffort
REASONING_EFFORT_LOW: ReasoningEffort
REASONING_EFFORT_MEDIUM: ReasoningEffort
REASONING_EFFORT_HIGH: ReasoningEffort
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
KV_TRANSFER_UNSPECIFIED: KvTransfer
KV_TRANSFER_NONE: KvTransfer
KV_TRANSFER_STATE: KvTransfer
KV_TRANSFER_TOKEN_IDS: KvTransfer

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "response_format", "stream_interval_tokens", "tools", "top_k", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty", "repeat_last_n", "logit_bias", "logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_LAST_N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    response_format: ResponseFormat
    stream_interval_tokens: int
    tools: ToolSet
    top_k: int
    min_p: float
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    repeat_last_n: int
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., stream_interval_tokens: _Optional[int] = ..., tools: _Optional[_Union[ToolSet, _Mapping]] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class ToolSet(_message.Message):
    __slots__ = ("definitions", "choice", "function_name", "parallel_calls")
    DEFINITIONS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    definitions: _containers.RepeatedCompositeFieldContainer[ToolDefinition]
    choice: ToolChoice
    function_name: str
    parallel_calls: bool
    def __init__(self, definitions: _Optional[_Iterable[_Union[ToolDefinition, _Mapping]]] = ..., choice: _Optional[_Union[ToolChoice, str]] = ..., function_name: _Optional[str] = ..., parallel_calls: _Optional[bool] = ...) -> None: ...

class ToolDefinition(_message.Message):
    __slots__ = ("name", "description", "parameters_json_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json_schema: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json_schema: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments_json")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments_json: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: ResponseFormatType
    json_schema: str
    def __init__(self, type: _Optional[_Union[ResponseFormatType, str]] = ..., json_schema: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class KvFingerprint(_message.Message):
    __slots__ = ("model_sha256", "n_ctx_tokens", "engine_version", "type_k", "type_v", "flash_attn", "kv_unified", "swa_full")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    N_CTX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TYPE_K_FIELD_NUMBER: _ClassVar[int]
    TYPE_V_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTN_FIELD_NUMBER: _ClassVar[int]
    KV_UNIFIED_FIELD_NUMBER: _ClassVar[int]
    SWA_FULL_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    n_ctx_tokens: int
    engine_version: str
    type_k: str
    type_v: str
    flash_attn: bool
    kv_unified: bool
    swa_full: bool
    def __init__(self, model_sha256: _Optional[str] = ..., n_ctx_tokens: _Optional[int] = ..., engine_version: _Optional[str] = ..., type_k: _Optional[str] = ..., type_v: _Optional[str] = ..., flash_attn: _Optional[bool] = ..., kv_unified: _Optional[bool] = ..., swa_full: _Optional[bool] = ...) -> None: ...

class KvReference(_message.Message):
    __slots__ = ("kv_handle", "first_token_id", "first_token_text", "prompt_tokens", "fingerprint", "kv_size_bytes", "block_hashes", "kv_prefix_tokens", "open_message_token_ids", "penalty_token_ids", "first_token_logprobs")
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPEN_MESSAGE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    first_token_id: int
    first_token_text: str
    prompt_tokens: int
    fingerprint: KvFingerprint
    kv_size_bytes: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    kv_prefix_tokens: int
    open_message_token_ids: _containers.RepeatedScalarFieldContainer[int]
    penalty_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, kv_handle: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_text: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., fingerprint: _Optional[_Union[KvFingerprint, _Mapping]] = ..., kv_size_bytes: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., kv_prefix_tokens: _Optional[int] = ..., open_message_token_ids: _Optional[_Iterable[int]] = ..., penalty_token_ids: _Optional[_Iterable[int]] = ..., first_token_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids", "reasoning", "tool_calls", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: TokenChoice
    top: _containers.RepeatedCompositeFieldContainer[TokenChoice]
    def __init__(self, chosen: _Optional[_Union[TokenChoice, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenChoice, _Mapping]]] = ...) -> None: ...

class TokenChoice(_message.Message):
    __slots__ = ("token_id", "piece", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    piece: bytes
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., piece: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("generated_token_ids", "generated_text", "first_token_from_prefill", "raw_prompt", "generated_tokens", "prompt_cached_tokens")
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FROM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_text: str
    first_token_from_prefill: bool
    raw_prompt: bool
    generated_tokens: int
    prompt_cached_tokens: int
    def __init__(self, generated_token_ids: _Optional[_Iterable[int]] = ..., generated_text: _Optional[str] = ..., first_token_from_prefill: _Optional[bool] = ..., raw_prompt: _Optional[bool] = ..., generated_tokens: _Optional[int] = ..., prompt_cached_tokens: _Optional[int] = ...) -> None: ...
