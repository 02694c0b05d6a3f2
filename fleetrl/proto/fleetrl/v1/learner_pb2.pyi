from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LearnerStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "policy_version", "values", "unix_ms")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    values: _containers.ScalarMap[str, float]
    unix_ms: int
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., unix_ms: _Optional[int] = ...) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("job_id", "learner_id", "step", "policy_version", "checkpoint_step", "last", "phase", "paused_reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    learner_id: str
    step: int
    policy_version: int
    checkpoint_step: int
    last: StepMetrics
    phase: str
    paused_reason: str
    def __init__(self, job_id: _Optional[str] = ..., learner_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., last: _Optional[_Union[StepMetrics, _Mapping]] = ..., phase: _Optional[str] = ..., paused_reason: _Optional[str] = ...) -> None: ...
