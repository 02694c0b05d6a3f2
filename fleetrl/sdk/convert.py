"""Conversions from JobService protos to the client's records (`JobInfo`, `StepInfo`, `JobEventInfo`, ...),
and the job-state and task-fate numbering both sides of the wire share. The gateway's server side (requests
to its domain, its domain to protos) is `fleetrl.services.gateway.convert`.
"""

from __future__ import annotations

import json

from fleetrl.jobs.store import JobState
from fleetrl.proto.fleetrl.v1 import gateway_pb2, learner_pb2
from fleetrl.sdk.records import (
    AccountingInfo,
    FleetInfo,
    JobEventInfo,
    JobInfo,
    MemberInfo,
    QueueInfo,
    ShareInfo,
    StepInfo,
    TaskAccountInfo,
)
from fleetrl.tasks.ledger import Fate

STATES = {state: getattr(gateway_pb2, f"JOB_STATE_{state.name}") for state in JobState}
STATE_NAMES = {number: state.value for state, number in STATES.items()}
FATES = {fate: getattr(gateway_pb2, f"TASK_FATE_{fate.name}") for fate in Fate}
FATE_NAMES = {number: fate.value for fate, number in FATES.items()}
STRUCTURAL = ("step", "policy_version", "unix_ms")
"""Step-metric keys that are fields of `StepMetrics`, not values."""


def step_info(step: learner_pb2.StepMetrics) -> StepInfo:
    return StepInfo(step=step.step, policy_version=step.policy_version, values=dict(step.values),
                    unix_ms=step.unix_ms)


def job_info(job: gateway_pb2.Job) -> JobInfo:
    return JobInfo(
        job_id=job.job_id, tenant=job.tenant, name=job.name, state=STATE_NAMES.get(job.state, "unspecified"),
        reason=job.reason, spec=json.loads(job.spec_json) if job.spec_json else {},
        created_unix_ms=job.created_unix_ms, updated_unix_ms=job.updated_unix_ms,
        last=step_info(job.last) if job.HasField("last") else None, model_uri=job.model_uri, sandbox=job.sandbox,
    )


def event_info(event: gateway_pb2.JobEvent) -> JobEventInfo:
    kind = event.WhichOneof("event")
    return JobEventInfo(
        job=job_info(event.job),
        state=STATE_NAMES.get(event.state, "unspecified") if kind == "state" else None,
        step=step_info(event.step) if kind == "step" else None,
    )


def fleet_info(status: gateway_pb2.FleetStatus) -> FleetInfo:
    members = [MemberInfo(m.kind, m.member_id, m.state, m.job_id, m.policy_version, m.tokens_per_s,
                          m.busy_fraction, m.seen_unix_ms) for m in status.members]
    queues = [QueueInfo(q.job_id, q.pending, q.in_flight, q.redelivered, q.dead_lettered) for q in status.queues]
    shares = [ShareInfo(s.tenant, s.jobs, s.weight, s.served_s, s.share, s.fair_share) for s in status.shares]
    return FleetInfo(members, queues, status.unix_ms, status.reward_sandbox, shares)


def accounting_info(accounting: gateway_pb2.JobAccounting) -> AccountingInfo:
    tasks = [TaskAccountInfo(t.task_id, t.epoch, t.prompt_index, FATE_NAMES.get(t.fate, "unspecified"),
                             list(t.steps), t.reason) for t in accounting.tasks]
    return AccountingInfo(accounting.job_id, dict(accounting.counts), accounting.balanced, tasks, accounting.unix_ms)
