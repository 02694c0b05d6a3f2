"""The task loop: fetch -> ensure_weights -> generate -> score -> insert -> ack, for one task at a time.

Design choices (docs/ARCHITECTURE.md, data flow steps 5-7):
- The task is acked only after replay answered INSERTED or DUPLICATE for its group, so a kill at any
  point before that leaves the task unacked and JetStream redelivers it after ack_wait; a kill after
  the insert but before the ack makes the redelivery a DUPLICATE, which is acked. Replay's
  idempotent insert on (job, task id) is what makes "0 lost, 0 duplicated" hold.
- While a task is held, `in_progress()` is sent every ack_wait / 3, so a slow generation is not
  redelivered; a stopped or dead actor stops sending it and its task moves on.
- Reward and replay calls are retried with bounded, jittered backoff for rpc_retry_s on UNAVAILABLE,
  RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED and NOT_FOUND (the table is configured by the learner); past
  that, or on any other failure, the delivery is nak'ed with exponential delay. A failure on delivery
  max_retries_per_episode, or a delivery beyond it (earlier ones killed their actor), moves the task
  to the job's dead-letter subject, counted, and acks it there.
- Sampling is seeded by `seeding.task_seed(spec.seed, task_id)`, so a redelivered task gives the
  same group under the same weights.
- Each delivery is a span `actor.task` in the trajectory's trace (parent: the feeder's span, from the
  message's `traceparent` header) with one child per step (`actor.fetch`, `actor.ensure_weights`,
  `actor.generate`, `actor.score`, `actor.insert`); the reward and replay calls carry the context
  as gRPC metadata, and the group's lineage records the insert span, the parent of the learner's.
This module imports no grpc: replay and reward are reached through the two small Protocols below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.actor import metrics
from services.actor.backends import Completion, prompt_tokens
from services.actor.config import ActorSettings
from services.actor.policy import JobPolicy
from services.common import bus, telemetry
from services.common.config import JobSpec
from services.common.errors import DeadlineExceeded, NotFound, ResourceExhausted, Unavailable
from services.common.jobs import now_ms
from services.common.seeding import task_seed
from services.proto.fleetrl.v1 import common_pb2, replay_pb2, reward_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRYABLE = (Unavailable, ResourceExhausted, DeadlineExceeded, NotFound)
ACK_TIMEOUT_S = 5.0
DUPLICATE = replay_pb2.INSERT_OUTCOME_DUPLICATE


class GroupSink(Protocol):
    """Where groups go (services.replay.client.ReplayClient)."""

    async def insert(self, groups: Sequence[common_pb2.Group]) -> list[int]: ...


class Rewarder(Protocol):
    """Who scores completions (services.actor.clients.RewardClient)."""

    async def score(self, job_id: str, spec_json: str, file_source: bytes,
                    items: Sequence[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]: ...


@dataclass
class JobContext:
    """Everything the loop needs about one job it serves."""

    job_id: str
    spec: JobSpec
    reward_file: bytes
    policy: JobPolicy
    sub: JetStreamContext.PullSubscription


class TaskFailed(Exception):
    """A delivery could not produce a stored group; the reason goes to logs and the dead-letter headers."""


def trace_id() -> str:
    """Trace id recorded in lineage: the active span's, "" when tracing is off."""
    return telemetry.current_trace_id()


