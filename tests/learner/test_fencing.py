"""Two learners, one job: a learner SIGSTOPped past its job lease while a second takes the job over.

Learner A trains and is stopped while it writes checkpoint 4 (`checkpoint_delay_s` holds it between
writing the files and making them complete). Its lease lapses, learner B claims the job (lease epoch
2) and resumes from checkpoint 2; then A is continued. B runs under A's learner id (as a replacement
pod of a StatefulSet would), so A's own lease renewals keep succeeding on B's lease key and cannot tell
A that it lost the job (B's slow checkpoints keep that key alive until A has moved): only the fence can
stop A. Whatever A was doing, nothing of it may land: every
write it makes for the job carries epoch 1 and is refused (the unit tests of each write are in
test_jobs, test_ledger, test_replay_table and test_weights), and A's log names the refused write. A
exits cleanly (exit 0, the job not marked failed); the job succeeds; every complete checkpoint after
the takeover is B's; metrics, the job store's steps and the ledger hold each step once, and the ledger
shows nothing trained twice and nothing lost.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import redis.asyncio as aioredis
from learner_fleet import create_job, insert_groups, learner_process, replay_service, spec_for
from test_crash import finish, metrics

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.replay.client import ReplayClient
from fleetrl.tasks import bus
from fleetrl.tasks.ledger import Ledger
from fleetrl.train import checkpoint as ckpt

STEPS, PPS, LEASE_S = 6, 2, 3.0
LEARNER_ID = "learner-0"
"""A's and B's learner id: A's renewals then succeed on B's lease, and only the fence stops A."""


async def until(what: str, cond: object, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_learner_stopped_past_its_lease_is_fenced(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2, keep_checkpoints=5)
    run_dir, log_a, log_b = tmp_path / "run", tmp_path / "a.log", tmp_path / "b.log"
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        job = await create_job(jobs, spec)
        await insert_groups(replay, job, STEPS * PPS + 2)
        root = ckpt.checkpoint_root(run_dir, job.job_id)
        a = learner_process(nats_url, redis_url, addr, run_dir, log_a, FLEETRL_LEARNER_CHECKPOINT_DELAY_S="4",
                            FLEETRL_LEARNER_LEARNER_ID=LEARNER_ID)
        await until("A to claim the job", lambda: f"claimed job {job.job_id}" in log_a.read_text())
        # B starts while A trains (its start-up overlaps A's run) and polls for a job to claim: it can take
        # this one only once A's lease has lapsed. B's checkpoints (4 and 6) are slow too, so B holds the
        # lease key until well after A continues.
        b = learner_process(nats_url, redis_url, addr, run_dir, log_b, FLEETRL_LEARNER_CHECKPOINT_DELAY_S="5",
                            FLEETRL_LEARNER_LEARNER_ID=LEARNER_ID, FLEETRL_LEARNER_CLAIM_POLL_S="0.2")
        await until("A writing checkpoint 4", lambda: any(root.glob("step-00000004*.tmp/state.json")))
        a.send_signal(signal.SIGSTOP)
        assert "claimed job" not in log_b.read_text(), "B claimed the job before A was stopped"
        # A's lease lapses (LEASE_S after its last renewal), then B claims the job and resumes it
        await until("B to resume the job", lambda: f"job {job.job_id} resumed from step 2" in log_b.read_text())
        a.send_signal(signal.SIGCONT)
        await finish(a)  # exit 0: the run ended on the fence or the lost lease, not on an error
        await finish(b)
        record, steps = await jobs.get(job.job_id), await jobs.steps(job.job_id)
        redis = aioredis.Redis.from_url(redis_url)
        nc = await bus.connect(nats_url, "test")
        accounting = await Ledger(redis).account(bus.jetstream(nc), job.job_id)
        await nc.close()
        await redis.aclose()
    await jobs.close()

    text_a = log_a.read_text()
    stopped = [line for line in text_a.splitlines() if f"job {job.job_id} stopped" in line]
    print("A:", stopped, "ledger:", accounting.counts)
    assert "failed" not in text_a and "lease lost" not in text_a
    # A was stopped by the fence, refusing a write of epoch 1 (checkpoint 4, the step's metrics or commits)
    assert len(stopped) == 1 and f"job {job.job_id} stopped, fenced:" in stopped[0], stopped
    assert "refused: written under lease epoch 1" in stopped[0], stopped
    assert record.state == JobState.SUCCEEDED and record.lease_epoch == 2, record.reason
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [m["step"] for m in metrics(run_dir, job.job_id)] == list(range(1, STEPS + 1))
    for step in ckpt.complete_steps(root):
        epoch = json.loads((root / f"step-{step:08d}" / "state.json").read_text())["lease_epoch"]
        assert epoch == (1 if step <= 2 else 2), (step, epoch)
    assert accounting.counts["trained"] == STEPS * PPS
    assert accounting.counts["duplicated"] == accounting.counts["lost"] == accounting.counts["unpublished"] == 0
    trained = {step: sorted(m["task_ids"]) for step, m in enumerate(metrics(run_dir, job.job_id), start=1)}
    assert {s: sorted(t.task_id for t in accounting.tasks if s in t.steps) for s in trained} == trained
