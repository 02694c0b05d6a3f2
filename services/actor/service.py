"""The actor process: which jobs to serve, their models and consumers, and the lifecycle.

`Actor.run(stop)` owns NATS, the job store and the two gRPC clients in one AsyncExitStack. Every
poll_interval_s it re-reads the running jobs (oldest first; an sft job, which has nothing to generate,
is never served); for a job it has not seen it loads the
base model (`backends.make_backend`), starts the weight watch, and binds the job's shared durable
pull consumer (created with `bus.ensure_job_consumer`, the same settings the learner uses, so
max_ack_pending bounds how many tasks all actors together hold). It then takes one round of tasks at a
time from the job the fair share picks (`fleetrl.rollout.fair_share`: weighted fair queueing of the
actor's time by tenant weight); a round's groups are generated in one batch (`fleetrl.rollout.batching`).
A job that stops running is dropped. Beside its jobs, an actor with `tinker_models` serves the Tinker
API's sample requests of those bases (`fleetrl.tinker.fleet.ActorSampling`, one background loop per base).
On stop (SIGTERM) the current task is finished (or released after grace_s), then the subscriptions
are closed and the connection drained. Every heartbeat.INTERVAL_S a background task writes the
actor's heartbeat (state, job, policy version, tokens/s, busy fraction) to Redis for `fleetrl top`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import grpc
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from prometheus_client import start_http_server

from fleetrl.errors import RETRYABLE_CODES
from fleetrl.jobs.store import JobRecord, JobState, JobStore
from fleetrl.policy import shared_base
from fleetrl.policy.backends import make_backend
from fleetrl.proto.fleetrl.v1 import reward_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.reward.client import RewardClient, environment_to_proto, spec_to_proto
from fleetrl.rollout import metrics
from fleetrl.rollout.batching import RoundBatch, can_ride, group_tokens, tasks_per_round
from fleetrl.rollout.fair_share import FairShare, job_weights
from fleetrl.rollout.job_policy import JobPolicy
from fleetrl.rollout.memory import Cost, MemoryBudget, budget_bytes, job_cost, preloadable, preloaded_base
from fleetrl.rollout.rollout import JobContext, Rollout
from fleetrl.rollout.settings import ActorSettings
from fleetrl.runtime import background, heartbeat, telemetry
from fleetrl.runtime.grpcutil import RetryPolicy
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus
from fleetrl.tasks.queue import Delivery, JobQueue, Produce, parse, parsed_count
from fleetrl.tasks.samples import SampleQueue
from fleetrl.tinker.fleet import ActorSampling
from fleetrl.weights import factory
from fleetrl.weights.channel import WeightChannel

log = logging.getLogger(__name__)


def rpc_retry(settings: ActorSettings) -> RetryPolicy:
    """How the actor retries reward and replay calls: the retryable codes, NOT_FOUND (a table the
    learner has not configured yet) and UNKNOWN, with backoff for rpc_retry_s; then the task is released."""
    codes = RETRYABLE_CODES | {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN}
    return RetryPolicy(attempts=None, deadline_s=settings.rpc_retry_s, codes=codes)


def episode_retry(settings: ActorSettings) -> RetryPolicy:
    """How the actor retries episode calls: the retryable codes for rpc_retry_s, never NOT_FOUND (a
    session the reward service no longer knows ends the delivery, and the task is redelivered)."""
    return RetryPolicy(attempts=None, deadline_s=settings.rpc_retry_s, codes=RETRYABLE_CODES)


@dataclass
class ServedJob:
    """A job this actor serves: what its rollouts need, and its share of the task queue."""

    context: JobContext
    queue: JobQueue
    weight: float = 1.0
    """Its tenant's weight (`JobRecord.weight`)."""