class TaskLoop:
    """Runs tasks of the jobs it is given, one at a time."""

    settings: ActorSettings
    activity: metrics.Activity

    def __init__(self, settings: ActorSettings, js: JetStreamContext, replay: GroupSink, reward: Rewarder) -> None:
        self.settings = settings
        self.activity = metrics.Activity()
        self._js = js
        self._replay = replay
        self._reward = reward
        self._tracer = telemetry.tracer("fleetrl.actor")

    async def step(self, job: JobContext) -> bool:
        """Take and finish at most one task of job; whether one was taken."""
        if not await job.policy.refresh():
            return False  # an actor with no weights takes no task
        fetch_ns = time.time_ns()
        msg = await self.fetch(job)
        if msg is None:
            return False
        self.activity.begin(job.job_id)
        try:
            with self._tracer.start_as_current_span("actor.task", context=telemetry.extract(msg.headers),
                                                    start_time=fetch_ns, attributes=self._attributes(job)):
                self._tracer.start_span("actor.fetch", start_time=fetch_ns).end()
                await self.handle(job, msg)
        finally:
            self.activity.end()
        return True

    def _attributes(self, job: JobContext) -> dict[str, str]:
        return {"fleetrl.job_id": job.job_id, "fleetrl.actor_id": self.settings.actor_id}

    @contextlib.contextmanager
    def _stage(self, name: str, state: str) -> Iterator[None]:
        """One named step of a task: a child span, a step_seconds sample and the actor's state."""
        self.activity.set_state(state)
        with self._tracer.start_as_current_span(f"actor.{name}"), metrics.STEP_SECONDS.labels(name).time():
            yield

    async def fetch(self, job: JobContext) -> Msg | None:
        try:
            msgs = await job.sub.fetch(1, timeout=self.settings.fetch_timeout_s)
        except nats.errors.TimeoutError:
            return None
        return msgs[0] if msgs else None

    async def handle(self, job: JobContext, msg: Msg) -> None:
        """One delivery: dead-letter it, store its group and ack, or release it for redelivery."""
        received_ms, attempt = now_ms(), int(msg.metadata.num_delivered)
        max_retries = job.spec.train.max_retries_per_episode
        try:
            task = common_pb2.Task.FromString(msg.data)
        except Exception as error:  # a malformed task can never succeed
            await self.dead_letter(job, msg, attempt, f"task does not parse: {error}")
            return
        log.info("job %s task %s delivery %d received", job.job_id, task.task_id, attempt)
        if attempt > 1:
            metrics.REDELIVERIES.labels(job.job_id).inc()
        if attempt > max_retries:
            await self.dead_letter(job, msg, attempt, "earlier deliveries ended without a result")
            return
        try:
            async with self._keepalive(msg, job.spec.train.task_ack_wait_s / 3):
                outcome = await self.produce_and_insert(job, task, attempt, received_ms)
        except (asyncio.CancelledError, KeyboardInterrupt):
            await self._nak(msg, 0.0)
            raise
        except Exception as error:
            await self.failed(job, msg, task, attempt, error)
            return
        metrics.TASKS.labels(job.job_id, "duplicate" if outcome == DUPLICATE else "inserted").inc()
        await self._ack(msg)

    async def produce_and_insert(self, job: JobContext, task: common_pb2.Task, attempt: int,
                                 received_ms: int) -> int:
        """The named steps of one task; the replay outcome (INSERTED or DUPLICATE)."""
        await self.ensure_weights(job, task)
        version = job.policy.version
        prompt_ids, completions = await self.generate(job, task)
        generated_ms = now_ms()
        results = await self.score(job, task, completions)
        lineage = common_pb2.Lineage(
            actor_id=self.settings.actor_id, delivery_attempt=attempt, trace_id=trace_id(),
            received_unix_ms=received_ms, generated_unix_ms=generated_ms, scored_unix_ms=now_ms())
        group = build_group(job.job_id, task, version, prompt_ids, completions, results, lineage)
        return await self.insert(group)

    async def ensure_weights(self, job: JobContext, task: common_pb2.Task) -> None:
        with self._stage("ensure_weights", "waiting_for_weights"):
            if not await job.policy.ensure(int(task.min_policy_version), self.settings.weights_wait_s):
                raise TaskFailed(f"weights v>={task.min_policy_version} not available "
                                 f"(holding v{job.policy.version})")

    async def generate(self, job: JobContext, task: common_pb2.Task) -> tuple[list[int], list[Completion]]:
        rollout = job.spec.rollout
        backend = job.policy.backend
        prompt_ids = prompt_tokens(backend.tokenizer, task.prompt, rollout)
        marker = self.settings.fault_crash_marker
        if marker and marker in task.prompt:
            raise TaskFailed(f"fault injection: prompt contains {marker!r}")
        with self._stage("generate", "generating"):
            completions = await asyncio.to_thread(
                backend.generate, prompt_ids, rollout.samples_per_prompt, max_new_tokens=rollout.max_new_tokens,
                temperature=rollout.temperature, top_p=rollout.top_p, seed=task_seed(job.spec.seed, task.task_id))
        tokens = sum(len(c.token_ids) for c in completions)
        metrics.GENERATED_TOKENS.labels(job.job_id).inc(tokens)
        self.activity.add_tokens(tokens)
        return prompt_ids, completions

    async def score(self, job: JobContext, task: common_pb2.Task,
                    completions: list[Completion]) -> list[reward_pb2.ScoreResult]:
        items = [reward_pb2.ScoreItem(completion=c.text, prompt=task.prompt, metadata_json=task.metadata_json or "{}")
                 for c in completions]
        spec_json = job.spec.reward.model_dump_json()
        with self._stage("score", "scoring"):
            results = await self._retrying(lambda: self._reward.score(job.job_id, spec_json, job.reward_file, items),
                                           "reward Score")
        if len(results) != len(items):
            raise TaskFailed(f"reward service returned {len(results)} results for {len(items)} items")
        return results

    async def insert(self, group: common_pb2.Group) -> int:
        with self._stage("insert", "inserting"):
            group.lineage.span_id = telemetry.current_span_id()
            outcomes = await self._retrying(lambda: self._replay.insert([group]), "replay Insert")
        return int(outcomes[0])

    async def failed(self, job: JobContext, msg: Msg, task: common_pb2.Task, attempt: int,
                     error: Exception) -> None:
        """A delivery failed before its group was stored: retry later, or dead-letter at the limit."""
        reason = f"{type(error).__name__}: {error}"
        if attempt >= job.spec.train.max_retries_per_episode:
            await self.dead_letter(job, msg, attempt, reason)
            return
        delay = min(self.settings.nak_max_delay_s, self.settings.nak_base_delay_s * 2 ** (attempt - 1))
        log.warning("job %s task %s delivery %d failed (%s); redelivery in %.1fs", job.job_id, task.task_id,
                    attempt, reason, delay)
        metrics.NAKS.labels(job.job_id).inc()
        await self._nak(msg, delay)

    async def dead_letter(self, job: JobContext, msg: Msg, attempt: int, reason: str) -> None:
        """Publish the task to the job's dead-letter subject (deduplicated on its msg id), then ack it."""
        original = (msg.headers or {}).get("Nats-Msg-Id", "")
        headers = {
            "Fleet-Reason": " ".join(reason.split())[:1000], "Fleet-Deliveries": str(attempt),
            "Fleet-Original-Msg-Id": original, "Fleet-Actor-Id": self.settings.actor_id,
        }
        if original:
            headers["Nats-Msg-Id"] = f"dlq/{original}"
        await self._js.publish(bus.dlq_subject(job.job_id), msg.data, headers=headers, timeout=bus.REQUEST_TIMEOUT_S)
        metrics.DEAD_LETTERED.labels(job.job_id).inc()
        log.error("job %s: task %s dead-lettered after %d deliveries: %s", job.job_id, original, attempt, reason)
        await self._ack(msg)

    async def _retrying(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """call() until it succeeds, retrying RETRYABLE errors with jittered backoff for rpc_retry_s."""
        deadline = time.monotonic() + self.settings.rpc_retry_s
        delay = 0.2
        while True:
            try:
                return await call()
            except RETRYABLE as error:
                if time.monotonic() + delay > deadline:
                    raise
                log.info("%s: %s; retrying in %.1fs", what, error, delay)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(5.0, delay * 2)

    @contextlib.asynccontextmanager
    async def _keepalive(self, msg: Msg, interval_s: float) -> AsyncIterator[None]:
        """Send in_progress() every interval_s while the body runs."""

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

    @staticmethod
    async def _ack(msg: Msg) -> None:
        try:
            await msg.ack_sync(timeout=ACK_TIMEOUT_S)
        except Exception as error:  # the group is stored: a redelivery reports DUPLICATE and is acked then
            log.warning("ack failed (task will come back as a duplicate): %s", error)

    @staticmethod
    async def _nak(msg: Msg, delay_s: float) -> None:
        try:
            await msg.nak(delay=delay_s if delay_s > 0 else None)
        except Exception as error:  # unacked, it comes back after ack_wait anyway
            log.warning("nak failed: %s", error)


def build_group(
    job_id: str, task: common_pb2.Task, version: int, prompt_ids: list[int], completions: list[Completion],
    results: list[reward_pb2.ScoreResult], lineage: common_pb2.Lineage,
) -> common_pb2.Group:
    """The group replay stores for a task: one Sample per completion with its reward."""
    group = common_pb2.Group(job_id=job_id, task_id=task.task_id, policy_version=version, prompt=task.prompt,
                             lineage=lineage)
    for completion, result in zip(completions, results, strict=True):
        group.samples.append(common_pb2.Sample(
            prompt_token_ids=prompt_ids, completion_token_ids=completion.token_ids,
            behaviour_logprobs=completion.logprobs, completion_text=completion.text,
            reward=result.reward if result.status == common_pb2.REWARD_STATUS_OK else 0.0,
            reward_components=dict(result.components), reward_status=result.status,
            reward_reason=result.reason, finish_reason=completion.finish_reason,
        ))
    return group
