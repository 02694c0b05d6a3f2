"""The learner's NATS side of one job, in one place: tasks out, dead letters in, events out.

`JobRun` and the `Feeder` call these methods instead of JetStream: ensuring the streams and the
job's shared task consumer (`prepare`, the same settings actors use), publishing a task with its
dedup id (`publish_task`), purging queued tasks on cancel (`purge_tasks`), reading the job's
dead-letter count (`dead_lettered`, which first moves the tasks the server stopped delivering) and
publishing step and state events (`event`). Every call is repeated through a NATS outage for
`outage_retry_s` (`bus.retry_outage`: each is safe to repeat; a re-published task or event is dropped by its
dedup id, the streams and consumers are created or updated to the same config, a purge purges what is left),
then raises `bus.NatsUnreachable`, except `event`, which logs the event it lost and returns: events are
informational.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from nats.aio.client import Client as NATS

from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus

log = logging.getLogger(__name__)


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
        """Publish a JSON event to `fleet.jobs.<job>.events`, stored by FLEET_EVENTS, tried again through a NATS
        outage for `outage_retry_s` like the other calls (every try carries the same `Nats-Msg-Id`, so an event
        whose ack was lost is stored once).

        Events are informational: the job's record and steps in Redis and its metrics.jsonl are what `WatchJob`,
        the ledger and a resume read. So an event NATS does not take (unreachable past the retries, or JetStream
        full) is logged and dropped; it never pauses or fails the job, nor cuts its end short. It is a
        JetStream publish, acked, not a core one: on a client that is reconnecting nats-py buffers a core publish
        up to its `pending_size` (2 MiB, which a failed weight write's chunks may fill) and then raises
        OutboundBufferLimitError, and a publish that returns says nothing of whether the event was stored."""
        data, headers = json.dumps(payload).encode(), {"Nats-Msg-Id": uuid.uuid4().hex}
        try:
            await bus.retry_outage(lambda: self._js.publish(bus.events_subject(self.job_id), data, headers=headers),
                                   what=f"job {self.job_id}: {payload.get('type', '')} event",
                                   deadline_s=self.outage_retry_s)
        except (bus.NatsUnreachable, bus.JetStreamFull) as error:
            log.warning("%s; the event is dropped (the job's record and metrics hold what it said)", error)
