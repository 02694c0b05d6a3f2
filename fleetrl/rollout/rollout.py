"""One rollout: a task's group from the job's policy, scored, stored in replay.

`Rollout.run(job, delivery)` is the named steps of one task: ensure_weights -> generate -> score
(single-turn jobs) or play the group's episodes (`episodes.EpisodeRunner`, jobs with an
environment) -> build the group -> insert; it returns the replay outcome. It knows models, reward
and replay and nothing of NATS: the task and its delivery attempt come from `fleetrl.tasks.queue.JobQueue`,
which acks only after this returned.
- Reward and replay are reached through two small Protocols (fleetrl.reward.client.RewardClient,
  fleetrl.replay.client.ReplayClient). The actor builds both clients with one `RetryPolicy`:
  UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED and NOT_FOUND (the table is configured by the
  learner) are retried with jittered backoff for rpc_retry_s; past that, or on any other failure,
  the error propagates and the queue releases the delivery.
- Sampling is seeded by `seeding.task_seed(spec.seed, task_id)`, so a redelivered task gives the
  same group under the same weights.
- Each step is a child span of the delivery's `actor.task` span (`actor.ensure_weights`,
  `actor.generate`, `actor.score`, `actor.insert`; an episode adds `actor.env_open` and, per turn,
`actor.generate` and `actor.env_step`); the reward and replay calls carry the context
  as gRPC metadata, and the group's lineage records the insert span, the parent of the learner's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleetrl.jobs.store import now_ms
from fleetrl.policy.backends import Completion, GroupRequest, prompt_tokens
from fleetrl.proto.fleetrl.v1 import common_pb2, replay_pb2, reward_pb2
from fleetrl.rollout import metrics
from fleetrl.rollout.batching import Seat
from fleetrl.rollout.episodes import EpisodeHost, EpisodeRunner, Verifier
from fleetrl.rollout.job_policy import JobPolicy
from fleetrl.rollout.settings import ActorSettings
from fleetrl.runtime import telemetry
from fleetrl.spec.config import JobSpec
from fleetrl.spec.seeding import task_seed

log = logging.getLogger(__name__)

OUTCOMES: dict[int, str] = {replay_pb2.INSERT_OUTCOME_INSERTED: "inserted",
                            replay_pb2.INSERT_OUTCOME_DUPLICATE: "duplicate"}


class GroupSink(Protocol):
    """Where groups go (fleetrl.replay.client.ReplayClient)."""

    async def insert(self, groups: Sequence[common_pb2.Group]) -> list[int]: ...


class Rewarder(Protocol):
    """Who scores completions (fleetrl.reward.client.RewardClient)."""

    async def score(self, job_id: str, spec: reward_pb2.RewardSpec, items: Sequence[reward_pb2.ScoreItem],
                    tenant: str = "") -> list[reward_pb2.ScoreResult]: ...


@dataclass
class JobContext:
    """What a rollout needs about one job it serves."""

    job_id: str
    spec: JobSpec
    reward_spec: reward_pb2.RewardSpec | None
    """The job's reward spec and file on the wire (`fleetrl.reward.client.spec_to_proto`); None for a
    job with an environment and no built-in verifier."""
    policy: JobPolicy
    environment: reward_pb2.EnvironmentSpec | None = None
    """The job's environment and its file on the wire (`fleetrl.reward.client.environment_to_proto`)."""
    tenant: str = ""
    """The tenant owning the job (the reward service shares its pools and episode slots out by tenant)."""


class TaskFailed(Exception):
    """A delivery could not produce a stored group; the reason goes to logs and the dead-letter headers."""


