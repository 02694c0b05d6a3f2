"""The gateway's domain core: jobs scoped to their tenant, over the Redis job store. No grpc here.

Design choices:
- Another tenant's job answers NOT_FOUND, exactly like a job that does not exist, so job ids
  cannot be probed across tenants.
- Submission gathers every violation (spec, the operator's model allow-list and resource caps, prompt
  lines, file pairing, and the reward service's verdict on the reward spec) into one ConfigError; an
  unreachable reward service is UNAVAILABLE, never an unchecked accept. The violations travel back in
  trailing metadata, which gRPC clients refuse past 8-16 KiB, so the report is clipped to
  REPORT_BYTES (the rest is counted, not shown).
- Watching polls the store (`get` + `steps`) rather than a transient channel: the store is the
  source of truth, so a stream resumed after a gateway restart (with from_step) misses nothing.
- WatchJob's from_step is a uint64; a from_step past the job's max_steps means "no steps" and is
  clamped to max_steps + 1, so `Run.wait` (from_step 2**62) and any uint64 work.
- Cancel is idempotent: cancelling a cancelled job purges its queued tasks again (a retry after a
  failed purge completes it); cancelling a succeeded or failed job is a no-op.
- The ledger of a job (GetJobAccounting) is computed on demand from Redis and NATS, never cached.
- `model = "job:<id>"` (a warm start from an sft job) is resolved at submission to that job's exported
  directory, only for the job's own tenant (another tenant's reads as not existing) and only once it has
  succeeded; the stored spec names the directory. A job some queued or running job starts from is not
  deleted (by DeleteJob or retention) until that job ends.
- The fleet view lists every live member (capacity is shared), but a member working on another
  tenant's job is shown without that job, and only the caller's own queues are listed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from fleetrl.errors import (
    ConfigError,
    FailedPrecondition,
    FieldViolation,
    FleetError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    clip,
)
from fleetrl.jobs.retention import Footprint
from fleetrl.jobs.store import ACTIVE, ADAPTER_DIR, JobRecord, JobState, JobStore, now_ms
from fleetrl.policy.models import JOB_MODEL_PREFIX
from fleetrl.runtime.heartbeat import Beat
from fleetrl.services.gateway.checks import (
    Admission,
    JobModel,
    Limits,
    Submission,
    check_sizes,
    check_submission,
    job_reference_of,
)
from fleetrl.services.gateway.config import TenantQuota
from fleetrl.spec.config import EnvironmentSpec, RewardSpec
from fleetrl.tasks import ledger
from fleetrl.tasks.bus import TaskQueue, check_job_id
from fleetrl.tasks.ledger import Accounting

if TYPE_CHECKING:
    from fleetrl.proto.fleetrl.v1 import reward_pb2
    from fleetrl.reward.client import Validation

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 1000
MAX_RETENTION_SCAN = 1_000_000
"""Most jobs one retention pass looks at."""
REPORT_BYTES = 1200
CLIP_FIELD, CLIP_DESCRIPTION = 120, 240


class RewardChecker(Protocol):
    async def validate(self, spec: RewardSpec | EnvironmentSpec, source: bytes | None) -> Validation:
        """Whether the spec can score (an environment: can run; reason None) and the sandbox summary;
        Unavailable when unreachable."""

    async def describe(self) -> reward_pb2.SandboxReport:
        """The reward service's sandbox; a FleetError when it cannot be asked."""


class TaskPurger(Protocol):
    async def purge(self, job_id: str) -> None:
        """Drop the job's queued tasks."""


class JobDeleter(Protocol):
    async def delete(self, job_id: str) -> Footprint:
        """Delete everything the job holds in every store (`fleetrl.jobs.retention`); what it held."""


class EventSink(Protocol):
    async def publish(self, job_id: str, event: dict[str, Any]) -> None:
        """Announce a job event (best effort: the job store stays the source of truth)."""


class FleetSource(Protocol):
    async def members(self) -> list[Beat]:
        """The last heartbeat of every live actor and learner."""

    async def queue(self, job_id: str) -> TaskQueue:
        """The job's task queue now."""

    async def account(self, job_id: str, max_trainings: int) -> Accounting:
        """The job's end-to-end task ledger now (see fleetrl.tasks.ledger)."""


