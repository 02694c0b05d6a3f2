from fleetrl.proto.fleetrl.v1 import learner_pb2 as _learner_pb2
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

class TaskFate(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_FATE_UNSPECIFIED: _ClassVar[TaskFate]
    TASK_FATE_TRAINED: _ClassVar[TaskFate]
    TASK_FATE_STALE: _ClassVar[TaskFate]
    TASK_FATE_EVICTED: _ClassVar[TaskFate]
    TASK_FATE_PENDING: _ClassVar[TaskFate]
    TASK_FATE_DEAD_LETTERED: _ClassVar[TaskFate]
    TASK_FATE_IN_FLIGHT: _ClassVar[TaskFate]
    TASK_FATE_LOST: _ClassVar[TaskFate]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
TASK_FATE_UNSPECIFIED: TaskFate
TASK_FATE_TRAINED: TaskFate
TASK_FATE_STALE: TaskFate
TASK_FATE_EVICTED: TaskFate
TASK_FATE_PENDING: TaskFate
TASK_FATE_DEAD_LETTERED: TaskFate
TASK_FATE_IN_FLIGHT: TaskFate
TASK_FATE_LOST: TaskFate

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "spec_format", "prompts", "reward_file", "idempotency_key", "eval_prompts", "environment_file")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SPEC_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FILE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    EVAL_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FILE_FIELD_NUMBER: _ClassVar[int]
    spec: str
    spec_format: str
    prompts: bytes
    reward_file: bytes
    idempotency_key: str
    eval_prompts: bytes
    environment_file: bytes
    def __init__(self, spec: _Optional[str] = ..., spec_format: _Optional[str] = ..., prompts: _Optional[bytes] = ..., reward_file: _Optional[bytes] = ..., idempotency_key: _Optional[str] = ..., eval_prompts: _Optional[bytes] = ..., environment_file: _Optional[bytes] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "tenant", "name", "state", "reason", "spec_json", "created_unix_ms", "updated_unix_ms", "last", "model_uri", "sandbox")
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
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
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
    sandbox: str
    def __init__(self, job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., spec_json: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., last: _Optional[_Union[_learner_pb2.StepMetrics, _Mapping]] = ..., model_uri: _Optional[str] = ..., sandbox: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit", "all_tenants")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    ALL_TENANTS_FIELD_NUMBER: _ClassVar[int]
    limit: int
    all_tenants: bool
    def __init__(self, limit: _Optional[int] = ..., all_tenants: _Optional[bool] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("redis_keys", "redis_bytes", "nats_messages", "nats_bytes", "disk_files", "disk_bytes")
    REDIS_KEYS_FIELD_NUMBER: _ClassVar[int]
    REDIS_BYTES_FIELD_NUMBER: _ClassVar[int]
    NATS_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NATS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FILES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    redis_keys: int
    redis_bytes: int
    nats_messages: int
    nats_bytes: int
    disk_files: int
    disk_bytes: int
    def __init__(self, redis_keys: _Optional[int] = ..., redis_bytes: _Optional[int] = ..., nats_messages: _Optional[int] = ..., nats_bytes: _Optional[int] = ..., disk_files: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("job_id", "merged")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    merged: bool
    def __init__(self, job_id: _Optional[str] = ..., merged: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("all_tenants",)
    ALL_TENANTS_FIELD_NUMBER: _ClassVar[int]
    all_tenants: bool
    def __init__(self, all_tenants: _Optional[bool] = ...) -> None: ...

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

class TenantShare(_message.Message):
    __slots__ = ("tenant", "jobs", "weight", "served_s", "share", "fair_share")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SERVED_S_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    jobs: int
    weight: float
    served_s: float
    share: float
    fair_share: float
    def __init__(self, tenant: _Optional[str] = ..., jobs: _Optional[int] = ..., weight: _Optional[float] = ..., served_s: _Optional[float] = ..., share: _Optional[float] = ..., fair_share: _Optional[float] = ...) -> None: ...

class FleetStatus(_message.Message):
    __slots__ = ("members", "queues", "unix_ms", "reward_sandbox", "shares")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REWARD_SANDBOX_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[FleetMember]
    queues: _containers.RepeatedCompositeFieldContainer[TaskQueue]
    unix_ms: int
    reward_sandbox: str
    shares: _containers.RepeatedCompositeFieldContainer[TenantShare]
    def __init__(self, members: _Optional[_Iterable[_Union[FleetMember, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[TaskQueue, _Mapping]]] = ..., unix_ms: _Optional[int] = ..., reward_sandbox: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[TenantShare, _Mapping]]] = ...) -> None: ...

class GetJobAccountingRequest(_message.Message):
    __slots__ = ("job_id", "include_tasks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TASKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    include_tasks: bool
    def __init__(self, job_id: _Optional[str] = ..., include_tasks: _Optional[bool] = ...) -> None: ...

class TaskAccount(_message.Message):
    __slots__ = ("task_id", "epoch", "prompt_index", "fate", "steps", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    FATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    epoch: int
    prompt_index: int
    fate: TaskFate
    steps: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt_index: _Optional[int] = ..., fate: _Optional[_Union[TaskFate, str]] = ..., steps: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class JobAccounting(_message.Message):
    __slots__ = ("job_id", "counts", "balanced", "tasks", "unix_ms")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    BALANCED_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    counts: _containers.ScalarMap[str, int]
    balanced: bool
    tasks: _containers.RepeatedCompositeFieldContainer[TaskAccount]
    unix_ms: int
    def __init__(self, job_id: _Optional[str] = ..., counts: _Optional[_Mapping[str, int]] = ..., balanced: _Optional[bool] = ..., tasks: _Optional[_Iterable[_Union[TaskAccount, _Mapping]]] = ..., unix_ms: _Optional[int] = ...) -> None: ...