class Actor:
    """One actor replica."""

    settings: ActorSettings
    jobs: dict[str, ServedJob]
    activity: metrics.Activity

    def __init__(self, settings: ActorSettings) -> None:
        self.settings = settings
        self.jobs = {}
        self.activity = metrics.Activity()
        self._next_refresh = 0.0
        self.fair = FairShare()
        self.memory = MemoryBudget(budget_bytes(settings), settings.job_min_residency_s)
        self._costs: dict[str, Cost] = {}
        self._deferred: set[str] = set()
        self._warming: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until stop is set."""
        s = self.settings
        telemetry.setup_tracing("actor", s.run_dir)
        metrics.ACTOR.info({"actor_id": s.actor_id})
        metrics.MEMORY_BUDGET.set(self.memory.limit)
        if s.metrics_port:
            start_http_server(s.metrics_port)
        await self._preload()
        async with AsyncExitStack() as stack:
            nc = await bus.connect(s.nats_url, f"actor-{s.actor_id}", tls_ca_file=s.tls_ca_file)
            stack.push_async_callback(self._drain, nc)
            js = bus.jetstream(nc)
            await bus.ensure_streams(js)
            store = JobStore.from_url(s.redis_url, tls_ca_file=s.tls_ca_file)
            stack.push_async_callback(store.close)
            replay = ReplayClient(s.replay_addr, timeout_s=s.replay_timeout_s, retry=rpc_retry(s))
            stack.push_async_callback(replay.close)
            reward = RewardClient(s.reward_addr, timeout_s=s.reward_timeout_s, retry=rpc_retry(s),
                                  episode_retry=episode_retry(s))
            stack.push_async_callback(reward.close)
            stack.push_async_callback(self._close_jobs)
            rollout = Rollout(s, replay, reward, self.activity, episodes=reward)
            weights = WeightChannel(factory.transport(s.weights_dir, nc, js))
            stack.push_async_callback(self._clear_beat, store)
            beats = asyncio.create_task(self._beat_loop(store, self.activity))
            stack.push_async_callback(background.stop, beats)
            await self._serve_tinker_samples(js, weights, stop, stack)
            log.info("actor %s serving (backend %s on %s)", s.actor_id, s.backend, s.device)
            while not stop.is_set():
                try:
                    await self._refresh_jobs(store, js, weights, rollout)
                except Exception as error:  # Redis or a job's model unavailable now: retry next poll
                    log.warning("refreshing the served jobs failed: %s", error)
                if not await self._serve_round(rollout, stop):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), s.poll_interval_s if not self.jobs else 0.05)
        log.info("actor %s stopped", s.actor_id)

    async def _serve_tinker_samples(self, js: JetStreamContext, weights: WeightChannel, stop: asyncio.Event,
                                    stack: AsyncExitStack) -> None:
        """Serve the Tinker API's sample requests of each of `tinker_models` in the background, until stop."""
        s = self.settings
        if not s.tinker_models:
            return
        await bus.ensure_sample_streams(js)
        sampling = ActorSampling(weights, s.tinker_adapters_cached, dtype=s.dtype, device=s.device,
                                 account=self._account_samplers, batch=s.tinker_sample_batch,
                                 linger_s=s.tinker_sample_linger_s)
        stack.push_async_callback(sampling.close)  # after every base's loop has finished
        for model in s.tinker_models:
            await bus.ensure_sample_consumer(js, model, ack_wait_s=s.tinker_sample_ack_wait_s,
                                             max_deliver=s.tinker_sample_max_deliver)
            sub = await js.pull_subscribe_bind(durable=bus.sample_consumer(model), stream=bus.SAMPLES_STREAM)
            queue = SampleQueue(model, js, sub, s.tinker_sample_ack_wait_s, s.actor_id)
            stack.push_async_callback(queue.close)  # after the loop has finished (the stack unwinds in reverse)
            serving = asyncio.create_task(sampling.run(queue, stop), name=f"tinker-samples-{model}")
            stack.push_async_callback(_finished, serving, s.grace_s)

    def _account_samplers(self, held: int) -> bool:
        """The Tinker samplers hold `held` bytes now: committed in the budget; whether it still holds them."""
        self.memory.samplers = held
        metrics.MEMORY_COMMITTED.set(self.memory.used)
        return self.memory.used <= self.memory.limit

    async def _preload(self) -> None:
        """Load the `preload_models` bases and the `tinker_models` ones now, each held for the actor's life and
        committed in its budget (a Tinker sampler is an adapter on its base: `fleetrl.tinker.fleet`)."""
        for model in dict.fromkeys([*self.settings.preload_models, *self.settings.tinker_models]):
            if model not in self.settings.tinker_models and not preloadable(model, self.settings):
                log.warning("preload_models: %s is not preloaded (its LoRA jobs would not run on a shared hf base "
                            "here: backend %s, share_lora_base %s)", model, self.settings.backend,
                            self.settings.share_lora_base)
                continue
            started = time.monotonic()
            await asyncio.to_thread(shared_base.preload, model, dtype=self.settings.dtype, device=self.settings.device)
            self.memory.pinned.add(await asyncio.to_thread(preloaded_base, model, self.settings))
            metrics.MEMORY_COMMITTED.set(self.memory.used)
            log.info("preloaded %s in %.1fs", model, time.monotonic() - started)

    async def _serve_round(self, rollout: Rollout, stop: asyncio.Event) -> bool:
        """One round led by the first job in fair-share order that has a task; whether any was taken. Each
        job in the round is charged its share of the round's seconds (by the new tokens its groups may make)."""
        weights = job_weights({job_id: (job.context.tenant, job.weight) for job_id, job in self.jobs.items()})
        idle: list[str] = []
        order = self.fair.order(weights)
        for job_id in order:
            if stop.is_set():
                break
            started = time.monotonic()
            lead = self.jobs[job_id].context
            riders = [self.jobs[other] for other in order if other != job_id and self.settings.mix_lora_jobs
                      and lead.spec.environment is None
                      and can_ride(lead.policy.backend, self.jobs[other].context.policy.backend,
                                   self.jobs[other].context.spec)]
            taken = await self._take_until_stopped(self.jobs[job_id], riders, rollout, stop)
            if taken:
                seconds, total = time.monotonic() - started, sum(taken.values())
                for served, tokens in taken.items():  # the lead first: the jobs found idle move up to its start
                    share = seconds * tokens / total
                    self.fair.served(served, share, weights[served], idle if served == job_id else ())
                    self.memory.mark_served(served, time.monotonic())
                    metrics.SERVED_SECONDS.labels(served).inc(share)
                return True
            idle.append(job_id)
        return False

    async def _take_until_stopped(self, job: ServedJob, riders: list[ServedJob], rollout: Rollout,
                                  stop: asyncio.Event) -> dict[str, int]:
        """Take at most one round led by job; on stop, let it finish for grace_s, then release what is left.
        What `take_round` returns (empty when nothing was taken)."""
        step = asyncio.create_task(take_round(job, rollout, self.settings.round_tokens, riders))
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if step in done:
            return step.result()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(step), self.settings.grace_s)
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step
        return {}

    async def _refresh_jobs(self, store: JobStore, js: JetStreamContext, weights: WeightChannel,
                            rollout: Rollout) -> None:
        """Every poll_interval_s: start serving new running jobs, drop those that stopped."""
        if time.monotonic() < self._next_refresh:
            return
        self._next_refresh = time.monotonic() + self.settings.poll_interval_s
        active: Iterable[JobRecord] = await store.active_jobs()
        running = [r for r in active if r.state == JobState.RUNNING and r.spec.rolls_out]  # sft jobs need none
        for job_id in set(self.jobs) - {r.job_id for r in running}:
            log.info("job %s no longer running; dropping it", job_id)
            await self._drop_job(job_id)
        for job_id in set(self._costs) - {r.job_id for r in running}:
            del self._costs[job_id]
        for record in running:
            if record.job_id not in self.jobs and await self._make_room(record):
                try:
                    self.jobs[record.job_id] = job = await self._open_job(record, store, js, weights)
                except BaseException:
                    self.memory.release(record.job_id)
                    raise
                warming = asyncio.create_task(rollout.warm(job.context))
                self._warming.add(warming)
                warming.add_done_callback(self._warming.discard)

    async def _make_room(self, record: JobRecord) -> bool:
        """Whether the job fits the memory budget now, after dropping the jobs `MemoryBudget` names;
        if so, its cost is held for it."""
        job_id = record.job_id
        if job_id not in self._costs:
            self._costs[job_id] = await asyncio.to_thread(job_cost, record.spec, self.settings)
        cost, now = self._costs[job_id], time.monotonic()
        victims = self.memory.make_room(cost, now)
        if victims is None:
            metrics.JOBS_DEFERRED.labels(job_id).inc()
            if job_id not in self._deferred:  # logged once per wait, counted at every refresh
                self._deferred.add(job_id)
                log.info("job %s (%s) does not fit the memory budget now (%d of %d MiB held): not taken", job_id,
                         cost, self.memory.used >> 20, self.memory.limit >> 20)
            return False
        self._deferred.discard(job_id)
        for victim in victims:
            log.info("dropping job %s to make room for job %s (memory budget)", victim, job_id)
            metrics.JOBS_DROPPED.labels(victim).inc()
            await self._drop_job(victim)
        self.memory.hold(job_id, cost, now)
        metrics.MEMORY_COMMITTED.set(self.memory.used)
        return True

    async def _drop_job(self, job_id: str) -> None:
        """Stop serving a job (it stopped running, or makes room for another): its tasks stay in the queue."""
        self.fair.forget(job_id)
        self.memory.release(job_id)
        metrics.MEMORY_COMMITTED.set(self.memory.used)
        await self._close_job(self.jobs.pop(job_id))

    async def _open_job(self, record: JobRecord, store: JobStore, js: JetStreamContext,
                        weights: WeightChannel) -> ServedJob:
        s, spec = self.settings, record.spec
        _, reward_file = await store.files(record.job_id)
        environment_file = await store.environment_file(record.job_id) if spec.environment is not None else None
        backend = await asyncio.to_thread(make_backend, s.backend, spec.model, dtype=s.dtype, device=s.device,
                                          fixed_latency_s=s.fixed_latency_s, lora=spec.train.lora,
                                          vllm_kv_cache_gib=s.vllm_kv_cache_gib, share_lora_base=s.share_lora_base,
                                          job_id=record.job_id)
        policy = JobPolicy(record.job_id, backend, weights, pull_attempts=s.weights_pull_attempts,
                           keep_payload=spec.train.full_publish_interval > 1)
        policy.start()
        await bus.ensure_job_consumer(js, record.job_id, spec)
        sub = await js.pull_subscribe_bind(durable=bus.task_consumer(record.job_id), stream=bus.TASKS_STREAM)
        log.info("serving job %s (model %s, backend %s)", record.job_id, spec.model, type(backend).__name__)
        queue = JobQueue(record.job_id, spec.train, js, sub, s)
        return ServedJob(JobContext(record.job_id, spec, job_reward_spec(spec, reward_file), policy,
                                    job_environment(spec, environment_file), tenant=record.tenant), queue,
                         record.weight)

    async def _beat_loop(self, store: JobStore, activity: metrics.Activity) -> None:
        """Write this actor's heartbeat every heartbeat.INTERVAL_S; a failed write is retried next time."""
        await background.repeat(lambda: heartbeat.write(store.redis, self._beat(activity)), heartbeat.INTERVAL_S,
                                what="heartbeat")  # Redis restarting: the beat lapses, top shows the actor gone

    def _beat(self, activity: metrics.Activity) -> heartbeat.Beat:
        busy, tokens_per_s = activity.rates()
        job = self.jobs.get(activity.job_id)
        version = max(0, job.context.policy.version) if job else 0
        return heartbeat.Beat("actor", self.settings.actor_id, activity.state, activity.job_id if job else "",
                              version, tokens_per_s, busy, int(time.time() * 1000), activity.served_s())

    async def _clear_beat(self, store: JobStore) -> None:
        with contextlib.suppress(Exception):  # best effort: the beat expires anyway
            await heartbeat.clear(store.redis, "actor", self.settings.actor_id)

    @staticmethod
    async def _close_job(job: ServedJob) -> None:
        await job.context.policy.close()
        await job.queue.close()
        await asyncio.to_thread(job.context.policy.backend.close)

    async def _close_jobs(self) -> None:
        for job in self.jobs.values():
            await self._close_job(job)
        self.jobs.clear()

    @staticmethod
    async def _drain(nc: NATS) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), bus.REQUEST_TIMEOUT_S)


