"""A learner whose Redis stays stopped past its job lease reaches its stop path, about when the lease lapses.

A real learner process (3 s job lease) trains a job; after its second step Valkey is SIGSTOPped (a
partition as the learner sees it: connections open, no answers) and kept stopped past the lease. Each
lease renewal gives up after a third of the lease (`JobStore.renew`), so the learner logs its lease lost
within the lease of the stop, not after the client's 10 s socket timeout and nested retries. Valkey is
then continued: the learner stops the run without writing anything more (the job is neither failed nor
released: its lease lapsed, and a claim would resume it from its checkpoint) and exits cleanly.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from learner_fleet import create_job, insert_groups, learner_process, replay_service, spec_for
from test_crash import finish

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.launcher.embedded import EmbeddedValkey
from fleetrl.replay.client import ReplayClient

LEASE_S = 3.0
"""learner_process's FLEETRL_LEARNER_LEASE_S."""


async def until(what: str, cond: object, timeout_s: float) -> float:
    """Await cond() (sync or async) until truthy; the monotonic time it became so."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()  # type: ignore[operator]
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic()
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_learner_cut_off_from_redis_past_its_lease_stops(nats_url: str, valkey_server: EmbeddedValkey,
                                                                tmp_path: Path) -> None:
    redis_url = valkey_server.url
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=1000, checkpoint_interval=2)  # a job that does not end by itself
    log = tmp_path / "learner.log"
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        job = await create_job(jobs, spec)
        await insert_groups(replay, job, 16)
        learner = learner_process(nats_url, redis_url, addr, tmp_path / "run", log)
        await until("step 2", lambda: _steps_at_least(jobs, job.job_id, 2), 120)
        assert valkey_server.proc is not None
        valkey_server.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            lost_at = await until("the lease lost", lambda: f"job {job.job_id}: lease lost" in log.read_text(),
                                  LEASE_S + 5)
            await asyncio.sleep(max(0.0, stopped_at + LEASE_S + 1 - time.monotonic()))  # stopped past the lease
        finally:
            valkey_server.proc.send_signal(signal.SIGCONT)
        await finish(learner, 60)  # exit 0: the run stopped, the learner did not crash
        record = await jobs.get(job.job_id)
        holder = await jobs.lease_holder(job.job_id)
    await jobs.close()
    text = log.read_text()
    lost_after = lost_at - stopped_at
    print(f"Valkey stopped after step 2: lease lost {lost_after:.2f} s later (lease {LEASE_S} s); "
          f"{[line for line in text.splitlines() if 'stopped' in line]}")
    # the last good renewal began at most a third of the lease before the stop; a socket timeout is 10 s
    assert lost_after <= LEASE_S + 1.0, lost_after
    assert f"job {job.job_id} stopped" in text and "Traceback" not in text
    assert record.state == JobState.RUNNING and not record.reason, record  # not failed: a claim resumes it
    assert holder is None  # nobody holds the lease: it lapsed, and the learner did not renew it after


async def _steps_at_least(jobs: JobStore, job_id: str, n: int) -> bool:
    return len(await jobs.steps(job_id)) >= n
