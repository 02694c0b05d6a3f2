"""The learner's NATS side of one job, in one place: tasks out, dead letters in, events out.

`JobRun` and the `Feeder` call these methods instead of JetStream: ensuring the streams and the
job's shared task consumer (`prepare`, the same settings actors use), publishing a task with its
dedup id (`publish_task`), purging queued tasks on cancel (`purge_tasks`), reading the job's
dead-letter count (`dead_lettered`, which first moves the tasks the server stopped delivering) and
publishing step and state events (`event`). Every call but `event` is repeated through a NATS outage for
`outage_retry_s` (`bus.retry_outage`: each is safe to repeat; a re-published task is dropped by its dedup id,
the streams and consumers are created or updated to the same config, a purge purges what is left), then
raises `bus.NatsUnreachable`.
"""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client as NATS

from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus


class JobBus:
    """One job's task subject, consumer, dead-letter subject and event subject."""

    job_id: str
    outage_retry_s: float
    """How long a call tries again through a NATS outage."""

    def __init__(self, nc: NATS, job_id: str, outage_retry_s: float = bus.OUTAGE_RETRY_S) -> None:
        self.job_id = job_id
        self.outage_retry_s = outage_retry_s
        self._nc = nc
        self._js = bus.jetstream(nc)

    async def prepare(self, spec: JobSpec) -> None:
        """The fleet's streams and the job's task consumer, created or updated to the spec."""
        async def ensure() -> None:
            await bus.ensure_streams(self._js)
            await bus.ensure_job_consumer(self._js, self.job_id, spec)
            await bus.ensure_advisory_consumer(self._js, self.job_id)

        await bus.retry_outage(ensure, what=f"job {self.job_id}: set-up of its streams and task consumer",
                               deadline_s=self.outage_retry_s)

    async def publish_task(self, data: bytes, headers: dict[str, str]) -> None:
        """One serialised Task (headers carry its `Nats-Msg-Id`, so a re-publish is dropped)."""
        await bus.retry_outage(lambda: self._js.publish(bus.task_subject(self.job_id), data, headers=headers),
                               what=f"job {self.job_id}: task publish", deadline_s=self.outage_retry_s)

    async def purge_tasks(self) -> None:
        """Drop the job's queued tasks (the job was cancelled)."""
        await bus.retry_outage(lambda: self._js.purge_stream(bus.TASKS_STREAM, subject=bus.task_subject(self.job_id)),
                               what=f"job {self.job_id}: purge of its queued tasks", deadline_s=self.outage_retry_s)

    async def dead_lettered(self) -> int:
        """Tasks of the job in its dead-letter subject so far, after moving there the tasks the server
        stopped delivering (their actors died on every delivery)."""
        async def count() -> int:
            await bus.dead_letter_exhausted(self._js, self.job_id)
            return (await bus.task_queue(self._js, self.job_id)).dead_lettered

        return await bus.retry_outage(count, what=f"job {self.job_id}: dead-letter count",
                                      deadline_s=self.outage_retry_s)

    async def event(self, payload: dict[str, Any]) -> None:
        """Publish a JSON event to `fleet.jobs.<job>.events`."""
        await self._nc.publish(bus.events_subject(self.job_id), json.dumps(payload).encode())
