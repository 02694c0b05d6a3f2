"""A real partition, not a stopped process: the learner alone cut off from Redis by a TCP proxy.

The learner reaches Valkey through a proxy in the test process; replay and the test reach it directly.
After step 3 the proxy stops moving bytes both ways and keeps every connection open, as a network that
drops packets does (no RST, no FIN: the learner's sockets stay established and its requests get no
answer), and accepts new connections without forwarding them. Then the learner must notice within its
bounded deadlines, not hang on a socket: its lease renewals time out, the run stops at the end of its
lease ("lease lost"), the process stays up (it serves as deployed, without `--once`), and its claims
time out while the cut lasts. When the proxy forwards again, a claim of the same process resumes the
job from its checkpoint, and the ledger holds every step once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from blackhole import Blackhole
from learner_fleet import create_job, insert_groups, learner_process, replay_service, spec_for
from test_crash import finish, metrics
from test_store_full import LEASE_S, PPS, STEPS, account, assert_exact, until

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.replay.client import ReplayClient

CUT_S = 4 * LEASE_S
"""How long the partition lasts: past the lease, so the job lease lapses in Redis."""


async def test_the_learner_cut_off_from_redis_stops_at_its_lease_and_resumes_when_it_heals(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    host, port = redis_url.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    proxy = Blackhole(host, int(port))
    proxied = f"redis://127.0.0.1:{await proxy.start()}/0"
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    try:
        async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
            job = await create_job(jobs, spec)
            await insert_groups(replay, job, STEPS * PPS + 2)
            learner = learner_process(nats_url, proxied, addr, run_dir, log, once=False)  # as deployed
            await until("step 3", lambda: len(metrics(run_dir, job.job_id)) >= 3)
            proxy.cut()
            cut_at = time.monotonic()
            await until("the run's stop", lambda: f"job {job.job_id}: lease lost" in log.read_text(),
                        LEASE_S + 10)
            stopped_after_s = time.monotonic() - cut_at
            await asyncio.sleep(max(0.0, CUT_S - stopped_after_s))
            assert learner.poll() is None, "the learner exited during the partition"
            during = await jobs.get(job.job_id)  # read directly: the lease lapsed, no one holds the job
            lease_holder = await jobs.lease_holder(job.job_id)
            proxy.heal()
            await until("the job's end", lambda: f"job {job.job_id} ledger" in log.read_text(), 120)
            learner.send_signal(signal.SIGTERM)
            await finish(learner)
            record = await jobs.get(job.job_id)
            accounting = await account(nats_url, redis_url, job.job_id)
    finally:
        await proxy.close()
        await jobs.close()
    text = log.read_text()
    print(f"redis cut off from the learner after step 3 for {CUT_S:.0f}s: run stopped {stopped_after_s:.1f}s after "
          f"the cut (lease {LEASE_S:.0f}s); lease holder during the cut {lease_holder!r}; "
          f"{[line.split(' ', 3)[-1] for line in text.splitlines() if 'resumed' in line or 'lease lost' in line]}; "
          f"ledger: {accounting.counts}")
    assert stopped_after_s <= LEASE_S + 5, stopped_after_s  # its deadlines, not a socket timeout
    assert during.state == JobState.RUNNING and lease_holder is None, (during, lease_holder)
    assert "Traceback" not in text and f"job {job.job_id} resumed from step" in text
    assert record.state == JobState.SUCCEEDED and record.lease_epoch == 2 and not record.reason, record
    assert_exact(accounting, run_dir, job.job_id)