@dataclass(frozen=True)
class TenantShare:
    """A tenant's share of the actors' time over the heartbeat window (`fleetrl top`'s tenants table).

    `tenant` is "" for every other tenant together: a caller sees its own row and the rest of the fleet
    as one, never another tenant's name or jobs (an operator asking for every tenant's: one row each).
    """

    tenant: str
    jobs: int
    """Its queued and running jobs."""
    weight: float
    """Its weight (the gateway's `TenantQuota.weight` at submission); summed for the other tenants."""
    served_s: float
    """Actor seconds spent on its jobs' tasks in the window, summed over live actors."""
    share: float
    """served_s over every tenant's served_s (0 when no actor served anything)."""
    fair_share: float
    """weight over the weights of every tenant with an active job: its share when all of them keep actors busy."""


@dataclass(frozen=True)
class FleetView:
    """What GetFleet answers: live members, the caller's task queues and its share, as of unix_ms."""

    members: list[Beat]
    queues: list[TaskQueue]
    unix_ms: int
    reward_sandbox: str = ""
    shares: list[TenantShare] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class WatchEvent:
    """The job after the event, and either its new state or a finished step's metrics."""

    job: JobRecord
    state: JobState | None = None
    step: dict[str, Any] | None = None


@dataclass(frozen=True)
class ModelChunk:
    """A piece of one file of an exported model directory."""

    path: str
    offset: int
    data: bytes
    last: bool


