"""The learner process: claim jobs, run them, report, repeat.

Lifecycle (nats.py's graceful-shutdown pattern): an AsyncExitStack owns the NATS connection,
the job store, the replay client and the status gRPC server. A job is claimed with a lease in
Redis (`JobStore.claim`), renewed every lease_s / 3 by a background task; a lease that cannot be
renewed sets `lease_lost` and the run stops at once without committing anything; a write refused
by the fencing token (`Fenced`: the learner was stopped past its lease and another claimed the job)
ends the run the same way, and so does Redis unreachable past the job store's retries (the lease
lapses and a claim, this learner's or another's, resumes the job from its checkpoint: an outage is
not the job's failure). A store that refuses writes for want of space is an outage of that store too:
Redis at `maxmemory` or unable to write its AOF (`jobs.store.redis_full`), met directly, as replay's
RESOURCE_EXHAUSTED after the replay client's retries, or as job-lease renewals refused until the lease ran
out (a run waiting for groups writes nothing else), stops the run the same way, with the reason on the
status board (phase "paused"), in `fleetrl_learner_store_full{store="redis"}` and in the log; the claim
loop waits out the same refusal, and once Redis takes writes again a claim resumes the job from its
checkpoint (a full checkpoint disk or JetStream is waited out inside the run: `fleetrl.train.full_stores`). So is
a NATS outage, for `store_full_wait_s`; one that lasts longer stops the run as an unreachable Redis does (no FAILED
state, the lease left to lapse, the status board "paused" with the outage), and a claim resumes the job from its
checkpoint: NATS unreachable is an outage, where a store still full past the wait fails the job. A second
background task keeps the run's replay leases open (`leases.keep_alive`) until that moment. A job that
raises is marked FAILED with the reason and the learner goes on to the next one. An sft job
(`algorithm.name = "sft"`) runs as a `fleetrl.train.sft.SftRun`: the same lifecycle, on its
demonstrations instead of replay's groups. SIGTERM lets the current step finish, checkpoints, hands
the job back (lease released, state RUNNING, so any learner resumes it) and exits. Tracing, the
/metrics endpoint and the heartbeat/queue-gauge task (`fleetrl.train.observability`) start with the
process.

Several jobs at once (`max_jobs` > 1): each claimed job is its own run (a task with its own lease
renewal, replay keep-alive, lease-lost event and `JobStatus`); they share the process's connections and
its one compute thread, where their steps take turns. Past the first job the learner claims only LoRA
jobs on the base model of the LoRA jobs it runs (`JobStore.claim(lora_base=...)`), so it holds one copy
of that base for all of them (`lora.SharedBases`); a full fine-tune runs alone. A run that ends frees
its slot for the next claim; SIGTERM hands every run's job back.

With `tinker_models`, the learner also hosts Tinker API training runs of those bases
(`fleetrl.tinker.learners.TrainingHost`): their calls run on the same compute thread, between its jobs'
steps, and their adapters sit on the same shared base as its LoRA jobs'.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Iterable

from nats.aio.client import Client as NATS

from fleetrl.errors import Cancelled, FailedPrecondition, Fenced, ResourceExhausted
from fleetrl.jobs.store import (
    REDIS_FULL,
    REDIS_RETRY_INTERVAL_S,
    REDIS_UNREACHABLE,
    RENEW_SHARE_OF_LEASE,
    JobRecord,
    JobState,
    JobStore,
    redis_full,
)
from fleetrl.policy.lora import SharedBases
from fleetrl.replay.client import ReplayClient
from fleetrl.reward.client import RewardClient
from fleetrl.runtime import background, telemetry
from fleetrl.runtime.grpcutil import RetryPolicy, stop_server
from fleetrl.runtime.observe import serve_metrics
from fleetrl.services.learner import server
from fleetrl.tasks import bus
from fleetrl.tinker.fleet import SamplerVersions
from fleetrl.tinker.learners import TrainingHost
from fleetrl.train.full_stores import HandedBack
from fleetrl.train.leases import keep_alive
from fleetrl.train.observability import STORE_FULL, LearnerBeats
from fleetrl.train.settings import LearnerSettings
from fleetrl.train.sft import SftRun
from fleetrl.train.status import StatusBoard
from fleetrl.train.trainer import Deps, JobRun, LeaseLost, compute_executor
from fleetrl.weights import factory
from fleetrl.weights.channel import WeightChannel

log = logging.getLogger(__name__)


async def renew_loop(deps: Deps, job_id: str) -> str:
    """Keep the job lease alive; set lease_lost when Redis says it is gone, or when no renewal succeeded
    within lease_s of the start of the last good one (at first, of this loop's start, just after the claim).
    Each renewal gives up after a third of the lease (`JobStore.renew`), or when the lease ends if that is
    sooner, so a learner cut off from Redis reaches its stop path about when its lease lapses there, not a
    socket timeout and two retry budgets later. A loop that wakes past the lease (this process was
    paused) makes one full try, and Redis's answer decides. A renewal refused for want of space
    (`redis_full`) is tried again the same way; returns its reason when the lease ran out on such
    refusals (the job pauses: `run_claimed`), "" when the lease was lost. The renewal is the run's one
    periodic write, so a learner that writes nothing else (waiting for groups that actors cannot store)
    still meets a full Redis within the lease."""
    settings = deps.settings
    interval_s, bound_s = settings.lease_s / 3, settings.lease_s * RENEW_SHARE_OF_LEASE
    good_until = time.monotonic() + settings.lease_s
    pause_s = interval_s
    refused = ""
    while True:
        await asyncio.sleep(max(0.0, min(pause_s, good_until - time.monotonic())))
        started = time.monotonic()
        left_s = good_until - started
        try:
            renewed = await deps.jobs.renew(job_id, settings.learner_id, settings.lease_s,
                                            timeout_s=min(bound_s, left_s) if left_s > 0 else bound_s)
        except Exception as error:  # Redis restarting, stopped or full: try again while the lease lasts
            if not isinstance(error, REDIS_UNREACHABLE) and not redis_full(error):
                raise
            refused = redis_full(error)
            log.warning("lease renewal of job %s failed: %s", job_id, error)
            if good_until - time.monotonic() < REDIS_RETRY_INTERVAL_S:  # no time left for another try
                break
            pause_s = REDIS_RETRY_INTERVAL_S
            continue
        refused = ""
        if not renewed:
            break
        good_until, pause_s = started + settings.lease_s, interval_s
    deps.lease_lost.set()
    if not refused:
        log.error("job %s: lease lost", job_id)
    return refused


def renewal_refused(renewer: asyncio.Task[str]) -> str:
    """Why the renewal loop stopped the run on a full Redis (its result), or "" when it did not."""
    if not renewer.done() or renewer.cancelled() or renewer.exception() is not None:
        return ""
    return renewer.result()


def store_full(error: BaseException) -> str:
    """Why a run stopped on a full Redis, or "" for any other error: Redis refusing a write for want of
    space (`redis_full`: the job store's and the ledger's writes), or replay still answering that after
    the replay client's retries (RESOURCE_EXHAUSTED with the `redis_full` reason)."""
    if full := redis_full(error):
        return full
    return str(error) if isinstance(error, ResourceExhausted) and str(error).startswith(REDIS_FULL) else ""


async def run_claimed(deps: Deps, record: JobRecord) -> bool:
    """Run one claimed job until it ends or stops (deps: the run's own, `Deps.board` and `lease_lost`):
    failures become FAILED; the lease is released unless the run stopped as if it had lost it. True when
    the run paused on a full Redis or NATS unreachable past the wait (a claim resumes it)."""
    run = JobRun(deps, record) if record.spec.rolls_out else SftRun(deps, record)
    renewer = asyncio.create_task(renew_loop(deps, record.job_id))
    keeper = asyncio.create_task(keep_alive(run.book, deps.replay, record.job_id,
                                            record.spec.replay.lease_timeout_s / 3, deps.lease_lost))
    try:
        await run.run()
    except Fenced as error:  # another learner claimed the job: write nothing more, release nothing
        deps.lease_lost.set()
        log.warning("job %s stopped, fenced: %s", record.job_id, error)
    except HandedBack as error:  # SIGTERM while paused on a full store: the lease is released below
        log.warning("job %s handed back: %s", record.job_id, error)
    except (LeaseLost, Cancelled) as error:
        if reason := renewal_refused(renewer):  # Redis refused the renewals until the lease ran out
            return pause(deps, record.job_id, reason)
        log.warning("job %s stopped: %s", record.job_id, error)
    except REDIS_UNREACHABLE as error:  # Redis down past the store's retries: not the job's failure
        deps.lease_lost.set()  # nothing more is written; the lease lapses and a claim resumes the job
        log.warning("job %s stopped, Redis unreachable: %s", record.job_id, error)
    except bus.NatsUnreachable as error:  # NATS down past store_full_wait_s: not the job's failure either
        return pause_unreachable(deps, record.job_id, error)
    except Exception as error:  # deliberate: a failing job must not take the learner down
        return await fail_or_pause(deps, record.job_id, error)
    finally:
        renewer.cancel()
        keeper.cancel()
        run.close()
        if not deps.lease_lost.is_set():
            await deps.jobs.release(record.job_id, deps.settings.learner_id)
        deps.board.phase = "done" if deps.board.phase not in ("done", "paused") else deps.board.phase
    return False


async def fail_or_pause(deps: Deps, job_id: str, error: Exception) -> bool:
    """Mark the job FAILED for error; True (and nothing written) when error, or the FAILED write itself,
    is a full store's refusal: an outage of that store, not the job's failure (a job that ran out of time
    waiting for groups that actors could not store fails only once the store takes its FAILED state)."""
    if not (reason := store_full(error)):
        log.exception("job %s failed", job_id)
        if deps.lease_lost.is_set():
            return False
        try:
            await deps.jobs.set_state(job_id, JobState.FAILED, f"{type(error).__name__}: {error}")
            return False
        except FailedPrecondition:
            return False
        except Exception as refused:
            if not (reason := store_full(refused)):
                raise
    return pause(deps, job_id, reason)


def pause(deps: Deps, job_id: str, reason: str) -> bool:
    """Stop the run on a full Redis, writing nothing more: the lease lapses, and a claim resumes the job
    once Redis takes writes. True: the job is paused, not ended."""
    deps.lease_lost.set()
    deps.board.pause(reason)
    STORE_FULL.labels("redis").set(1)
    log.warning("job %s paused, Redis refuses writes: %s; it resumes from its checkpoint when Redis takes "
                "writes again", job_id, reason)
    return True


def pause_unreachable(deps: Deps, job_id: str, error: bus.NatsUnreachable) -> bool:
    """Stop the run on NATS unreachable past `store_full_wait_s`, writing nothing more, as on an unreachable
    Redis: the lease lapses, the job stays RUNNING with the outage as its pause reason (`FullStoreWait` wrote
    it), and a claim, this learner's or another's, resumes it from its checkpoint. The steps trained since
    that checkpoint are trained again: their replay leases were never committed. True: paused, not ended."""
    deps.lease_lost.set()
    deps.board.pause(str(error))
    log.warning("job %s paused, NATS unreachable past store_full_wait_s (%g s): %s; it resumes from its checkpoint "
                "once a learner claims it and reaches NATS", job_id, deps.settings.store_full_wait_s, error)
    return True


async def claim(jobs: JobStore, settings: LearnerSettings, board: StatusBoard, lora_base: str = "") -> JobRecord | None:
    """The next job to run (with `lora_base`, a LoRA job on that base), or None: none is claimable, or
    Redis is unreachable or full (logged once per spell of refusals). A claim that lands ends a pause on a
    full Redis."""
    try:
        record = await jobs.claim(settings.learner_id, settings.lease_s, lora_base=lora_base)
    except Exception as error:
        if isinstance(error, REDIS_UNREACHABLE):  # Redis down past the store's retries: ask again
            log.warning("claim failed: %s", error)
            return None
        if not (reason := redis_full(error)):
            raise
        if board.paused_reason != (refused := f"claims refused: {reason}"):
            log.warning("claim refused, Redis refuses writes: %s", reason)
            board.paused_reason = refused
        STORE_FULL.labels("redis").set(1)
        return None
    STORE_FULL.labels("redis").set(0)
    board.paused_reason = ""
    return record


def next_claim(settings: LearnerSettings, running: list[JobRecord]) -> str | None:
    """What this learner may claim next: "" any job (it runs none), a base model's name (only a LoRA job on
    that base: it runs LoRA jobs on it, with a slot free), or None (nothing: it is full, or runs a full
    fine-tune)."""
    if not running:
        return ""
    bases = {r.spec.model if r.spec.train.lora is not None else None for r in running}
    if len(running) >= settings.max_jobs or len(bases) != 1 or None in bases:
        return None
    return next(iter(bases))


async def wait_or_stop(stop: asyncio.Event, timeout_s: float, runs: Iterable[asyncio.Task[bool]] = ()) -> None:
    """Until stop is set, a run ends or timeout_s passes."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([stopped, *runs], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()


async def serve(settings: LearnerSettings, stop: asyncio.Event, *, once: bool = False) -> None:
    """Claim and run up to `max_jobs` jobs at a time until stop is set, then wait for the runs to hand their
    jobs back (once: no claim after the first job ends, or stops as if its lease were lost, and return when
    no run is left; a job paused on a full Redis or on NATS unreachable is claimed again)."""
    telemetry.setup_tracing("learner", settings.run_dir)
    serve_metrics(settings.metrics_port)
    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(settings.nats_url, f"learner {settings.learner_id}", tls_ca_file=settings.tls_ca_file)
        stack.push_async_callback(nc.drain)
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        jobs = JobStore.from_url(settings.redis_url, tls_ca_file=settings.tls_ca_file)
        stack.push_async_callback(jobs.close)
        replay = ReplayClient(settings.replay_addr, timeout_s=settings.rpc_timeout_s, attempts=settings.replay_attempts)
        stack.push_async_callback(replay.close)
        board = StatusBoard(settings.learner_id)
        beats = LearnerBeats(board, jobs.redis, js)
        stack.push_async_callback(beats.clear)
        observer = asyncio.create_task(beats.run())
        stack.push_async_callback(background.stop, observer)
        grpc_server, port, health = await server.start(board, settings.listen)
        stack.push_async_callback(stop_server, grpc_server, health, settings.grace_s)
        log.info("learner %s: status on port %d", settings.learner_id, port)
        reward = RewardClient(settings.reward_addr, timeout_s=settings.rpc_timeout_s,
                              retry=RetryPolicy(deadline_s=settings.rpc_timeout_s * 4))
        stack.push_async_callback(reward.close)
        compute = compute_executor(settings.compute_nice)
        stack.callback(compute.shutdown, wait=False)
        weights, bases = WeightChannel(factory.transport(settings.weights_dir, nc, js)), SharedBases()
        if settings.tinker_models:
            await host_tinker_runs(settings, nc, weights, compute, bases, stack)
        runs: dict[asyncio.Task[bool], JobRecord] = {}
        stack.push_async_callback(finish_runs, runs, stop)
        ended = False
        while not stop.is_set():
            for run in [run for run in runs if run.done()]:
                board.end_job(runs.pop(run).job_id)
                ended = ended or not run.result()  # a paused job has not ended: claim it again
            if once and ended and not runs:
                return
            lora_base = None if once and ended else next_claim(settings, list(runs.values()))
            record = None if lora_base is None else await claim(jobs, settings, board, lora_base)
            if record is None:
                await wait_or_stop(stop, settings.claim_poll_s, runs)
                continue
            log.info("learner %s claimed job %s (running %d)", settings.learner_id, record.job_id, len(runs) + 1)
            deps = Deps(settings, jobs, nc, js, replay, weights, board.start_job(record.job_id), stop,
                        reward=reward, compute=compute, bases=bases)
            runs[asyncio.create_task(run_claimed(deps, record), name=f"job {record.job_id}")] = record


async def host_tinker_runs(settings: LearnerSettings, nc: NATS, weights: WeightChannel,
                           compute: concurrent.futures.Executor, bases: SharedBases,
                           stack: contextlib.AsyncExitStack) -> None:
    """Host the Tinker API's training runs of `tinker_models` (`fleetrl.tinker.learners`) until the learner
    stops; runs idle past `tinker_run_idle_s` are dropped."""
    host = TrainingHost(nc, weights.transport, settings.learner_id, settings.tinker_models,
                        max_runs=settings.tinker_max_runs, idle_s=settings.tinker_run_idle_s, compute=compute,
                        bases=bases, versions=SamplerVersions(weights))
    await host.start()
    stack.push_async_callback(host.close)

    dropper = asyncio.create_task(background.repeat(host.drop_idle, settings.tinker_run_idle_s / 4,
                                                    what="dropping idle tinker runs", first_after=True))
    stack.push_async_callback(background.stop, dropper)


async def finish_runs(runs: dict[asyncio.Task[bool], JobRecord], stop: asyncio.Event) -> None:
    """Wait for the runs still going before the connections they use close: after SIGTERM (stop set) each
    hands its job back after its step; when the learner fails instead, they are cancelled (each releases its
    lease, and a claim resumes its job from its checkpoint). A run's error is raised once all have ended."""
    if not stop.is_set():
        for run in runs:
            run.cancel()
    results = await asyncio.gather(*runs, return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):
            raise result
