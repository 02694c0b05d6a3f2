"""The learner process: claim a job, run it, report, repeat.

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
checkpoint (a full checkpoint disk or JetStream is waited out inside the run: `fleetrl.train.full_stores`). A second
background task keeps the run's replay leases open (`leases.keep_alive`) until that moment. A job that
raises is marked FAILED with the reason and the learner goes on to the next one. An sft job
(`algorithm.name = "sft"`) runs as a `fleetrl.train.sft.SftRun`: the same lifecycle, on its
demonstrations instead of replay's groups. SIGTERM lets the current step finish, checkpoints, hands
the job back (lease released, state RUNNING, so any learner resumes it) and exits. Tracing, the
/metrics endpoint and the heartbeat/queue-gauge task (`fleetrl.train.observability`) start with the
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

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
from fleetrl.replay.client import ReplayClient
from fleetrl.reward.client import RewardClient
from fleetrl.runtime import telemetry
from fleetrl.runtime.grpcutil import RetryPolicy, stop_server
from fleetrl.runtime.observe import serve_metrics
from fleetrl.services.learner import server
from fleetrl.tasks import bus
from fleetrl.train.leases import keep_alive
from fleetrl.train.observability import STORE_FULL, clear_beat, observe_loop
from fleetrl.train.settings import LearnerSettings
from fleetrl.train.sft import SftRun
from fleetrl.train.status import StatusBoard
from fleetrl.train.trainer import Deps, JobRun, LeaseLost, compute_executor
from fleetrl.weights.store import WeightStore

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
    """Run one claimed job until it ends or stops: failures become FAILED; the lease is released unless
    the run stopped as if it had lost it. True when the run paused on a full store (a claim resumes it)."""
    deps.lease_lost = asyncio.Event()
    deps.board.start_job(record.job_id)
    run = JobRun(deps, record) if record.spec.rolls_out else SftRun(deps, record)
    renewer = asyncio.create_task(renew_loop(deps, record.job_id))
    keeper = asyncio.create_task(keep_alive(run.book, deps.replay, record.job_id,
                                            record.spec.replay.lease_timeout_s / 3, deps.lease_lost))
    try:
        await run.run()
    except Fenced as error:  # another learner claimed the job: write nothing more, release nothing
        deps.lease_lost.set()
        log.warning("job %s stopped, fenced: %s", record.job_id, error)
    except (LeaseLost, Cancelled) as error:
        if reason := renewal_refused(renewer):  # Redis refused the renewals until the lease ran out
            return pause(deps, record.job_id, reason)
        log.warning("job %s stopped: %s", record.job_id, error)
    except REDIS_UNREACHABLE as error:  # Redis down past the store's retries: not the job's failure
        deps.lease_lost.set()  # nothing more is written; the lease lapses and a claim resumes the job
        log.warning("job %s stopped, Redis unreachable: %s", record.job_id, error)
    except Exception as error:  # deliberate: a failing job must not take the learner down
        return await fail_or_pause(deps, record.job_id, error)
    finally:
        renewer.cancel()
        keeper.cancel()
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


async def claim(deps: Deps) -> JobRecord | None:
    """The next job to run, or None: none is claimable, or Redis is unreachable or full (logged once per
    spell of refusals). A claim that lands ends a pause on a full Redis."""
    try:
        record = await deps.jobs.claim(deps.settings.learner_id, deps.settings.lease_s)
    except Exception as error:
        if isinstance(error, REDIS_UNREACHABLE):  # Redis down past the store's retries: ask again
            log.warning("claim failed: %s", error)
            return None
        if not (reason := redis_full(error)):
            raise
        if deps.board.paused_reason != (refused := f"claims refused: {reason}"):
            log.warning("claim refused, Redis refuses writes: %s", reason)
            deps.board.pause(refused)
        STORE_FULL.labels("redis").set(1)
        return None
    STORE_FULL.labels("redis").set(0)
    deps.board.paused_reason = ""
    return record


async def wait_or_stop(stop: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout_s)


async def serve(settings: LearnerSettings, stop: asyncio.Event, *, once: bool = False) -> None:
    """Claim and run jobs until stop is set (once: after the first job ends, or stops as if its lease were
    lost; a job paused on a full Redis is claimed again)."""
    telemetry.setup_tracing("learner", settings.run_dir)
    serve_metrics(settings.metrics_port)
    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(settings.nats_url, f"learner {settings.learner_id}")
        stack.push_async_callback(nc.drain)
        js = bus.jetstream(nc)
        await bus.ensure_streams(js)
        jobs = JobStore.from_url(settings.redis_url)
        stack.push_async_callback(jobs.close)
        replay = ReplayClient(settings.replay_addr, timeout_s=settings.rpc_timeout_s, attempts=settings.replay_attempts)
        stack.push_async_callback(replay.close)
        board = StatusBoard(settings.learner_id)
        stack.push_async_callback(clear_beat, jobs.redis, settings.learner_id)
        observer = asyncio.create_task(observe_loop(board, jobs.redis, js))
        stack.callback(observer.cancel)
        grpc_server, port, health = await server.start(board, settings.listen)
        stack.push_async_callback(stop_server, grpc_server, health, settings.grace_s)
        log.info("learner %s: status on port %d", settings.learner_id, port)
        reward = RewardClient(settings.reward_addr, timeout_s=settings.rpc_timeout_s,
                              retry=RetryPolicy(deadline_s=settings.rpc_timeout_s * 4))
        stack.push_async_callback(reward.close)
        compute = compute_executor(settings.compute_nice)
        stack.callback(compute.shutdown, wait=False)
        deps = Deps(settings, jobs, nc, js, replay, WeightStore(nc, js), board, stop, reward=reward, compute=compute)
        while not stop.is_set():
            record = await claim(deps)
            if record is None:
                await wait_or_stop(stop, settings.claim_poll_s)
                continue
            log.info("learner %s claimed job %s", settings.learner_id, record.job_id)
            paused = await run_claimed(deps, record)
            if once and not paused:  # a paused job has not ended: claim it again when Redis takes writes
                return
