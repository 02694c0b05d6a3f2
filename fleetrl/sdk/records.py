"""What the Python client and the CLI hand to users: plain dataclasses, no protobuf."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

TERMINAL_STATES = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class StepInfo:
    """Metrics of one finished optimizer step (`values`: loss, reward_mean, kl, tokens_per_s, ...)."""

    step: int
    policy_version: int
    values: dict[str, float] = field(default_factory=dict)
    unix_ms: int = 0

    def __getitem__(self, name: str) -> float:
        return self.values[name]


@dataclass(frozen=True)
class JobInfo:
    """A job as the gateway reports it. `state` is one of queued, running, succeeded, failed, cancelled."""

    job_id: str
    tenant: str
    name: str
    state: str
    reason: str
    spec: dict[str, Any]
    created_unix_ms: int
    updated_unix_ms: int
    last: StepInfo | None
    model_uri: str
    sandbox: str = ""
    """The reward sandbox the job's reward was checked in at submission: "mode jail: ..." or, in the
    operator's weaker mode, "mode legacy: ..."."""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def max_steps(self) -> int:
        return int(self.spec.get("train", {}).get("max_steps", 0))

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class JobEventInfo:
    """One WatchJob event: the job after it, and either its new state or a step's metrics."""

    job: JobInfo
    state: str | None = None
    step: StepInfo | None = None


@dataclass(frozen=True)
class MemberInfo:
    """A live actor or learner (see FleetMember in gateway.proto)."""

    kind: str
    member_id: str
    state: str
    job_id: str
    policy_version: int
    tokens_per_s: float
    busy_fraction: float
    seen_unix_ms: int


@dataclass(frozen=True)
class QueueInfo:
    """A job's task queue (see TaskQueue in gateway.proto)."""

    job_id: str
    pending: int
    in_flight: int
    redelivered: int
    dead_lettered: int


@dataclass(frozen=True)
class ShareInfo:
    """A tenant's share of the actors' time (see TenantShare in gateway.proto); tenant "" is every other tenant."""

    tenant: str
    jobs: int
    weight: float
    served_s: float
    share: float
    fair_share: float


@dataclass(frozen=True)
class FleetInfo:
    """GetFleet's answer: live members and the caller's task queues."""

    members: list[MemberInfo]
    queues: list[QueueInfo]
    unix_ms: int
    reward_sandbox: str = ""
    """The reward service's sandbox: "mode jail: ... hold; missing: ...", or why it did not answer."""
    shares: list[ShareInfo] = field(default_factory=list)
    """The caller's share of the actors' time, then every other tenant's together."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TaskAccountInfo:
    """What became of one published task (see TaskAccount in gateway.proto)."""

    task_id: str
    epoch: int
    prompt_index: int
    fate: str
    steps: list[int]
    reason: str


@dataclass(frozen=True)
class AccountingInfo:
    """GetJobAccounting's answer: the job's ledger counts, and each task when asked for."""

    job_id: str
    counts: dict[str, int]
    balanced: bool
    tasks: list[TaskAccountInfo]
    unix_ms: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeletedInfo:
    """What a deleted job held in each store."""

    redis_keys: int
    redis_bytes: int
    nats_messages: int
    nats_bytes: int
    disk_files: int
    disk_bytes: int