class Rollout:
    """Turns one task into one stored group."""

    settings: ActorSettings
    activity: metrics.Activity

    def __init__(self, settings: ActorSettings, replay: GroupSink, reward: Rewarder,
                 activity: metrics.Activity, episodes: EpisodeHost | None = None) -> None:
        self.settings = settings
        self.activity = activity
        self._replay = replay
        self._reward = reward
        self._tracer = telemetry.tracer("fleetrl.actor")
        self._episodes = EpisodeRunner(settings, episodes, self._stage) if episodes is not None else None

    async def run(self, job: JobContext, task: common_pb2.Task, attempt: int, received_ms: int,
                  seat: Seat | None = None) -> str:
        """The named steps of one task (delivery `attempt`, received at received_ms); the replay outcome
        ("inserted" or "duplicate"). seat: the task's place in its round's batched generation
        (`batching.RoundBatch`); whoever gave it makes it leave if the task ends before asking."""
        await self.ensure_weights(job, task)
        version = job.policy.version
        if job.environment is not None:
            samples = await self.play(job, task)
            generated_ms = now_ms()
        else:
            prompt_ids, completions, version = await self.generate(job, task, seat)
            generated_ms = now_ms()
            samples = build_samples(prompt_ids, completions, await self.score(job, task, [c.text for c in completions]))
        lineage = common_pb2.Lineage(
            actor_id=self.settings.actor_id, delivery_attempt=attempt,
            trace_id=telemetry.current_trace_id(), received_unix_ms=received_ms,
            generated_unix_ms=generated_ms, scored_unix_ms=now_ms())
        group = common_pb2.Group(job_id=job.job_id, task_id=task.task_id, policy_version=version, prompt=task.prompt,
                                 lineage=lineage, samples=samples)
        return OUTCOMES[await self.insert(group)]

    async def play(self, job: JobContext, task: common_pb2.Task) -> list[common_pb2.Sample]:
        """The group's episodes against the job's environment (`episodes.EpisodeRunner`)."""
        spec, environment = job.spec, job.spec.environment
        if self._episodes is None or environment is None or job.environment is None:
            raise TaskFailed("this actor has no episode host for a job with an environment")
        self._check_fault(task)
        samples = await self._episodes.play(job.job_id, spec.seed, spec.rollout, environment, job.environment,
                                            job.policy.backend, task, self.verifier(job, task), tenant=job.tenant,
                                            weights=job.policy)
        policy_tokens = sum(sum(s.loss_mask) for s in samples)
        self.activity.add_tokens(policy_tokens)
        for sample in samples:
            status = common_pb2.EpisodeStatus.Name(sample.episode_status).removeprefix("EPISODE_STATUS_").lower()
            metrics.EPISODES.labels(job.job_id, status).inc()
            metrics.EPISODE_TURNS.labels(job.job_id).observe(len(sample.turns))
        return samples

    def _check_fault(self, task: common_pb2.Task) -> None:
        """Fault injection for tests: a marked prompt raises (fault_crash_marker) or kills this process
        with SIGKILL (fault_kill_marker), every time it is delivered."""
        marker = self.settings.fault_crash_marker
        if marker and marker in task.prompt:
            raise TaskFailed(f"fault injection: prompt contains {marker!r}")
        if self.settings.fault_kill_marker and self.settings.fault_kill_marker in task.prompt:
            os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def _stage(self, name: str, state: str) -> Iterator[None]:
        """One named step of a task: a child span, a step_seconds sample and the actor's state."""
        self.activity.set_state(state)
        with self._tracer.start_as_current_span(f"actor.{name}"), metrics.STEP_SECONDS.labels(name).time():
            yield

    async def ensure_weights(self, job: JobContext, task: common_pb2.Task) -> None:
        with self._stage("ensure_weights", "waiting_for_weights"):
            if not await job.policy.ensure(int(task.min_policy_version), self.settings.weights_wait_s):
                raise TaskFailed(f"weights v>={task.min_policy_version} not available "
                                 f"(holding v{job.policy.version})")

    async def generate(self, job: JobContext, task: common_pb2.Task,
                       seat: Seat | None = None) -> tuple[list[int], list[Completion], int]:
        """The task's prompt tokens, its group and the weights version that generated it: alone, or
        in its round's batch when it has a seat."""
        rollout = job.spec.rollout
        backend = job.policy.backend
        prompt_ids = prompt_tokens(backend.tokenizer, task.prompt, rollout)
        self._check_fault(task)
        request = GroupRequest(prompt_ids, rollout.samples_per_prompt, rollout.max_new_tokens, rollout.temperature,
                               rollout.top_p, task_seed(job.spec.seed, task.task_id))
        with self._stage("generate", "generating"):
            if seat is not None:
                completions, version = await seat.generate(request)
            else:
                version = job.policy.version
                (completions,) = await asyncio.to_thread(backend.generate_groups, [request])
        tokens = sum(len(c.token_ids) for c in completions)
        metrics.GENERATED_TOKENS.labels(job.job_id).inc(tokens)
        self.activity.add_tokens(tokens)
        return prompt_ids, completions, version

    def verifier(self, job: JobContext, task: common_pb2.Task) -> Verifier | None:
        """The job's built-in verifier beside its environment, scoring final actions; None without one."""
        if job.reward_spec is None:
            return None

        async def verify(texts: list[str]) -> list[reward_pb2.ScoreResult]:
            return await self.score(job, task, texts)
        return verify

    async def warm(self, job: JobContext) -> None:
        """Have the reward service load the job's scoring pool now, before its first group (best effort)."""
        if job.reward_spec is None:
            return
        try:
            await self._reward.score(job.job_id, job.reward_spec, [], tenant=job.tenant)
        except Exception as error:  # deliberate: a warm-up that fails costs only the first group's wait
            log.info("warming job %s's reward pool failed: %s", job.job_id, error)

    async def score(self, job: JobContext, task: common_pb2.Task, texts: list[str]) -> list[reward_pb2.ScoreResult]:
        """The job's reward of each text (a completion, or an episode's last action) for the task."""
        items = score_items(task, texts)
        if job.reward_spec is None:
            raise TaskFailed("the job has no reward spec")
        with self._stage("score", "scoring"):
            results = await self._reward.score(job.job_id, job.reward_spec, items, tenant=job.tenant)
        if len(results) != len(items):
            raise TaskFailed(f"reward service returned {len(results)} results for {len(items)} items")
        return results

    async def insert(self, group: common_pb2.Group) -> int:
        with self._stage("insert", "inserting"):
            group.lineage.span_id = telemetry.current_span_id()
            outcomes = await self._replay.insert([group])
        return int(outcomes[0])


def score_items(task: common_pb2.Task, texts: list[str]) -> list[reward_pb2.ScoreItem]:
    """What the reward service scores: each text as the task's completion, with its prompt and metadata."""
    return [reward_pb2.ScoreItem(completion=text, prompt=task.prompt, metadata_json=task.metadata_json or "{}")
            for text in texts]


def build_samples(prompt_ids: list[int], completions: list[Completion],
                  results: list[reward_pb2.ScoreResult]) -> list[common_pb2.Sample]:
    """A single-turn group's samples: one per completion with its reward."""
    samples = []
    for completion, result in zip(completions, results, strict=True):
        samples.append(common_pb2.Sample(
            prompt_token_ids=prompt_ids, completion_token_ids=completion.token_ids,
            behaviour_logprobs=completion.logprobs, completion_text=completion.text,
            reward=result.reward if result.status == common_pb2.REWARD_STATUS_OK else 0.0,
            reward_components=dict(result.components), reward_status=result.status,
            reward_reason=result.reason, finish_reason=completion.finish_reason,
        ))
    return samples