class Gateway:
    """Job submission, lookup, cancellation, watching and model download for authenticated tenants."""

    store: JobStore
    reward: RewardChecker
    purger: TaskPurger
    events: EventSink
    fleet_source: FleetSource
    limits: Limits
    admission: Admission
    poll_s: float
    chunk_bytes: int

    def __init__(self, store: JobStore, reward: RewardChecker, purger: TaskPurger, events: EventSink,
                 fleet_source: FleetSource, limits: Limits, admission: Admission | None = None, *,
                 deleter: JobDeleter | None = None, poll_s: float = 0.25, chunk_bytes: int = 1 << 20) -> None:
        self.store, self.reward, self.purger, self.events, self.deleter = store, reward, purger, events, deleter
        self.fleet_source = fleet_source
        self.limits, self.admission = limits, admission if admission is not None else Admission()
        self.poll_s, self.chunk_bytes = poll_s, chunk_bytes

    async def submit(self, tenant: str, sub: Submission) -> JobRecord:
        """Check everything, then store the job with its files (same idempotency key, same job)."""
        check_sizes(sub, self.limits)
        reference = job_reference_of(sub)
        job_model = await self.job_model(tenant, reference) if reference is not None else None
        checked = await asyncio.to_thread(check_submission, sub, self.admission, job_model)
        violations = list(checked.violations)
        sandbox = ""
        if checked.reward is not None:
            bad, sandbox = await self._reward_violations(checked.reward, sub.reward_file)
            violations += bad
        if checked.environment is not None and sub.environment_file:
            verdict = await self.reward.validate(checked.environment, sub.environment_file)
            violations += [FieldViolation("environment.file", verdict.reason)] if verdict.reason is not None else []
            sandbox = verdict.sandbox
        if violations or checked.spec is None:
            raise ConfigError("invalid job submission", reported(violations))
        async with self.store.submission_lock(tenant):  # the quota count and the create, with nothing between
            quota = await self._check_quota(tenant, sub.idempotency_key)
            record = await self.store.create(tenant, checked.spec, sub.prompts, sub.reward_file or None,
                                             sub.idempotency_key, eval_prompts=sub.eval_prompts or None,
                                             sandbox=sandbox, environment_file=sub.environment_file or None,
                                             weight=quota.weight)
        log.info("job %s (%s) submitted by %s", record.job_id, record.name, tenant)
        await self.events.publish(record.job_id, {"type": "submitted", "state": record.state.value})
        return record

    async def job_model(self, tenant: str, reference: str) -> JobModel:
        """`job:<id>` resolved for the tenant: the exported model directory of its own succeeded job; another
        tenant's job reads as one that does not exist."""
        job_id = reference.removeprefix(JOB_MODEL_PREFIX)
        try:
            return JobModel(reference, str(model_dir(await self.get(tenant, job_id), merged=True)))
        except (NotFound, InvalidArgument):
            return JobModel(reference, None, f"{clip(reference, 80)!r}: job {clip(job_id, 80)!r} does not exist")
        except FailedPrecondition as error:
            return JobModel(reference, None, f"{reference!r}: {error}")

    async def _check_quota(self, tenant: str, idempotency_key: str) -> TenantQuota:
        """The tenant's quota; ResourceExhausted naming it when the tenant holds max_active_jobs queued or
        running jobs (a retried submission of a job that exists already passes)."""
        quota, setting = self.admission.quotas(tenant)
        if idempotency_key and await self.store.find_idempotent(tenant, idempotency_key) is not None:
            return quota
        active = sum(1 for record in await self.store.active_jobs() if record.tenant == tenant)
        if active >= quota.max_active_jobs:
            raise ResourceExhausted(f"tenant {tenant} has {active} queued or running jobs, its quota "
                                    f"max_active_jobs {quota.max_active_jobs} ({setting}.max_active_jobs)")
        return quota

    async def _reward_violations(self, spec: RewardSpec, source: bytes) -> tuple[list[FieldViolation], str]:
        """The reward service's objections to the spec, and the sandbox summary it reported."""
        if spec.file is not None and not source:
            return [], ""  # already reported as a missing reward_file
        verdict = await self.reward.validate(spec, source or None)
        if verdict.reason is None:
            return [], verdict.sandbox
        return [FieldViolation("reward.file" if spec.file is not None else "reward.builtin", verdict.reason)], \
            verdict.sandbox

    async def get(self, tenant: str, job_id: str) -> JobRecord:
        """The tenant's job; NotFound for an unknown job or another tenant's."""
        check_job_id(job_id)
        try:
            record = await self.store.get(job_id)
        except NotFound:
            record = None
        if record is None or record.tenant != tenant:
            raise NotFound(f"job {job_id!r} does not exist")
        return record

    async def list_jobs(self, tenant: str | None, limit: int) -> list[JobRecord]:
        """The tenant's jobs, newest first; every tenant's for an operator (tenant None)."""
        return await self.store.list(tenant, limit)

    async def cancel(self, tenant: str, job_id: str, reason: str) -> JobRecord:
        """Cancel a queued or running job and drop its queued tasks."""
        if len(reason) > MAX_REASON_CHARS:
            raise InvalidArgument("invalid cancel request", [FieldViolation(
                "reason", f"{len(reason)} characters, more than the limit of {MAX_REASON_CHARS}")])
        record = await self.get(tenant, job_id)
        if record.state in ACTIVE:
            try:
                record = await self.store.set_state(job_id, JobState.CANCELLED, reason or "cancelled by user")
            except FailedPrecondition:  # it finished meanwhile
                record = await self.store.get(job_id)
            if record.state is JobState.CANCELLED:
                log.info("job %s cancelled by %s", job_id, tenant)
                await self.events.publish(job_id, {"type": "cancelled", "state": record.state.value})
        if record.state is JobState.CANCELLED:
            await self.purger.purge(job_id)
        return record

    async def delete(self, tenant: str, job_id: str) -> Footprint:
        """Delete a finished job's data from every store; what it held. FailedPrecondition while it is
        queued or running."""
        record = await self.get(tenant, job_id)
        if record.state in ACTIVE:
            raise FailedPrecondition(f"job {job_id} is {record.state.value}: cancel it before deleting it")
        return await self._delete(record)

    async def _deletable(self, record: JobRecord) -> bool:
        """A finished job whose learner has let go of it (a learner writes until it releases its lease) and
        whose exported model no queued or running job starts from."""
        return (record.state not in ACTIVE and await self.store.lease_holder(record.job_id) is None
                and await self._started_from(record) is None)

    async def _started_from(self, record: JobRecord) -> JobRecord | None:
        """A queued or running job whose model is this job's export (`job:<id>`), or None."""
        if not record.model_uri:
            return None
        exported = record.model_uri.removeprefix("file://")
        return next((r for r in await self.store.active_jobs() if r.spec.model == exported), None)

    async def expire(self, retention_s: float) -> list[str]:
        """Delete every finished job that ended more than retention_s ago; their ids."""
        cutoff = now_ms() - retention_s * 1000
        expired = [r for r in await self.store.list(None, limit=MAX_RETENTION_SCAN)
                   if r.updated_ms < cutoff and await self._deletable(r)]
        for record in expired:
            await self._delete(record)
        return [r.job_id for r in expired]

    async def _delete(self, record: JobRecord) -> Footprint:
        if self.deleter is None:
            raise FailedPrecondition("this gateway cannot delete jobs (no deleter wired)")
        if (user := await self._started_from(record)) is not None:
            raise FailedPrecondition(f"job {user.job_id} ({user.state.value}) starts from job {record.job_id}'s model: "
                                     "delete it once that job has ended")
        if not await self._deletable(record):
            raise FailedPrecondition(f"job {record.job_id}'s learner still holds it: delete it again in a moment")
        held = await self.deleter.delete(record.job_id)
        log.info("job %s of %s deleted: %d Redis keys (%d bytes), %d NATS messages (%d bytes), %d files (%d bytes)",
                 record.job_id, record.tenant, held.redis_keys, held.redis_bytes, held.nats_messages,
                 held.nats_bytes, held.disk_files, held.disk_bytes)
        return held

    async def watch(self, tenant: str, job_id: str, from_step: int = 0) -> AsyncIterator[WatchEvent]:
        """The current state, then every step from from_step and every state change, until the end."""
        record = await self.get(tenant, job_id)
        yield WatchEvent(record, state=record.state)
        next_step, state = min(max(1, from_step), record.spec.train.max_steps + 1), record.state
        while True:
            record = await self.store.get(job_id)
            # read after the record, so a terminal record's steps are all in them
            steps = cast("list[dict[str, Any]]", await self.store.steps(job_id, next_step))
            for metrics in steps:
                yield WatchEvent(record, step=metrics)
            next_step += len(steps)
            if record.state is not state:
                state = record.state
                yield WatchEvent(record, state=state)
            if state.terminal:
                return
            await asyncio.sleep(self.poll_s)

    async def fleet(self, tenant: str | None) -> FleetView:
        """Every live member (another tenant's job hidden) and the queue of each of the tenant's active jobs;
        for an operator (tenant None) every tenant's, by name."""
        members = await self.fleet_source.members()
        active = await self.store.active_jobs()
        owners: dict[str, str | None] = {record.job_id: record.tenant for record in active}
        for job in {m.job_id for m in members if m.job_id} | {job for m in members for job in m.served_s}:
            if job not in owners:  # finished since a member's beat, or deleted
                owners[job] = await self._owner(job)
        visible = [seen_by(tenant, member, owners) for member in members]
        mine = sorted((r for r in active if tenant is None or r.tenant == tenant), key=lambda r: r.job_id)
        queues = [await self.fleet_source.queue(record.job_id) for record in mine]
        shares = tenant_shares(tenant, members, owners, active)
        return FleetView(visible, queues, now_ms(), await self._reward_sandbox(), shares)

    async def backlog(self) -> int:
        """Tasks queued or in flight over every tenant's active jobs: what the actors' autoscaler scales on
        (one figure for the whole fleet, since every actor serves every job)."""
        queues = [await self.fleet_source.queue(record.job_id) for record in await self.store.active_jobs()]
        return sum(queue.pending + queue.in_flight for queue in queues)

    async def _reward_sandbox(self) -> str:
        try:
            return (await self.reward.describe()).summary
        except FleetError as error:
            return f"reward service not answering: {error}"

    async def accounting(self, tenant: str, job_id: str) -> Accounting:
        """What became of every task the tenant's job published."""
        record = await self.get(tenant, job_id)
        return await self.fleet_source.account(job_id, ledger.max_trainings(record.spec))

    async def _owner(self, job_id: str) -> str | None:
        try:
            return (await self.store.get(job_id)).tenant
        except NotFound:
            return None

    async def model_chunks(self, tenant: str, job_id: str, merged: bool = False) -> AsyncIterator[ModelChunk]:
        """Every file of the succeeded job's exported model (a LoRA job's adapter directory unless
        `merged`), in chunk_bytes pieces, sorted by path."""
        root = model_dir(await self.get(tenant, job_id), merged)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            async for chunk in file_chunks(path, path.relative_to(root).as_posix(), self.chunk_bytes):
                yield chunk


