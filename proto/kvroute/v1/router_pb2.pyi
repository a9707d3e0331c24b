from kvroute.v1 import common_pb2 as _common_pb2
from kvroute.v1 import program_pb2 as _program_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Candidate(_message.Message):
    __slots__ = ("worker_id", "address", "cached_tokens", "cost")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    cached_tokens: int
    cost: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., cost: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("request_id", "worker_id", "address", "cached_tokens", "prompt_tokens", "candidates", "policy", "degraded", "placement")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    address: str
    cached_tokens: int
    prompt_tokens: int
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    policy: str
    degraded: bool
    placement: _program_pb2.Placement
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., policy: _Optional[str] = ..., degraded: _Optional[bool] = ..., placement: _Optional[_Union[_program_pb2.Placement, _Mapping]] = ...) -> None: ...
