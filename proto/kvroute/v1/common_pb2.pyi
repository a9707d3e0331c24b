from kvroute.v1 import program_pb2 as _program_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_UNSPECIFIED: _ClassVar[PrefillMode]
    PREFILL_MODE_WHOLE: _ClassVar[PrefillMode]
    PREFILL_MODE_CHUNKED: _ClassVar[PrefillMode]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
PREFILL_MODE_UNSPECIFIED: PrefillMode
PREFILL_MODE_WHOLE: PrefillMode
PREFILL_MODE_CHUNKED: PrefillMode

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "top_k")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("token_ids", "text", "model", "sampling", "program", "session_id", "request_id", "cache_salt", "placement")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    model: str
    sampling: SamplingParams
    program: _program_pb2.ControllerProgram
    session_id: str
    request_id: str
    cache_salt: str
    placement: _program_pb2.Placement
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., model: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., program: _Optional[_Union[_program_pb2.ControllerProgram, _Mapping]] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., placement: _Optional[_Union[_program_pb2.Placement, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "worker_id", "cached_tokens", "token_ids", "text", "finish_reason", "usage", "ttft_ms", "branch_id", "events", "results")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    cached_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    ttft_ms: float
    branch_id: str
    events: _containers.RepeatedCompositeFieldContainer[_program_pb2.ProgramEvent]
    results: _containers.RepeatedCompositeFieldContainer[_program_pb2.BranchResult]
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., ttft_ms: _Optional[float] = ..., branch_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[_program_pb2.ProgramEvent, _Mapping]]] = ..., results: _Optional[_Iterable[_Union[_program_pb2.BranchResult, _Mapping]]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "running", "queued", "free_blocks", "capacity_blocks", "pending_prefill_tokens", "max_running", "max_batched_tokens", "prefill_mode", "max_prefill_chunk")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    running: int
    queued: int
    free_blocks: int
    capacity_blocks: int
    pending_prefill_tokens: int
    max_running: int
    max_batched_tokens: int
    prefill_mode: PrefillMode
    max_prefill_chunk: int
    def __init__(self, worker_id: _Optional[str] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., free_blocks: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., pending_prefill_tokens: _Optional[int] = ..., max_running: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., prefill_mode: _Optional[_Union[PrefillMode, str]] = ..., max_prefill_chunk: _Optional[int] = ...) -> None: ...