def reported(violations: list[FieldViolation]) -> list[FieldViolation]:
    """The violations that fit in REPORT_BYTES (UTF-8) of fields and descriptions, each clipped."""
    out: list[FieldViolation] = []
    used = 0
    for violation in violations:
        clipped = FieldViolation(clip(violation.field, CLIP_FIELD), clip(violation.description, CLIP_DESCRIPTION))
        used += len(clipped.field.encode()) + len(clipped.description.encode())
        if used > REPORT_BYTES:
            break
        out.append(clipped)
    if len(out) < len(violations):
        out.append(FieldViolation("<more>", f"{len(violations) - len(out)} more problems not shown"))
    return out


def model_dir(record: JobRecord, merged: bool = False) -> Path:
    """The exported model directory of a succeeded job, for a LoRA job its adapter directory unless
    `merged`; FailedPrecondition otherwise."""
    if record.state is not JobState.SUCCEEDED:
        raise FailedPrecondition(f"job {record.job_id} is {record.state.value}; only a succeeded job has a model")
    if not record.model_uri:
        raise FailedPrecondition(f"job {record.job_id} succeeded but recorded no exported model")
    root = Path(record.model_uri.removeprefix("file://"))
    if record.spec.train.lora is not None and not merged:
        root = root.parent / ADAPTER_DIR
    if not root.is_dir():
        raise FailedPrecondition(f"exported model {root} of job {record.job_id} is not on this gateway's storage")
    return root