async def _finished(task: asyncio.Task[None], grace_s: float) -> None:
    """Wait up to grace_s for a background loop that saw stop to end (its request served), then cancel it
    (its request is released); its failure is raised here."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), grace_s)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def job_reward_spec(spec: JobSpec, reward_file: bytes | None) -> reward_pb2.RewardSpec | None:
    return spec_to_proto(spec.reward, reward_file or b"") if spec.reward is not None else None


def job_environment(spec: JobSpec, environment_file: bytes | None) -> reward_pb2.EnvironmentSpec | None:
    return environment_to_proto(spec.environment, environment_file or b"") if spec.environment is not None else None


RIDER_FETCH_S = 0.05
"""How long a round waits for a rider's tasks: only those already queued ride."""


async def take_round(lead: ServedJob, rollout: Rollout, round_tokens: int,
                     riders: Iterable[ServedJob] = ()) -> dict[str, int]:
    """Take and finish a round: up to `tasks_per_round` of lead's tasks, then, while round_tokens has room,
    tasks already queued for riders (jobs whose groups can share lead's batch: `batching.can_ride`), all
    generated in one batch (`fleetrl.rollout.batching`). Returns the new tokens each job's tasks could
    make in the round (its share), empty when none was taken. A job whose actor holds no weights yet
    takes none."""
    if not await lead.context.policy.refresh():
        return {}
    fetch_ns = time.time_ns()
    msgs = await lead.queue.fetch(tasks_per_round(lead.context.spec, round_tokens))
    if not msgs:
        return {}
    taken = [(lead, msgs)]
    room = round_tokens - len(msgs) * group_tokens(lead.context.spec)
    for rider in riders:
        want = min(rider.context.spec.rollout.prompts_per_step, room // group_tokens(rider.context.spec))
        if want >= 1 and await rider.context.policy.refresh():
            got = await rider.queue.fetch(want, RIDER_FETCH_S)
            if got:
                taken.append((rider, got))
                room -= len(got) * group_tokens(rider.context.spec)
    rounds = [(job, got, [parse(msg) for msg in got]) for job, got in taken]
    batch = RoundBatch(lead.context.job_id, sum(parsed_count(tasks) for _, _, tasks in rounds))

    def produce_for(job: ServedJob) -> Produce:
        policy = job.context.policy

        async def produce(delivery: Delivery) -> str:
            seat = batch.seat(policy.backend, lambda: policy.version)
            # Alone: a redelivered task (one that killed its actor costs its round-mates one try, not all of
            # theirs), and an episode, which generates turn by turn and never asks the round's batch.
            if delivery.attempt > 1 or job.context.spec.environment is not None:
                seat.leave()
                return await rollout.run(job.context, delivery.task, delivery.attempt, delivery.received_ms)
            try:
                return await rollout.run(job.context, delivery.task, delivery.attempt, delivery.received_ms, seat)
            finally:
                seat.leave()  # a task that ended before asking for its group lets the others' batch start
        return produce

    shares = {job.context.job_id: len(got) * group_tokens(job.context.spec) for job, got in taken}
    rollout.activity.begin(lead.context.job_id)
    try:
        await asyncio.gather(*(job.queue.handle_round(got, tasks, fetch_ns, produce_for(job))
                               for job, got, tasks in rounds))
    finally:
        rollout.activity.end({job: float(tokens) for job, tokens in shares.items()})
    return shares
