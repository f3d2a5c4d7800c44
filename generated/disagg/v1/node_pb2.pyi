from disagg_mesh.proto.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetNodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNodeInfoResponse(_message.Message):
    __slots__ = ("name", "role", "engine", "engine_model", "models", "fingerprint", "kv_transfer", "ready", "problem", "model_loaded_in_memory", "kv_store_handles", "kv_store_bytes", "slots", "slots_busy", "queue_depth", "max_queue", "prompt_tokens_per_second", "decode_tokens_per_second", "kv_cache_bytes", "kv_cache_used_bytes", "backend", "gpu_layers", "model_layers", "prefix_cache_tokens", "prefix_cache_max_tokens", "restarts", "uptime_seconds", "host", "busy_seconds", "slot_busy_seconds", "model_facts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    MODEL_LOADED_IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_BUSY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FACTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    engine: str
    engine_model: str
    models: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: _types_pb2.KvFingerprint
    kv_transfer: _types_pb2.KvTransfer
    ready: bool
    problem: str
    model_loaded_in_memory: bool
    kv_store_handles: int
    kv_store_bytes: int
    slots: int
    slots_busy: int
    queue_depth: int
    max_queue: int
    prompt_tokens_per_second: float
    decode_tokens_per_second: float
    kv_cache_bytes: int
    kv_cache_used_bytes: int
    backend: str
    gpu_layers: int
    model_layers: int
    prefix_cache_tokens: int
    prefix_cache_max_tokens: int
    restarts: int
    uptime_seconds: float
    host: HostUsage
    busy_seconds: float
    slot_busy_seconds: float
    model_facts: ModelFacts
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., engine: _Optional[str] = ..., engine_model: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[_Union[_types_pb2.KvFingerprint, _Mapping]] = ..., kv_transfer: _Optional[_Union[_types_pb2.KvTransfer, str]] = ..., ready: _Optional[bool] = ..., problem: _Optional[str] = ..., model_loaded_in_memory: _Optional[bool] = ..., kv_store_handles: _Optional[int] = ..., kv_store_bytes: _Optional[int] = ..., slots: _Optional[int] = ..., slots_busy: _Optional[int] = ..., queue_depth: _Optional[int] = ..., max_queue: _Optional[int] = ..., prompt_tokens_per_second: _Optional[float] = ..., decode_tokens_per_second: _Optional[float] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_used_bytes: _Optional[int] = ..., backend: _Optional[str] = ..., gpu_layers: _Optional[int] = ..., model_layers: _Optional[int] = ..., prefix_cache_tokens: _Optional[int] = ..., prefix_cache_max_tokens: _Optional[int] = ..., restarts: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., host: _Optional[_Union[HostUsage, _Mapping]] = ..., busy_seconds: _Optional[float] = ..., slot_busy_seconds: _Optional[float] = ..., model_facts: _Optional[_Union[ModelFacts, _Mapping]] = ...) -> None: ...

class ModelFacts(_message.Message):
    __slots__ = ("architecture", "parameter_count", "parameter_size", "quantization", "file_size_bytes", "trained_context_tokens", "embedding_length", "capabilities", "template")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    parameter_count: int
    parameter_size: str
    quantization: str
    file_size_bytes: int
    trained_context_tokens: int
    embedding_length: int
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    template: str
    def __init__(self, architecture: _Optional[str] = ..., parameter_count: _Optional[int] = ..., parameter_size: _Optional[str] = ..., quantization: _Optional[str] = ..., file_size_bytes: _Optional[int] = ..., trained_context_tokens: _Optional[int] = ..., embedding_length: _Optional[int] = ..., capabilities: _Optional[_Iterable[str]] = ..., template: _Optional[str] = ...) -> None: ...

class HostUsage(_message.Message):
    __slots__ = ("hostname", "cpu_cores", "cpu_busy_percent", "memory_used_bytes", "memory_total_bytes", "gpu_name", "gpu_utilization_percent", "gpu_memory_used_bytes", "gpu_memory_total_bytes", "unavailable")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    CPU_BUSY_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    cpu_cores: int
    cpu_busy_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    gpu_name: str
    gpu_utilization_percent: float
    gpu_memory_used_bytes: int
    gpu_memory_total_bytes: int
    unavailable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hostname: _Optional[str] = ..., cpu_cores: _Optional[int] = ..., cpu_busy_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., gpu_name: _Optional[str] = ..., gpu_utilization_percent: _Optional[float] = ..., gpu_memory_used_bytes: _Optional[int] = ..., gpu_memory_total_bytes: _Optional[int] = ..., unavailable: _Optional[_Iterable[str]] = ...) -> None: ...
