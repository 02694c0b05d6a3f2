from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REWARD_STATUS_UNSPECIFIED: _ClassVar[RewardStatus]
    REWARD_STATUS_OK: _ClassVar[RewardStatus]
    REWARD_STATUS_ERROR: _ClassVar[RewardStatus]
    REWARD_STATUS_TIMEOUT: _ClassVar[RewardStatus]
    REWARD_STATUS_KILLED: _ClassVar[RewardStatus]

class EpisodeStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPISODE_STATUS_UNSPECIFIED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_DONE: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_MAX_TURNS: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_TRUNCATED: _ClassVar[EpisodeStatus]
    EPISODE_STATUS_ENV_ERROR: _ClassVar[EpisodeStatus]
REWARD_STATUS_UNSPECIFIED: RewardStatus
REWARD_STATUS_OK: RewardStatus
REWARD_STATUS_ERROR: RewardStatus
REWARD_STATUS_TIMEOUT: RewardStatus
REWARD_STATUS_KILLED: RewardStatus
EPISODE_STATUS_UNSPECIFIED: EpisodeStatus
EPISODE_STATUS_DONE: EpisodeStatus
EPISODE_STATUS_MAX_TURNS: EpisodeStatus
EPISODE_STATUS_TRUNCATED: EpisodeStatus
EPISODE_STATUS_ENV_ERROR: EpisodeStatus

class Task(_message.Message):
    __slots__ = ("job_id", "task_id", "epoch", "prompt_index", "prompt", "metadata_json", "min_policy_version", "published_unix_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    task_id: str
    epoch: int
    prompt_index: int
    prompt: str
    metadata_json: str
    min_policy_version: int
    published_unix_ms: int
    def __init__(self, job_id: _Optional[str] = ..., task_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt_index: _Optional[int] = ..., prompt: _Optional[str] = ..., metadata_json: _Optional[str] = ..., min_policy_version: _Optional[int] = ..., published_unix_ms: _Optional[int] = ...) -> None: ...

class Lineage(_message.Message):
    __slots__ = ("actor_id", "delivery_attempt", "trace_id", "received_unix_ms", "generated_unix_ms", "scored_unix_ms", "span_id")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SCORED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    delivery_attempt: int
    trace_id: str
    received_unix_ms: int
    generated_unix_ms: int
    scored_unix_ms: int
    span_id: str
    def __init__(self, actor_id: _Optional[str] = ..., delivery_attempt: _Optional[int] = ..., trace_id: _Optional[str] = ..., received_unix_ms: _Optional[int] = ..., generated_unix_ms: _Optional[int] = ..., scored_unix_ms: _Optional[int] = ..., span_id: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("start", "end", "reward", "finish_reason", "env_latency_s", "policy_version")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ENV_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    reward: float
    finish_reason: str
    env_latency_s: float
    policy_version: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[str] = ..., env_latency_s: _Optional[float] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids", "behaviour_logprobs", "completion_text", "reward", "reward_components", "reward_status", "reward_reason", "finish_reason", "loss_mask", "turns", "episode_status", "continues")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_REASON_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_STATUS_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    behaviour_logprobs: _containers.RepeatedScalarFieldContainer[float]
    completion_text: str
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    reward_status: RewardStatus
    reward_reason: str
    finish_reason: str
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    episode_status: EpisodeStatus
    continues: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., behaviour_logprobs: _Optional[_Iterable[float]] = ..., completion_text: _Optional[str] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., reward_status: _Optional[_Union[RewardStatus, str]] = ..., reward_reason: _Optional[str] = ..., finish_reason: _Optional[str] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., episode_status: _Optional[_Union[EpisodeStatus, str]] = ..., continues: _Optional[bool] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("job_id", "task_id", "policy_version", "samples", "lineage", "priority", "prompt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    task_id: str
    policy_version: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    lineage: Lineage
    priority: float
    prompt: str
    def __init__(self, job_id: _Optional[str] = ..., task_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., lineage: _Optional[_Union[Lineage, _Mapping]] = ..., priority: _Optional[float] = ..., prompt: _Optional[str] = ...) -> None: ...
