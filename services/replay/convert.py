"""Conversions between ReplayService messages and the domain core, with request validation.

Insert and Sample work on raw wire bytes (see `wire`): a group is stored as the
exact bytes the actor sent and handed to the learner as those bytes, parsed once
here only to validate it and read its metadata. Validation collects every bad
field as a FieldViolation.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from fleetrl.errors import FieldViolation, InvalidArgument, ResourceExhausted
from fleetrl.proto.fleetrl.v1 import common_pb2, replay_pb2
from fleetrl.replay import wire
from fleetrl.replay.samplers import SAMPLERS_BY_KIND
from fleetrl.replay.table import GroupRecord, LineageRow, SampleResult, TableConfig, TableStats

DEFAULT_QUERY_LIMIT = 100
PRIORITY_EPS = 1e-3
"""Added to mean |advantage| so a zero-variance group keeps a small chance of being sampled."""

def require_job(job_id: str, field: str = "job_id") -> str:
    if not job_id or len(job_id) > 256 or any(c in job_id for c in ":{} \t\n"):
        why = "must be 1-256 chars without ':', braces or whitespace"
        raise InvalidArgument(f"bad job id {job_id!r}: {why}", [FieldViolation(field, why)])
    return job_id


def to_table_config(req: replay_pb2.ConfigureTableRequest) -> TableConfig:
    """Table settings (`TableConfig.of`: 0 for max_reuse / lease_timeout_s means the defaults)."""
    require_job(req.job_id)
    if req.sampler not in SAMPLERS_BY_KIND:
        raise InvalidArgument(f"unknown sampler {req.sampler}", [FieldViolation("sampler", "unknown SamplerKind")])
    return TableConfig.of(req.capacity_groups, SAMPLERS_BY_KIND[req.sampler], req.max_reuse, req.lease_timeout_s)


def table_info(job_id: str, cfg: TableConfig, size_groups: int) -> replay_pb2.TableInfo:
    config = replay_pb2.ConfigureTableRequest(
        job_id=job_id, capacity_groups=cfg.capacity_groups, sampler=cfg.sampler.kind,
        max_reuse=cfg.max_reuse, lease_timeout_s=cfg.lease_timeout_s)
    return replay_pb2.TableInfo(job_id=job_id, config=config, size_groups=size_groups)


def group_violations(i: int, group: common_pb2.Group) -> list[FieldViolation]:
    where = f"groups[{i}]"
    bad = []
    if not group.job_id:
        bad.append(FieldViolation(f"{where}.job_id", "empty job id"))
    if not group.task_id:
        bad.append(FieldViolation(f"{where}.task_id", "empty task id"))
    if not group.samples:
        bad.append(FieldViolation(f"{where}.samples", "a group needs at least one sample"))
    for j, s in enumerate(group.samples):
        if len(s.completion_token_ids) != len(s.behaviour_logprobs):
            bad.append(FieldViolation(
                f"{where}.samples[{j}].behaviour_logprobs",
                f"{len(s.behaviour_logprobs)} log-probs for {len(s.completion_token_ids)} completion tokens"))
    return bad


EPISODE_TURNS, EPISODE_STATUS = "episode_turns", "episode_status"
"""Lineage keys of a multi-turn group (LineageRecord fields, not Lineage's)."""


def priority_of(group: common_pb2.Group) -> float:
    """Group.priority, or the mean |advantage| (reward minus group mean) when it is 0."""
    if group.priority > 0:
        return float(group.priority)
    rewards = [s.reward for s in group.samples]
    mean = sum(rewards) / len(rewards)
    return sum(abs(r - mean) for r in rewards) / len(rewards) + PRIORITY_EPS


def to_record(group: common_pb2.Group, payload: bytes) -> GroupRecord:
    lin = group.lineage
    rewards = [s.reward for s in group.samples]
    lineage = {"actor_id": lin.actor_id, "trace_id": lin.trace_id, "delivery_attempt": lin.delivery_attempt,
               "received_unix_ms": lin.received_unix_ms, "generated_unix_ms": lin.generated_unix_ms,
               "scored_unix_ms": lin.scored_unix_ms, "span_id": lin.span_id}
    if any(s.turns for s in group.samples):  # a multi-turn group: each episode's turns and end
        lineage[EPISODE_TURNS] = [len(s.turns) for s in group.samples]
        lineage[EPISODE_STATUS] = [int(s.episode_status) for s in group.samples]
    return GroupRecord(group.job_id, group.task_id, group.policy_version, sum(rewards) / len(rewards),
                       priority_of(group), payload, lineage)


def to_records(request: bytes, max_request_bytes: int) -> list[GroupRecord]:
    """Validate the groups of a raw InsertRequest; each keeps its exact bytes. All-or-nothing."""
    if len(request) > max_request_bytes:
        raise ResourceExhausted(f"Insert request of {len(request)} bytes is over the limit of "
                                f"{max_request_bytes}; send fewer groups per request")
    payloads = wire.split_field(request, wire.INSERT_GROUPS_FIELD)
    if not payloads:
        raise InvalidArgument("Insert needs at least one group", [FieldViolation("groups", "empty")])
    groups = [_parse_group(i, p) for i, p in enumerate(payloads)]
    bad = [v for i, g in enumerate(groups) for v in group_violations(i, g)]
    if bad:
        raise InvalidArgument(f"invalid Insert request: {bad[0].field}: {bad[0].description}", bad)
    for i, g in enumerate(groups):
        require_job(g.job_id, f"groups[{i}].job_id")
    return [to_record(g, p) for g, p in zip(groups, payloads, strict=True)]


def _parse_group(i: int, payload: bytes) -> common_pb2.Group:
    try:
        return common_pb2.Group.FromString(payload)
    except DecodeError as error:
        raise InvalidArgument(f"groups[{i}] does not parse: {error}",
                              [FieldViolation(f"groups[{i}]", "not a Group message")]) from None


def insert_response(outcomes: list[bool], evicted: int) -> replay_pb2.InsertResponse:
    codes = [replay_pb2.INSERT_OUTCOME_INSERTED if ok else replay_pb2.INSERT_OUTCOME_DUPLICATE for ok in outcomes]
    return replay_pb2.InsertResponse(outcomes=codes, evicted_groups=evicted)


def sample_response(result: SampleResult) -> bytes:
    """A serialised SampleResponse whose groups are the stored bytes, not re-encoded."""
    header = replay_pb2.SampleResponse(lease_id=result.lease_id, stale_dropped=result.stale_dropped,
                                       lease_expires_unix_ms=result.expires_unix_ms).SerializeToString()
    return wire.append_field(header, wire.SAMPLE_GROUPS_FIELD, result.payloads)


def stats_to_proto(stats: TableStats) -> replay_pb2.TableStats:
    names = replay_pb2.TableStats.DESCRIPTOR.fields_by_name
    return replay_pb2.TableStats(**{name: getattr(stats, name) for name in names})


def query_args(req: replay_pb2.QueryRequest) -> tuple[int, int | None, tuple[float, float] | None, int]:
    require_job(req.job_id)
    max_pv = req.max_policy_version or None
    if max_pv is not None and max_pv < req.min_policy_version:
        raise InvalidArgument("empty policy-version range",
                              [FieldViolation("max_policy_version", "below min_policy_version")])
    rewards = None if req.min_reward == 0 and req.max_reward == 0 else (req.min_reward, req.max_reward)
    if rewards is not None and rewards[1] < rewards[0]:
        raise InvalidArgument("empty reward range", [FieldViolation("max_reward", "below min_reward")])
    return req.min_policy_version, max_pv, rewards, req.limit or DEFAULT_QUERY_LIMIT


def query_response(rows: list[LineageRow]) -> replay_pb2.QueryResponse:
    records = []
    for row in rows:
        fields = dict(row.lineage)
        turns, statuses = fields.pop(EPISODE_TURNS, []), fields.pop(EPISODE_STATUS, [])
        records.append(replay_pb2.LineageRecord(task_id=row.task_id, policy_version=row.policy_version,
                                                mean_reward=row.mean_reward, lineage=common_pb2.Lineage(**fields),
                                                times_committed=row.times_committed, episode_turns=turns,
                                                episode_status=statuses))
    return replay_pb2.QueryResponse(records=records)