async def file_chunks(path: Path, rel: str, chunk_bytes: int) -> AsyncIterator[ModelChunk]:
    with path.open("rb") as fh:
        offset = 0
        data = await asyncio.to_thread(fh.read, chunk_bytes)
        while True:
            following = await asyncio.to_thread(fh.read, chunk_bytes) if data else b""
            yield ModelChunk(rel, offset, data, last=not following)
            if not following:
                return
            offset += len(data)
            data = following


def event_payload(job_id: str, event: dict[str, Any]) -> dict[str, Any]:
    return {"job_id": job_id, "unix_ms": now_ms(), **event}


def seen_by(tenant: str | None, member: Beat, owners: dict[str, str | None]) -> Beat:
    """A member's beat as the tenant may see it: another tenant's job, its version and its seconds hidden
    (tenant None, an operator: all of it)."""
    if tenant is None:
        return member
    own = owners.get(member.job_id) == tenant
    return dataclasses.replace(member, job_id=member.job_id if own else "",
                               policy_version=member.policy_version if own else 0,
                               served_s={job: s for job, s in member.served_s.items() if owners.get(job) == tenant})


def tenant_shares(tenant: str | None, members: list[Beat], owners: dict[str, str | None],
                  active: list[JobRecord]) -> list[TenantShare]:
    """The tenants' shares, from the actors' windowed served seconds and the active jobs' weights: the caller's
    row and one row for every other tenant together (omitted when there are none); for an operator (tenant
    None) one row per tenant, by name."""
    def row(owner: str) -> str:
        return owner if tenant is None or owner == tenant else ""

    served: dict[str, float] = defaultdict(float)
    for member in members:
        for job, seconds in member.served_s.items():
            owner = owners.get(job)
            if owner is not None:  # a deleted job's seconds belong to nobody
                served[row(owner)] += seconds
    weights: dict[str, float] = {}
    for record in active:
        weights[record.tenant] = max(weights.get(record.tenant, 0.0), record.weight)
    jobs, row_weight = Counter(row(r.tenant) for r in active), defaultdict[str, float](float)
    for owner, weight in weights.items():
        row_weight[row(owner)] += weight
    total_s, total_weight = sum(served.values()), sum(weights.values())
    shown = {name for name in set(served) | set(jobs) if jobs[name] or served[name]}
    names = sorted(shown) if tenant is None else [tenant, *([""] if "" in shown else [])]
    return [TenantShare(name, jobs[name], row_weight[name], round(served[name], 3),
                        served[name] / total_s if total_s else 0.0,
                        row_weight[name] / total_weight if total_weight else 0.0) for name in names]
