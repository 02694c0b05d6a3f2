"""The learner's observability: Prometheus metrics, the step's spans, and the trajectories' last spans.

- `StepObserver` (one per JobRun): each optimizer step is a root span `learner.step` (a trace of
  its own) with one child per stage (`learner.wait_for_data`, `learner.train`, `learner.publish`,
  `learner.checkpoint`), each timed into `fleetrl_learner_phase_seconds` (train split into
  forward_backward and optimizer by `optim.train_step`'s own timings). Every trained group also gets
  two spans in its trajectory's trace: `learner.sample`, the Sample call that leased it (parent: the
  actor's insert span, from the group's lineage), and `learner.consume`, the training of the step
  that consumed it (attribute fleetrl.step, linked to the step's span). So one trace runs from the
  feeder's publish to the step.
- `LearnerBeats`: every heartbeat.INTERVAL_S, the learner's heartbeats (for `fleetrl top`; one per job
  while it runs several) and the task-queue gauges of the jobs it runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import redis.asyncio as aioredis
from nats.js import JetStreamContext
from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.runtime import background, heartbeat, telemetry
from fleetrl.tasks import bus
from fleetrl.train.status import StatusBoard

log = logging.getLogger(__name__)
T = TypeVar("T")
_TRACER = telemetry.tracer("fleetrl.learner")
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
SPLIT = {"forward_backward_s": "forward_backward", "optimizer_s": "optimizer"}

STEPS = Counter("fleetrl_learner_steps_total", "Optimizer steps completed", ["job"])
STEP_SECONDS = Histogram("fleetrl_learner_step_seconds", "Seconds per optimizer step, waiting for data included",
                         buckets=SECONDS_BUCKETS)
PHASE_SECONDS = Histogram("fleetrl_learner_phase_seconds", "Seconds per step in each phase: wait_for_data, "
                          "forward_backward, optimizer, publish, checkpoint", ["phase"], buckets=SECONDS_BUCKETS)
STALENESS = Histogram("fleetrl_learner_staleness_versions", "Policy versions a trained group lagged the learner",
                      buckets=STALENESS_BUCKETS)
GROUPS = Counter("fleetrl_learner_groups_trained_total", "Groups trained on", ["job"])
TOKENS = Counter("fleetrl_learner_trained_tokens_total", "Completion tokens trained on", ["job"])
STALE_DROPPED = Counter("fleetrl_learner_stale_dropped_total", "Groups replay dropped as too old to train on",
                        ["job"])
NONFINITE_STEPS = Counter("fleetrl_learner_nonfinite_steps_total",
                          "Steps whose update was skipped because their loss or gradient was not finite", ["job"])
STORE_FULL = Gauge("fleetrl_learner_store_full", "1 while the learner's job is paused because a store refuses "
                   "its writes for want of space: redis (out of memory or MISCONF), disk (checkpoints, "
                   "metrics.jsonl), nats (JetStream's storage limit, or a stream's or bucket's)", ["store"])
POLICY_VERSION = Gauge("fleetrl_learner_policy_version", "Policy version (optimizer steps applied)", ["job"])
REWARD_MEAN = Gauge("fleetrl_learner_reward_mean", "Mean reward of the last step's samples", ["job"])
QUEUE_PENDING = Gauge("fleetrl_task_queue_pending", "Tasks published and not yet delivered to an actor", ["job"])
QUEUE_IN_FLIGHT = Gauge("fleetrl_task_queue_in_flight", "Tasks delivered to an actor and not yet acked", ["job"])
QUEUE_REDELIVERED = Gauge("fleetrl_task_queue_redelivered", "In-flight tasks on their second or later delivery",
                          ["job"])
QUEUE_DEAD_LETTERED = Gauge("fleetrl_task_queue_dead_lettered", "Tasks in the job's dead-letter subject", ["job"])


class StepObserver:
    """Spans and metrics of one job's steps; JobRun calls it, it calls nothing back."""

    job_id: str

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._step_span: trace.Span = trace.INVALID_SPAN
        self._samples: dict[str, trace.Span] = {}
        self._stage_ns: dict[str, tuple[int, int]] = {}

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """The span of step `number` (a new trace), around its stages."""
        started = time.perf_counter()
        attributes: dict[str, str | int] = {"fleetrl.job_id": self.job_id, "fleetrl.step": number}
        with _TRACER.start_as_current_span("learner.step", context=otel_context.Context(),
                                           attributes=attributes) as span:
            self._step_span = span
            yield
        if "train" in self._stage_ns:
            STEP_SECONDS.observe(time.perf_counter() - started)
        self._stage_ns.clear()

    async def timed(self, stage: str, awaitable: Awaitable[T]) -> T:
        """Await one stage of the step inside its span; its duration goes to the phase histogram."""
        started_ns = time.time_ns()
        with _TRACER.start_as_current_span(f"learner.{stage}"):
            result = await awaitable
        self._stage_ns[stage] = (started_ns, time.time_ns())
        if stage != "train":  # train is reported split, in consumed()
            PHASE_SECONDS.labels(stage).observe((time.time_ns() - started_ns) / 1e9)
        return result

    def seconds(self, stage: str) -> float:
        """How long the step's stage took (0 before it ran)."""
        started_ns, ended_ns = self._stage_ns.get(stage, (0, 0))
        return (ended_ns - started_ns) / 1e9

    def sampled(self, groups: list[common_pb2.Group], started_ns: int) -> None:
        """A Sample call started at started_ns leased groups: a `learner.sample` span in each one's trace."""
        for group in groups:
            lineage = group.lineage
            if not lineage.trace_id or not lineage.span_id:
                continue  # tracing was off where the group was made
            span = _TRACER.start_span(
                "learner.sample", context=telemetry.remote_parent(lineage.trace_id, lineage.span_id),
                start_time=started_ns, attributes={"fleetrl.job_id": self.job_id, "fleetrl.task_id": group.task_id,
                                                   "fleetrl.policy_version": group.policy_version})
            span.end()
            self._samples[group.task_id] = span

    def consumed(self, groups: list[common_pb2.Group], step: int, values: dict[str, float]) -> None:
        """Step `step` trained groups: their `learner.consume` spans, and the step's metrics."""
        started_ns, ended_ns = self._stage_ns.get("train", (time.time_ns(), time.time_ns()))
        links = [trace.Link(self._step_span.get_span_context())] if self._step_span.is_recording() else []
        for group in groups:
            STALENESS.observe(step - 1 - group.policy_version)
            sample = self._samples.get(group.task_id)
            if sample is not None:
                _TRACER.start_span("learner.consume", context=trace.set_span_in_context(sample), links=links,
                                   start_time=started_ns, attributes={"fleetrl.step": step}).end(end_time=ended_ns)
        self._samples.clear()
        for key, phase in SPLIT.items():
            if key in values:
                PHASE_SECONDS.labels(phase).observe(values[key])
        self._count(len(groups), step, values)

    def _count(self, groups: int, step: int, values: dict[str, float]) -> None:
        STEPS.labels(self.job_id).inc()
        GROUPS.labels(self.job_id).inc(groups)
        TOKENS.labels(self.job_id).inc(values.get("tokens", 0.0))
        STALE_DROPPED.labels(self.job_id).inc(values.get("stale_dropped", 0.0))
        NONFINITE_STEPS.labels(self.job_id).inc(values.get("nonfinite_steps", 0.0))
        POLICY_VERSION.labels(self.job_id).set(step)
        if "reward_mean" in values:
            REWARD_MEAN.labels(self.job_id).set(values["reward_mean"])


