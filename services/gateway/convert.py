"""Conversions between JobService protos and the gateway's domain (the server side; the client's side and
the numbering both share are `fleetrl.sdk.convert`). Step metrics are stored by the learner as a flat
JSON object; `step`, `policy_version` and `unix_ms` are structural, every other number is a value.
"""

from __future__ import annotations

import math
from typing import Any

from fleetrl.jobs.store import JobRecord, now_ms
from fleetrl.proto.fleetrl.v1 import gateway_pb2, learner_pb2
from fleetrl.sdk.convert import FATES, STATES, STRUCTURAL
from fleetrl.services.gateway.checks import Submission
from fleetrl.services.gateway.service import FleetView, ModelChunk, WatchEvent
from fleetrl.tasks.ledger import Accounting


def to_submission(request: gateway_pb2.SubmitJobRequest) -> Submission:
    return Submission(spec_text=request.spec, spec_format=request.spec_format, prompts=request.prompts,
                      reward_file=request.reward_file, idempotency_key=request.idempotency_key,
                      eval_prompts=request.eval_prompts, environment_file=request.environment_file)


def step_to_proto(metrics: dict[str, Any]) -> learner_pb2.StepMetrics:
    values = {k: float(v) for k, v in metrics.items()
              if k not in STRUCTURAL and isinstance(v, int | float) and math.isfinite(float(v))}
    return learner_pb2.StepMetrics(step=int(metrics.get("step", 0)), values=values,
                                   policy_version=int(metrics.get("policy_version", 0)),
                                   unix_ms=int(metrics.get("unix_ms", 0)))


def job_to_proto(record: JobRecord) -> gateway_pb2.Job:
    job = gateway_pb2.Job(
        job_id=record.job_id, tenant=record.tenant, name=record.name, state=STATES[record.state],
        reason=record.reason, spec_json=record.spec.model_dump_json(), created_unix_ms=record.created_ms,
        updated_unix_ms=record.updated_ms, model_uri=record.model_uri, sandbox=record.sandbox,
    )
    if record.last_step is not None:
        job.last.CopyFrom(step_to_proto(record.last_step))
    return job


def event_to_proto(event: WatchEvent) -> gateway_pb2.JobEvent:
    out = gateway_pb2.JobEvent(job=job_to_proto(event.job))
    if event.step is not None:
        out.step.CopyFrom(step_to_proto(event.step))
    elif event.state is not None:
        out.state = STATES[event.state]
    return out


def chunk_to_proto(chunk: ModelChunk) -> gateway_pb2.FileChunk:
    return gateway_pb2.FileChunk(path=chunk.path, offset=chunk.offset, data=chunk.data, last=chunk.last)


def fleet_to_proto(view: FleetView) -> gateway_pb2.FleetStatus:
    members = [gateway_pb2.FleetMember(
        kind=m.kind, member_id=m.member_id, state=m.state, job_id=m.job_id, policy_version=m.policy_version,
        tokens_per_s=m.tokens_per_s, busy_fraction=m.busy_fraction, seen_unix_ms=m.unix_ms) for m in view.members]
    queues = [gateway_pb2.TaskQueue(job_id=q.job_id, pending=q.pending, in_flight=q.in_flight,
                                    redelivered=q.redelivered, dead_lettered=q.dead_lettered) for q in view.queues]
    shares = [gateway_pb2.TenantShare(tenant=s.tenant, jobs=s.jobs, weight=s.weight, served_s=s.served_s,
                                      share=s.share, fair_share=s.fair_share) for s in view.shares]
    return gateway_pb2.FleetStatus(members=members, queues=queues, unix_ms=view.unix_ms,
                                   reward_sandbox=view.reward_sandbox, shares=shares)


def accounting_to_proto(accounting: Accounting, include_tasks: bool) -> gateway_pb2.JobAccounting:
    out = gateway_pb2.JobAccounting(job_id=accounting.job_id, counts=accounting.counts,
                                    balanced=accounting.balanced, unix_ms=now_ms())
    if include_tasks:
        out.tasks.extend(gateway_pb2.TaskAccount(
            task_id=t.task_id, epoch=t.epoch, prompt_index=t.prompt_index, fate=FATES[t.fate], steps=t.steps,
            reason=t.reason) for t in accounting.tasks)
    return out


