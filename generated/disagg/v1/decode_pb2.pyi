import datetime

from disagg_mesh.proto.v1 import types_pb2 as _types_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvSource(_message.Message):
    __slots__ = ("prefill_address", "reference", "kv_handle", "first_token_id", "prompt_tokens", "fingerprint", "kv_size_bytes", "first_token_text", "block_hashes", "prefix_tokens", "open_message_token_ids")
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPEN_MESSAGE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prefill_address: str
    reference: _types_pb2.KvReference
    kv_handle: str
    first_token_id: int
    prompt_tokens: int
    fingerprint: _types_pb2.KvFingerprint
    kv_size_bytes: int
    first_token_text: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_tokens: int
    open_message_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prefill_address: _Optional[str] = ..., reference: _Optional[_Union[_types_pb2.KvReference, _Mapping]] = ..., kv_handle: _Optional[str] = ..., first_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., fingerprint: _Optional[_Union[_types_pb2.KvFingerprint, _Mapping]] = ..., kv_size_bytes: _Optional[int] = ..., first_token_text: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., prefix_tokens: _Optional[int] = ..., open_message_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeServiceGenerateRequest(_message.Message):
    __slots__ = ("model", "kv", "prompt", "messages", "sampling", "continuation", "reasoning_effort", "queue_timeout", "work_timeout", "truncate_history", "truncate_prompt_tokens", "suffix")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    WORK_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    model: str
    kv: KvSource
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    sampling: _types_pb2.SamplingParams
    continuation: _types_pb2.Continuation
    reasoning_effort: _types_pb2.ReasoningEffort
    queue_timeout: _duration_pb2.Duration
    work_timeout: _duration_pb2.Duration
    truncate_history: bool
    truncate_prompt_tokens: int
    suffix: str
    def __init__(self, model: _Optional[str] = ..., kv: _Optional[_Union[KvSource, _Mapping]] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., continuation: _Optional[_Union[_types_pb2.Continuation, _Mapping]] = ..., reasoning_effort: _Optional[_Union[_types_pb2.ReasoningEffort, str]] = ..., queue_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., work_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., truncate_history: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., suffix: _Optional[str] = ...) -> None: ...

class DecodeSummary(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "finish_reason", "kv_transfer", "kv_fetch_duration", "kv_fetch_bytes", "kv_load_duration", "prompt_eval_duration", "decode_duration", "time_to_first_token", "cached_prompt_tokens", "kept_prefix_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    KV_FETCH_DURATION_FIELD_NUMBER: _ClassVar[int]
    KV_FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_DURATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EVAL_DURATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_DURATION_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEPT_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: _types_pb2.FinishReason
    kv_transfer: _types_pb2.KvTransfer
    kv_fetch_duration: _duration_pb2.Duration
    kv_fetch_bytes: int
    kv_load_duration: _duration_pb2.Duration
    prompt_eval_duration: _duration_pb2.Duration
    decode_duration: _duration_pb2.Duration
    time_to_first_token: _duration_pb2.Duration
    cached_prompt_tokens: int
    kept_prefix_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., kv_transfer: _Optional[_Union[_types_pb2.KvTransfer, str]] = ..., kv_fetch_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kv_fetch_bytes: _Optional[int] = ..., kv_load_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., prompt_eval_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., decode_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_token: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., kept_prefix_tokens: _Optional[int] = ...) -> None: ...

class DecodeServiceGenerateResponse(_message.Message):
    __slots__ = ("delta", "summary")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    delta: _types_pb2.TextDelta
    summary: DecodeSummary
    def __init__(self, delta: _Optional[_Union[_types_pb2.TextDelta, _Mapping]] = ..., summary: _Optional[_Union[DecodeSummary, _Mapping]] = ...) -> None: ...