def learner_beats(board: StatusBoard) -> dict[str, heartbeat.Beat]:
    """The learner's heartbeats by member id: one for the job it runs (its id), or one per job, as
    `<learner id>:<job id>`, while it runs several; with none running, its last job's (phase "done"), or an
    idle beat. A learner whose claims Redis refuses says "paused"."""
    statuses = board.current() or list(board.jobs.values())[-1:]
    several = len(statuses) > 1
    now_ms = int(time.time() * 1000)
    if not statuses:
        return {board.learner_id: heartbeat.Beat("learner", board.learner_id,
                                                  "paused" if board.paused_reason else "idle", unix_ms=now_ms)}
    beats = {}
    for status in statuses:
        member = f"{board.learner_id}:{status.job_id}" if several else board.learner_id
        phase = "paused" if board.paused_reason and not board.running else status.phase
        tokens_per_s = status.last.values.get("tokens_per_s", 0.0) if status.last is not None else 0.0
        beats[member] = heartbeat.Beat("learner", member, phase, status.job_id, status.policy_version,
                                       tokens_per_s, 0.0, now_ms)
    return beats


def set_queue_gauges(queue: bus.TaskQueue) -> None:
    QUEUE_PENDING.labels(queue.job_id).set(queue.pending)
    QUEUE_IN_FLIGHT.labels(queue.job_id).set(queue.in_flight)
    QUEUE_REDELIVERED.labels(queue.job_id).set(queue.redelivered)
    QUEUE_DEAD_LETTERED.labels(queue.job_id).set(queue.dead_lettered)


class LearnerBeats:
    """Writes the learner's heartbeats and its jobs' task-queue gauges (`run` until cancelled), and drops
    a beat it no longer writes (a job's, once the learner runs one job again), and all of them at the end."""

    def __init__(self, board: StatusBoard, client: aioredis.Redis, js: JetStreamContext) -> None:
        self.board, self.client, self.js = board, client, js
        self.written: set[str] = set()

    async def run(self) -> None:
        """A round every heartbeat.INTERVAL_S; a failed round (Redis or NATS restarting) is logged: observability
        must not stop training."""
        await background.repeat(self.round, heartbeat.INTERVAL_S, what="heartbeat/queue probe")

    async def round(self) -> None:
        beats = learner_beats(self.board)
        for beat in beats.values():
            await heartbeat.write(self.client, beat)
        for member in self.written - set(beats):
            await heartbeat.clear(self.client, "learner", member)
        self.written = set(beats)
        for status in self.board.current():
            if status.phase != "done":
                set_queue_gauges(await bus.task_queue(self.js, status.job_id))

    async def clear(self) -> None:
        """Drop every beat written (a clean shutdown); best effort: a beat expires anyway."""
        with contextlib.suppress(Exception):
            for member in self.written | {self.board.learner_id}:
                await heartbeat.clear(self.client, "learner", member)
