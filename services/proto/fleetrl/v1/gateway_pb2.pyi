from services.proto.fleetrl.v1 import learner_pb2 as _learner_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "spec_format", "prompts", "reward_file", "idempotency_key", "environment_file")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SPEC_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FILE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FILE_FIELD_NUMBER: _ClassVar[int]
    spec: str
    spec_format: str
    prompts: bytes
    reward_file: bytes
    idempotency_key: str
    environment_file: bytes
    def __init__(self, spec: _Optional[str] = ..., spec_format: _Optional[str] = ..., prompts: _Optional[bytes] = ..., reward_file: _Optional[bytes] = ..., idempotency_key: _Optional[str] = ..., environment_file: _Optional[bytes] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "tenant", "name", "state", "reason", "spec_json", "created_unix_ms", "updated_unix_ms", "last", "model_uri")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    MODEL_URI_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tenant: str
    name: str
    state: JobState
    reason: str
    spec_json: str
    created_unix_ms: int
    updated_unix_ms: int
    last: _learner_pb2.StepMetrics
    model_uri: str
    def __init__(self, job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., spec_json: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., last: _Optional[_Union[_learner_pb2.StepMetrics, _Mapping]] = ..., model_uri: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "from_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_step: int
    def __init__(self, job_id: _Optional[str] = ..., from_step: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job", "state", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: Job
    state: JobState
    step: _learner_pb2.StepMetrics
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[_Union[_learner_pb2.StepMetrics, _Mapping]] = ...) -> None: ...

class DownloadModelRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "last")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class GetFleetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FleetMember(_message.Message):
    __slots__ = ("kind", "member_id", "state", "job_id", "policy_version", "tokens_per_s", "busy_fraction", "seen_unix_ms")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SEEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    member_id: str
    state: str
    job_id: str
    policy_version: int
    tokens_per_s: float
    busy_fraction: float
    seen_unix_ms: int
    def __init__(self, kind: _Optional[str] = ..., member_id: _Optional[str] = ..., state: _Optional[str] = ..., job_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., busy_fraction: _Optional[float] = ..., seen_unix_ms: _Optional[int] = ...) -> None: ...

class TaskQueue(_message.Message):
    __slots__ = ("job_id", "pending", "in_flight", "redelivered", "dead_lettered")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    pending: int
    in_flight: int
    redelivered: int
    dead_lettered: int
    def __init__(self, job_id: _Optional[str] = ..., pending: _Optional[int] = ..., in_flight: _Optional[int] = ..., redelivered: _Optional[int] = ..., dead_lettered: _Optional[int] = ...) -> None: ...

class FleetStatus(_message.Message):
    __slots__ = ("members", "queues", "unix_ms")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[FleetMember]
    queues: _containers.RepeatedCompositeFieldContainer[TaskQueue]
    unix_ms: int
    def __init__(self, members: _Optional[_Iterable[_Union[FleetMember, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[TaskQueue, _Mapping]]] = ..., unix_ms: _Optional[int] = ...) -> None: ...
