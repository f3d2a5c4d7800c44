import datetime

from disagg_mesh.proto.v1 import types_pb2 as _types_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeCandidate(_message.Message):
    __slots__ = ("node", "block_hashes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    node: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, node: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "sampling", "decode_candidates", "continuation", "reasoning_effort", "queue_timeout", "work_timeout", "truncate_history", "truncate_prompt_tokens", "suffix")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    WORK_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    sampling: _types_pb2.SamplingParams
    decode_candidates: _containers.RepeatedCompositeFieldContainer[DecodeCandidate]
    continuation: _types_pb2.Continuation
    reasoning_effort: _types_pb2.ReasoningEffort
    queue_timeout: _duration_pb2.Duration
    work_timeout: _duration_pb2.Duration
    truncate_history: bool
    truncate_prompt_tokens: int
    suffix: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., decode_candidates: _Optional[_Iterable[_Union[DecodeCandidate, _Mapping]]] = ..., continuation: _Optional[_Union[_types_pb2.Continuation, _Mapping]] = ..., reasoning_effort: _Optional[_Union[_types_pb2.ReasoningEffort, str]] = ..., queue_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., work_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., truncate_history: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., suffix: _Optional[str] = ...) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("prefill_duration", "cached_prompt_tokens", "kv_state_bytes", "replayed_tokens", "replay_duration")
    PREFILL_DURATION_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DURATION_FIELD_NUMBER: _ClassVar[int]
    prefill_duration: _duration_pb2.Duration
    cached_prompt_tokens: int
    kv_state_bytes: int
    replayed_tokens: int
    replay_duration: _duration_pb2.Duration
    def __init__(self, prefill_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_state_bytes: _Optional[int] = ..., replayed_tokens: _Optional[int] = ..., replay_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("reference", "stats", "kv_handle", "first_token_id", "prompt_tokens", "prefill_duration", "kv_size_bytes", "fingerprint", "kv_ttl", "kv_transfer", "first_token_text", "cached_prompt_tokens", "block_hashes", "kv_prefix_tokens", "kv_prefix_node", "kv_state_bytes", "replayed_tokens", "replay_duration", "open_message_token_ids")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DURATION_FIELD_NUMBER: _ClassVar[int]
    KV_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_TTL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PREFIX_NODE_FIELD_NUMBER: _ClassVar[int]
    KV_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DURATION_FIELD_NUMBER: _ClassVar[int]
    OPEN_MESSAGE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    reference: _types_pb2.KvReference
    stats: PrefillStats
    kv_handle: str
    first_token_id: int
    prompt_tokens: int
    prefill_duration: _duration_pb2.Duration
    kv_size_bytes: int
    fingerprint: _types_pb2.KvFingerprint
    kv_ttl: _duration_pb2.Duration
    kv_transfer: _types_pb2.KvTransfer
    first_token_text: str
    cached_prompt_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    kv_prefix_tokens: int
    kv_prefix_node: str
    kv_state_bytes: int
    replayed_tokens: int
    replay_duration: _duration_pb2.Duration
    open_message_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reference: _Optional[_Union[_types_pb2.KvReference, _Mapping]] = ..., stats: _Optional[_Union[PrefillStats, _Mapping]] = ..., kv_handle: _Optional[str] = ..., first_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., prefill_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kv_size_bytes: _Optional[int] = ..., fingerprint: _Optional[_Union[_types_pb2.KvFingerprint, _Mapping]] = ..., kv_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., kv_transfer: _Optional[_Union[_types_pb2.KvTransfer, str]] = ..., first_token_text: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., kv_prefix_tokens: _Optional[int] = ..., kv_prefix_node: _Optional[str] = ..., kv_state_bytes: _Optional[int] = ..., replayed_tokens: _Optional[int] = ..., replay_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., open_message_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchKvRequest(_message.Message):
    __slots__ = ("kv_handle",)
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    def __init__(self, kv_handle: _Optional[str] = ...) -> None: ...

class FetchKvResponse(_message.Message):
    __slots__ = ("offset_bytes", "data", "total_size_bytes", "sha256", "fingerprint")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    data: bytes
    total_size_bytes: int
    sha256: str
    fingerprint: _types_pb2.KvFingerprint
    def __init__(self, offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., fingerprint: _Optional[_Union[_types_pb2.KvFingerprint, _Mapping]] = ...) -> None: ...
