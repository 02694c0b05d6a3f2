"""What the gateway core calls outside the job store: the task stream, the event subject, and the
fleet's heartbeats and queues (the reward service is reached through `fleetrl.reward.client`).

Each class implements one Protocol of `service` and is the only place its transport appears.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from fleetrl.errors import Unavailable
from fleetrl.jobs import retention
from fleetrl.jobs.store import REDIS_UNREACHABLE
from fleetrl.runtime import heartbeat
from fleetrl.services.gateway.service import event_payload
from fleetrl.tasks import bus
from fleetrl.tasks.ledger import Accounting, Ledger
from fleetrl.weights.transport import Transport

log = logging.getLogger(__name__)


class JetStreamPurger:
    """Drops a job's queued tasks from the work-queue stream."""

    js: JetStreamContext

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def purge(self, job_id: str) -> None:
        try:
            await self.js.purge_stream(bus.TASKS_STREAM, subject=bus.task_subject(job_id))
        except NotFoundError:  # no task stream yet: nothing queued
            return
        except Exception as error:  # nats-py raises timeouts and connection errors of several kinds
            raise Unavailable(f"cannot purge the tasks of job {job_id}: {error!r}; cancel again to retry") from error


class StoreDeleter:
    """Deletes a job's data from Redis, NATS, the run directory and its weights' transport
    (`fleetrl.jobs.retention`)."""

    def __init__(self, redis: aioredis.Redis, js: JetStreamContext, run_dir: Path, weights: Transport) -> None:
        self.redis, self.js, self.run_dir, self.weights = redis, js, run_dir, weights

    async def delete(self, job_id: str) -> retention.Footprint:
        try:
            return await retention.delete(self.redis, self.js, self.run_dir, self.weights, job_id)
        except (*bus.NATS_UNREACHABLE, *REDIS_UNREACHABLE) as error:
            raise Unavailable(f"cannot delete job {job_id} now: {error!r}; delete it again to finish") from error


class JetStreamEvents:
    """Publishes job events to `fleet.jobs.<job>.events` (FLEET_EVENTS stream)."""

    js: JetStreamContext

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def publish(self, job_id: str, event: dict[str, Any]) -> None:
        try:
            await self.js.publish(bus.events_subject(job_id), json.dumps(event_payload(job_id, event)).encode(),
                                  timeout=2.0)
        except Exception as error:  # best effort: the job store is the source of truth
            log.warning("job %s: event %s not published: %r", job_id, event.get("type"), error)


class FleetProbe:
    """Members from their heartbeats in Redis, queues from JetStream consumer and stream info, and
    a job's task ledger from both."""

    redis: aioredis.Redis
    js: JetStreamContext
    ledger: Ledger

    def __init__(self, client: aioredis.Redis, js: JetStreamContext) -> None:
        self.redis, self.js = client, js
        self.ledger = Ledger(client)

    async def members(self) -> list[heartbeat.Beat]:
        return await heartbeat.read_all(self.redis)

    async def queue(self, job_id: str) -> bus.TaskQueue:
        try:
            return await bus.task_queue(self.js, job_id)
        except Exception as error:  # nats-py raises timeouts and connection errors of several kinds
            raise Unavailable(f"cannot read the task queue of job {job_id}: {error!r}") from error

    async def account(self, job_id: str, max_trainings: int) -> Accounting:
        try:
            return await self.ledger.account(self.js, job_id, max_trainings)
        except Exception as error:  # nats-py and redis-py raise timeouts and connection errors of several kinds
            raise Unavailable(f"cannot read the ledger of job {job_id}: {error!r}") from error
