"""The feeder: turns the job's prompt JSONL into tasks on JetStream, bounded by staleness.

Design choice: the staleness bound is enforced twice, by pure functions of counters.
- At publish time the feeder keeps at most `prompts_per_step * (max_staleness + 1)` tasks in
  flight (published, not yet trained or dropped) and tags each task with the policy version
  current when it is published, so an actor never generates it with older weights. With
  max_staleness 0 that is strictly on-policy: step s's prompts go out after weights v=s.
- At sample time the learner at version v asks replay for groups of version >= v - max_staleness;
  replay drops older ones (counted stale), and the feeder publishes more prompts to fill the step.
A task that actors dead-letter never produces a group: the learner reads the job's dead-letter
count while it waits for data and settles the new ones (`settle_dead_lettered`), so they stop
holding places in the bound (with max_staleness 0, one such task would stall every later step).
Stale drops are settled the same way, from replay's count of them (`settle_stale`): a learner that
resumed from a checkpoint never heard of the drops after it, and without them the bound filled up
with tasks that will never bring a group (a resumed job stalled until its step timed out).
Prompts are shuffled per epoch with `seeding.prompt_order(n, seed, epoch)`; each task carries
`Nats-Msg-Id = bus.task_msg_id(job, epoch, index)`, so re-publishing after a resume is a no-op.
The cursor (epoch, position, counters) is saved in every checkpoint. Every task is recorded in
the job's ledger (`fleetrl.tasks.ledger`) before it is published.
Each task starts its trajectory's trace: a root span `feeder.publish` whose W3C context rides in
the message headers (`traceparent`) to the actor that takes it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry import context as otel_context

from fleetrl.errors import FailedPrecondition
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.runtime import telemetry
from fleetrl.spec import seeding
from fleetrl.spec.config import JobSpec
from fleetrl.spec.prompts import read_prompts
from fleetrl.tasks import bus
from fleetrl.tasks.jobbus import JobBus
from fleetrl.tasks.ledger import Ledger

_TRACER = telemetry.tracer("fleetrl.feeder")


@dataclass
class FeederCursor:
    """Where the feeder is: the next prompt to publish and how many tasks are settled."""

    epoch: int = 0
    position: int = 0
    """Index into `prompt_order(..., epoch)` of the next prompt to publish."""
    published: int = 0
    """Tasks published since the job started."""
    settled: int = 0
    """Published tasks whose groups were trained in a step or dropped as stale, or that were dead-lettered."""
    dead_lettered: int = 0
    """Tasks seen in the job's dead-letter subject (counted in settled)."""
    stale: int = 0
    """Groups replay dropped as stale, by its table's count for the job (counted in settled)."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], trained_groups: int) -> FeederCursor:
        """The cursor a checkpoint saved; `trained_groups`: the groups its steps trained (each step trains
        prompts_per_step). A cursor saved before `stale` existed has it recomputed: learners then settled
        the drops each Sample reply reported, so the drops counted in `settled` are what remains of it
        after the trained groups and the dead-lettered tasks. Taken as 0, every drop replay ever counted
        would be settled a second time, and the feeder would publish that many tasks beyond its bound."""
        cursor = cls(**{k: int(v) for k, v in data.items()})
        if "stale" not in data:
            cursor.stale = cursor.settled - cursor.dead_lettered - trained_groups
            if cursor.stale < 0:
                raise FailedPrecondition(
                    f"checkpoint cursor {data} holds no stale count, and its settled count is below the "
                    f"{trained_groups} trained groups plus the {cursor.dead_lettered} dead-lettered tasks, "
                    "so the stale drops it settled cannot be recomputed; resubmit the job")
        return cursor


# --------------------------------------------------------------------------- the bound, as pure functions


def in_flight_limit(prompts_per_step: int, max_staleness: int) -> int:
    """Most tasks published but not yet settled: the prompts of max_staleness + 1 steps."""
    return prompts_per_step * (max_staleness + 1)


def tasks_to_publish(cursor: FeederCursor, prompts_per_step: int, max_staleness: int) -> int:
    """How many tasks the feeder may publish now without exceeding the in-flight limit."""
    in_flight = max(0, cursor.published - cursor.settled)
    return max(0, in_flight_limit(prompts_per_step, max_staleness) - in_flight)


def sample_min_version(learner_version: int, max_staleness: int) -> int:
    """Oldest group version the learner at `learner_version` may train on."""
    return max(0, learner_version - max_staleness)


# --------------------------------------------------------------------------- prompts and publishing


@dataclass(frozen=True)
class Prompt:
    text: str
    metadata_json: str


def parse_prompts(data: bytes) -> list[Prompt]:
    """The prompt file's lines as tasks' prompts (`fleetrl.spec.prompts.read_prompts` reads it): the text,
    and the other fields as the task's metadata JSON."""
    return [Prompt(row.pop("prompt"), json.dumps(row, sort_keys=True)) for row in read_prompts(data)]


