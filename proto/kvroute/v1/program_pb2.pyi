from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SELECT_MODE_ALL: _ClassVar[SelectMode]
    SELECT_MODE_BEST_LOGPROB: _ClassVar[SelectMode]
    SELECT_MODE_FIRST_FINISHED: _ClassVar[SelectMode]
SELECT_MODE_ALL: SelectMode
SELECT_MODE_BEST_LOGPROB: SelectMode
SELECT_MODE_FIRST_FINISHED: SelectMode

class ControllerProgram(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[Step]
    def __init__(self, steps: _Optional[_Iterable[_Union[Step, _Mapping]]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("gen", "fast_forward", "backtrack", "fork", "select")
    GEN_FIELD_NUMBER: _ClassVar[int]
    FAST_FORWARD_FIELD_NUMBER: _ClassVar[int]
    BACKTRACK_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    gen: Gen
    fast_forward: FastForward
    backtrack: Backtrack
    fork: Fork
    select: Select
    def __init__(self, gen: _Optional[_Union[Gen, _Mapping]] = ..., fast_forward: _Optional[_Union[FastForward, _Mapping]] = ..., backtrack: _Optional[_Union[Backtrack, _Mapping]] = ..., fork: _Optional[_Union[Fork, _Mapping]] = ..., select: _Optional[_Union[Select, _Mapping]] = ...) -> None: ...

class Gen(_message.Message):
    __slots__ = ("max_tokens", "stop", "temperature", "constraint", "capture", "continue_constraint")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    temperature: float
    constraint: Constraint
    capture: str
    continue_constraint: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., temperature: _Optional[float] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., capture: _Optional[str] = ..., continue_constraint: _Optional[bool] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "regex", "lark", "choices")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    lark: str
    choices: Choices
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ..., choices: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class FastForward(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Backtrack(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...

class Fork(_message.Message):
    __slots__ = ("branches", "n", "select")
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    branches: _containers.RepeatedCompositeFieldContainer[ControllerProgram]
    n: int
    select: SelectMode
    def __init__(self, branches: _Optional[_Iterable[_Union[ControllerProgram, _Mapping]]] = ..., n: _Optional[int] = ..., select: _Optional[_Union[SelectMode, str]] = ...) -> None: ...

class Select(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: SelectMode
    def __init__(self, mode: _Optional[_Union[SelectMode, str]] = ...) -> None: ...

class ProgramEvent(_message.Message):
    __slots__ = ("kind", "count", "name", "value", "branch_ids", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ProgramEvent.Kind]
        KIND_FORKED: _ClassVar[ProgramEvent.Kind]
        KIND_FAST_FORWARD: _ClassVar[ProgramEvent.Kind]
        KIND_BACKTRACK: _ClassVar[ProgramEvent.Kind]
        KIND_GEN_END: _ClassVar[ProgramEvent.Kind]
        KIND_CAPTURED: _ClassVar[ProgramEvent.Kind]
        KIND_SELECTED: _ClassVar[ProgramEvent.Kind]
        KIND_DROPPED: _ClassVar[ProgramEvent.Kind]
        KIND_CONSTRAINT_CLOSED: _ClassVar[ProgramEvent.Kind]
    KIND_UNSPECIFIED: ProgramEvent.Kind
    KIND_FORKED: ProgramEvent.Kind
    KIND_FAST_FORWARD: ProgramEvent.Kind
    KIND_BACKTRACK: ProgramEvent.Kind
    KIND_GEN_END: ProgramEvent.Kind
    KIND_CAPTURED: ProgramEvent.Kind
    KIND_SELECTED: ProgramEvent.Kind
    KIND_DROPPED: ProgramEvent.Kind
    KIND_CONSTRAINT_CLOSED: ProgramEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: ProgramEvent.Kind
    count: int
    name: str
    value: str
    branch_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, kind: _Optional[_Union[ProgramEvent.Kind, str]] = ..., count: _Optional[int] = ..., name: _Optional[str] = ..., value: _Optional[str] = ..., branch_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class Capture(_message.Message):
    __slots__ = ("text", "token_ids", "complete")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ...) -> None: ...

class BranchResult(_message.Message):
    __slots__ = ("branch_id", "variables", "token_ids", "text", "logprob", "selected", "cached_tokens", "engine_requests", "prefill_tokens", "generated_tokens", "token_logprobs")
    class VariablesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Capture
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Capture, _Mapping]] = ...) -> None: ...
    BRANCH_ID_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    branch_id: str
    variables: _containers.MessageMap[str, Capture]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprob: float
    selected: bool
    cached_tokens: int
    engine_requests: int
    prefill_tokens: int
    generated_tokens: int
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, branch_id: _Optional[str] = ..., variables: _Optional[_Mapping[str, Capture]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., selected: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., engine_requests: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., token_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("fork_step", "overflow")
    FORK_STEP_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    fork_step: int
    overflow: _containers.RepeatedCompositeFieldContainer[Overflow]
    def __init__(self, fork_step: _Optional[int] = ..., overflow: _Optional[_Iterable[_Union[Overflow, _Mapping]]] = ...) -> None: ...

class Overflow(_message.Message):
    __slots__ = ("worker_id", "address", "children")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    children: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., children: _Optional[_Iterable[int]] = ...) -> None: ...
