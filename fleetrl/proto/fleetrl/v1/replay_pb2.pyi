from fleetrl.proto.fleetrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLER_KIND_UNSPECIFIED: _ClassVar[SamplerKind]
    SAMPLER_KIND_FIFO: _ClassVar[SamplerKind]
    SAMPLER_KIND_UNIFORM: _ClassVar[SamplerKind]
    SAMPLER_KIND_PRIORITIZED: _ClassVar[SamplerKind]

class InsertOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSERT_OUTCOME_UNSPECIFIED: _ClassVar[InsertOutcome]
    INSERT_OUTCOME_INSERTED: _ClassVar[InsertOutcome]
    INSERT_OUTCOME_DUPLICATE: _ClassVar[InsertOutcome]
SAMPLER_KIND_UNSPECIFIED: SamplerKind
SAMPLER_KIND_FIFO: SamplerKind
SAMPLER_KIND_UNIFORM: SamplerKind
SAMPLER_KIND_PRIORITIZED: SamplerKind
INSERT_OUTCOME_UNSPECIFIED: InsertOutcome
INSERT_OUTCOME_INSERTED: InsertOutcome
INSERT_OUTCOME_DUPLICATE: InsertOutcome

class ConfigureTableRequest(_message.Message):
    __slots__ = ("job_id", "capacity_groups", "sampler", "max_reuse", "lease_timeout_s", "lease_epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    MAX_REUSE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    capacity_groups: int
    sampler: SamplerKind
    max_reuse: int
    lease_timeout_s: float
    lease_epoch: int
    def __init__(self, job_id: _Optional[str] = ..., capacity_groups: _Optional[int] = ..., sampler: _Optional[_Union[SamplerKind, str]] = ..., max_reuse: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ..., lease_epoch: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("job_id", "config", "size_groups")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SIZE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    config: ConfigureTableRequest
    size_groups: int
    def __init__(self, job_id: _Optional[str] = ..., config: _Optional[_Union[ConfigureTableRequest, _Mapping]] = ..., size_groups: _Optional[int] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.Group]
    def __init__(self, groups: _Optional[_Iterable[_Union[_common_pb2.Group, _Mapping]]] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("outcomes", "evicted_groups")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedScalarFieldContainer[InsertOutcome]
    evicted_groups: int
    def __init__(self, outcomes: _Optional[_Iterable[_Union[InsertOutcome, str]]] = ..., evicted_groups: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("job_id", "max_groups", "min_policy_version", "wait_s", "seed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    max_groups: int
    min_policy_version: int
    wait_s: float
    seed: int
    def __init__(self, job_id: _Optional[str] = ..., max_groups: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("lease_id", "groups", "stale_dropped", "lease_expires_unix_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.Group]
    stale_dropped: int
    lease_expires_unix_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_common_pb2.Group, _Mapping]]] = ..., stale_dropped: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("job_id", "lease_id", "lease_epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    lease_epoch: int
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_epoch: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed_groups",)
    COMMITTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    committed_groups: int
    def __init__(self, committed_groups: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_id", "lease_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_groups",)
    RELEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    released_groups: int
    def __init__(self, released_groups: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("job_id", "lease_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("missing_lease_ids", "lease_expires_unix_ms")
    MISSING_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    missing_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_expires_unix_ms: int
    def __init__(self, missing_lease_ids: _Optional[_Iterable[str]] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("job_id", "size_groups", "leased_groups", "inserted", "duplicates", "sampled", "committed", "expired_leases", "evicted", "stale_dropped")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    size_groups: int
    leased_groups: int
    inserted: int
    duplicates: int
    sampled: int
    committed: int
    expired_leases: int
    evicted: int
    stale_dropped: int
    def __init__(self, job_id: _Optional[str] = ..., size_groups: _Optional[int] = ..., leased_groups: _Optional[int] = ..., inserted: _Optional[int] = ..., duplicates: _Optional[int] = ..., sampled: _Optional[int] = ..., committed: _Optional[int] = ..., expired_leases: _Optional[int] = ..., evicted: _Optional[int] = ..., stale_dropped: _Optional[int] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("job_id", "min_policy_version", "max_policy_version", "min_reward", "max_reward", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_REWARD_FIELD_NUMBER: _ClassVar[int]
    MAX_REWARD_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    min_policy_version: int
    max_policy_version: int
    min_reward: float
    max_reward: float
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., min_reward: _Optional[float] = ..., max_reward: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class LineageRecord(_message.Message):
    __slots__ = ("task_id", "policy_version", "mean_reward", "lineage", "times_committed", "episode_turns", "episode_status")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    TIMES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    EPISODE_TURNS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_STATUS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    policy_version: int
    mean_reward: float
    lineage: _common_pb2.Lineage
    times_committed: int
    episode_turns: _containers.RepeatedScalarFieldContainer[int]
    episode_status: _containers.RepeatedScalarFieldContainer[_common_pb2.EpisodeStatus]
    def __init__(self, task_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., mean_reward: _Optional[float] = ..., lineage: _Optional[_Union[_common_pb2.Lineage, _Mapping]] = ..., times_committed: _Optional[int] = ..., episode_turns: _Optional[_Iterable[int]] = ..., episode_status: _Optional[_Iterable[_Union[_common_pb2.EpisodeStatus, str]]] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[LineageRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[LineageRecord, _Mapping]]] = ...) -> None: ...