class Feeder:
    """Publishes a job's tasks within the in-flight bound and advances its cursor."""

    job_id: str
    spec: JobSpec
    prompts: list[Prompt]
    cursor: FeederCursor
    _bus: JobBus
    _ledger: Ledger
    lease_epoch: int
    """The job lease's epoch: the ledger refuses the record (and so the publish) of a stale learner."""
    _order: tuple[int, list[int]]

    def __init__(self, job_bus: JobBus, task_ledger: Ledger, lease_epoch: int, spec: JobSpec, prompts: list[Prompt],
                 cursor: FeederCursor | None = None) -> None:
        self._bus = job_bus
        self._ledger = task_ledger
        self.lease_epoch = lease_epoch
        self.job_id = job_bus.job_id
        self.spec = spec
        self.prompts = prompts
        self.cursor = cursor or FeederCursor()
        self._order = (-1, [])

    def settle(self, groups: int) -> None:
        """Count groups that left the pipeline (trained in a step, or dropped as stale)."""
        self.cursor.settled += groups

    def settle_stale(self, total: int) -> int:
        """Settle the groups dropped as stale since the last call (`total`: replay's `stale_dropped` count for
        the job). A total, not the drops each Sample reply reports: the drops reported to an incarnation that
        died after its last checkpoint, or in a reply that was lost, never come back either."""
        new = max(0, total - self.cursor.stale)
        self.cursor.stale += new
        self.settle(new)
        return new

    def settle_dead_lettered(self, total: int) -> int:
        """Settle the tasks dead-lettered since the last call (`total`: the job's dead-letter count)."""
        new = max(0, total - self.cursor.dead_lettered)
        self.cursor.dead_lettered += new
        self.settle(new)
        return new

    async def top_up(self, current_version: int) -> int:
        """Publish as many tasks as the bound allows, tagged for current_version; returns the count.
        They are recorded in the ledger first, in one call."""
        n = tasks_to_publish(self.cursor, self.spec.rollout.prompts_per_step, self.spec.train.max_staleness)
        if n:
            await self._ledger.published(self.job_id, self._next_task_ids(n), lease_epoch=self.lease_epoch)
        for _ in range(n):
            await self._publish_next(current_version)
        return n

    def _next_task_ids(self, n: int) -> list[str]:
        """The ids of the next n tasks, without moving the cursor."""
        epoch, position, out = self.cursor.epoch, self.cursor.position, []
        for _ in range(n):
            out.append(seeding.task_id(epoch, self._order_of(epoch)[position]))
            position += 1
            if position == len(self.prompts):
                epoch, position = epoch + 1, 0
        return out

    def _order_of(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:
            self._order = (epoch, seeding.prompt_order(len(self.prompts), self.spec.seed, epoch))
        return self._order[1]

    async def _publish_next(self, min_version: int) -> None:
        epoch = self.cursor.epoch
        index = self._order_of(epoch)[self.cursor.position]
        prompt = self.prompts[index]
        task = common_pb2.Task(
            job_id=self.job_id, task_id=seeding.task_id(epoch, index), epoch=epoch, prompt_index=index,
            prompt=prompt.text, metadata_json=prompt.metadata_json, min_policy_version=min_version,
            published_unix_ms=int(time.time() * 1000),
        )
        with _TRACER.start_as_current_span("feeder.publish", context=otel_context.Context(), attributes={
                "fleetrl.job_id": self.job_id, "fleetrl.task_id": task.task_id}):
            headers = telemetry.inject_headers({"Nats-Msg-Id": bus.task_msg_id(self.job_id, epoch, index)})
            await self._bus.publish_task(task.SerializeToString(), headers)
        self.cursor.published += 1
        self.cursor.position += 1
        if self.cursor.position == len(self.prompts):
            self.cursor.epoch, self.cursor.position = epoch + 1, 0


def task_ids_in_order(num_prompts: int, seed: int, count: int) -> list[str]:
    """The first `count` task ids the feeder publishes (epoch after epoch); for tests and tools."""
    out: list[str] = []
    epoch = 0
    while len(out) < count:
        out.extend(seeding.task_id(epoch, i) for i in seeding.prompt_order(num_prompts, seed, epoch))
        epoch += 1
    return out[:count]
