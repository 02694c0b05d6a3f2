"""What the gateway core calls outside the job store: the reward service, the task stream, the event
subject, and the fleet's heartbeats and queues.

Each class implements one Protocol of `service` and is the only place its transport appears.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import redis.asyncio as aioredis
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.common import bus, heartbeat
from services.common.config import RewardSpec
from services.common.errors import Unavailable
from services.gateway.service import event_payload
from services.proto.fleetrl.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED)


class RewardValidator:
    """RewardService.Validate: the reward spec (and file) loads and exposes `reward`."""

    stub: reward_pb2_grpc.RewardServiceStub
    address: str
    timeout_s: float

    def __init__(self, channel: grpc.aio.Channel, address: str, timeout_s: float) -> None:
        self.stub = reward_pb2_grpc.RewardServiceStub(channel)
        self.address, self.timeout_s = address, timeout_s

    async def check(self, spec: RewardSpec, source: bytes | None) -> str | None:
        request = reward_pb2.ValidateRequest(spec=reward_pb2.RewardSpec(
            spec_json=spec.model_dump_json(), file_source=source or b""))
        try:
            response = await self.stub.Validate(request, timeout=self.timeout_s, wait_for_ready=False)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return error.details() or "the reward service rejected the reward spec"
            what = "reward file" if spec.file is not None else "reward spec"
            if error.code() in UNREACHABLE:
                raise Unavailable(f"reward service unreachable at {self.address}, cannot check {what}: "
                                  f"{error.code().name} {error.details()}") from error
            raise Unavailable(f"reward service failed checking the {what}: {error.code().name} "
                              f"{error.details()}") from error
        return None if response.ok else (response.reason or "the reward service rejected the reward spec")


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
    """Members from their heartbeats in Redis, queues from JetStream consumer and stream info."""

    redis: aioredis.Redis
    js: JetStreamContext

    def __init__(self, client: aioredis.Redis, js: JetStreamContext) -> None:
        self.redis, self.js = client, js

    async def members(self) -> list[heartbeat.Beat]:
        return await heartbeat.read_all(self.redis)

    async def queue(self, job_id: str) -> bus.TaskQueue:
        try:
            return await bus.task_queue(self.js, job_id)
        except Exception as error:  # nats-py raises timeouts and connection errors of several kinds
            raise Unavailable(f"cannot read the task queue of job {job_id}: {error!r}") from error
