"""One job's share of the task queue: JetStream deliveries in, ack / nak / dead-letter out.

This module knows JetStream and nothing of models, reward or replay: `JobQueue.fetch(limit)` takes up
to limit deliveries of the job's shared durable pull consumer (the actor's round,
`fleetrl.services.actor.service.take_round`), and `JobQueue.handle_round` hands each parsed `Task` to
`produce`, which returns once the task's group is stored (docs/ARCHITECTURE.md, data flow steps 5-7);
the deliveries of a round are handled concurrently and each is acked on its own.
- The task is acked only after `produce` returned, i.e. after replay answered INSERTED or DUPLICATE
  for its group, so a kill at any point before that leaves the task unacked and JetStream
  redelivers it after ack_wait; a kill after the insert but before the ack makes the redelivery a
  DUPLICATE, which is acked. Replay's idempotent insert on (job, task id) is what makes "0 lost,
  0 duplicated" hold.
- While a task is held, `in_progress()` is sent every ack_wait / 3, so a slow generation is not
  redelivered; a stopped or dead actor stops sending it and its task moves on.
- A failed delivery is nak'ed with exponential delay. A failure on delivery
  max_retries_per_episode, or a task that does not parse, moves the task to the job's dead-letter
  subject, counted, and acks it there. A task whose every delivery killed its actor is never seen
  failing here: the consumer's max_deliver (= max_retries_per_episode) stops it server-side, and the
  learner moves it to the dead-letter subject (`bus.dead_letter_exhausted`).
- Each delivery is a span `actor.task` in the trajectory's trace (parent: the feeder's span, from the
  message's `traceparent` header) with a child `actor.fetch`; `produce` runs inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from fleetrl.jobs.store import now_ms
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.rollout import metrics
from fleetrl.rollout.settings import ActorSettings
from fleetrl.runtime import telemetry
from fleetrl.spec.config import TrainConfig
from fleetrl.tasks import bus

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Delivery:
    """One delivery of a task: the task, which delivery of it this is, and when it arrived."""

    task: common_pb2.Task
    attempt: int
    received_ms: int


Produce = Callable[[Delivery], Awaitable[str]]
"""Stores the delivery's group; returns the outcome counted in TASKS ("inserted" or "duplicate")."""


def parsed_count(tasks: list[common_pb2.Task | Exception]) -> int:
    """How many of a round's deliveries parsed (the others are dead-lettered without a rollout)."""
    return sum(isinstance(task, common_pb2.Task) for task in tasks)


def parse(msg: Msg) -> common_pb2.Task | Exception:
    """The delivery's task, or why it does not parse."""
    try:
        return common_pb2.Task.FromString(msg.data)
    except Exception as error:  # deliberate: whatever a malformed payload raises, it is dead-lettered
        return error


class JobQueue:
    """One job's pull subscription on the shared durable consumer, as this actor sees it."""

    job_id: str

    def __init__(self, job_id: str, train: TrainConfig, js: JetStreamContext,
                 sub: JetStreamContext.PullSubscription, settings: ActorSettings) -> None:
        self.job_id = job_id
        self._train = train
        self._js = js
        self._sub = sub
        self._settings = settings
        self._tracer = telemetry.tracer("fleetrl.actor")

    async def fetch(self, limit: int = 1, timeout_s: float | None = None) -> list[Msg]:
        """Up to limit deliveries: those JetStream has now, else the first within timeout_s (default
        `fetch_timeout_s`); none when none came."""
        try:
            return list(await self._sub.fetch(limit, timeout=timeout_s or self._settings.fetch_timeout_s))
        except TimeoutError:  # nats-py raises its own subclass for one message, the builtin for a batch
            return []

    async def handle_round(self, msgs: list[Msg], tasks: list[common_pb2.Task | Exception], fetch_ns: int,
                           produce: Produce) -> None:
        """The fetched deliveries (their tasks parsed: `parse`), concurrently, each in its own span
        (started at fetch_ns), with its own keep-alive and its own ack."""
        await asyncio.gather(*(self._traced(msg, task, fetch_ns, produce) for msg, task in zip(msgs, tasks,
                                                                                              strict=True)))

    async def _traced(self, msg: Msg, task: common_pb2.Task | Exception, fetch_ns: int, produce: Produce) -> None:
        attributes = {"fleetrl.job_id": self.job_id, "fleetrl.actor_id": self._settings.actor_id}
        with self._tracer.start_as_current_span("actor.task", context=telemetry.extract(msg.headers),
                                                start_time=fetch_ns, attributes=attributes):
            self._tracer.start_span("actor.fetch", start_time=fetch_ns).end()
            await self.handle(msg, produce, task)

    async def handle(self, msg: Msg, produce: Produce, task: common_pb2.Task | Exception) -> None:
        """One delivery and its parsed task (`parse`): dead-letter it, store its group and ack, or release it
        for redelivery."""
        received_ms, attempt = now_ms(), int(msg.metadata.num_delivered)
        if isinstance(task, Exception):  # a malformed task can never succeed
            await self.dead_letter(msg, attempt, f"task does not parse: {task}")
            return
        log.info("job %s task %s delivery %d received", self.job_id, task.task_id, attempt)
        if attempt > 1:
            metrics.REDELIVERIES.labels(self.job_id).inc()
        try:
            async with keepalive(msg, self._train.task_ack_wait_s / 3):
                outcome = await produce(Delivery(task, attempt, received_ms))
        except (asyncio.CancelledError, KeyboardInterrupt):
            await nak(msg, 0.0)
            raise
        except Exception as error:
            await self.failed(msg, task, attempt, error)
            return
        metrics.TASKS.labels(self.job_id, outcome).inc()
        await ack(msg)

    async def failed(self, msg: Msg, task: common_pb2.Task, attempt: int, error: Exception) -> None:
        """A delivery failed before its group was stored: retry later, or dead-letter at the limit."""
        reason = f"{type(error).__name__}: {error}"
        if attempt >= self._train.max_retries_per_episode:
            await self.dead_letter(msg, attempt, reason)
            return
        s = self._settings
        delay = min(s.nak_max_delay_s, s.nak_base_delay_s * 2 ** (attempt - 1))
        log.warning("job %s task %s delivery %d failed (%s); redelivery in %.1fs", self.job_id, task.task_id,
                    attempt, reason, delay)
        metrics.NAKS.labels(self.job_id).inc()
        await nak(msg, delay)

    async def dead_letter(self, msg: Msg, attempt: int, reason: str) -> None:
        """Publish the task to the job's dead-letter subject (deduplicated on its msg id), then ack it."""
        original = (msg.headers or {}).get("Nats-Msg-Id", "")
        await bus.publish_dead_letter(self._js, self.job_id, msg.data, original, reason, attempt,
                                      self._settings.actor_id)
        metrics.DEAD_LETTERED.labels(self.job_id).inc()
        log.error("job %s: task %s dead-lettered after %d deliveries: %s", self.job_id, original, attempt, reason)
        await ack(msg)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


@contextlib.asynccontextmanager
async def keepalive(msg: Msg, interval_s: float) -> AsyncIterator[None]:
    """Send in_progress() every interval_s while the body runs (a task here, a Tinker sample request in
    `fleetrl.tasks.samples`), so a slow delivery is not redelivered while its holder lives."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await msg.in_progress()
            except Exception as error:  # a lost beat only risks a redelivery, which dedup absorbs
                log.warning("in_progress failed: %s", error)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def ack(msg: Msg) -> None:
    """Ack with a deadline; a failed ack is logged (the work is stored: its redelivery is a duplicate)."""
    try:
        await msg.ack_sync(timeout=ACK_TIMEOUT_S)
    except Exception as error:
        log.warning("ack failed (the delivery will come back as a duplicate): %s", error)


async def nak(msg: Msg, delay_s: float) -> None:
    """Release a delivery for redelivery after delay_s (0: at once)."""
    try:
        await msg.nak(delay=delay_s if delay_s > 0 else None)
    except Exception as error:  # unacked, it comes back after ack_wait anyway
        log.warning("nak failed: %s", error)
