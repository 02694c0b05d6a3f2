"""A SIGKILLed gateway restarted on the same port keeps every job, and a watch survives it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.sdk.client import Client
from fleetrl.sdk.records import JobEventInfo
from tests.gateway.conftest import TOKENS, Infra


def test_sigkill_and_restart_keeps_every_job_and_watch_resumes(infra: Infra, job_dir: Path) -> None:
    proc = infra.gateway("restart").start()
    try:
        client = Client(proc.address, token=TOKENS["carol"])
        jobs = [client.submit_file(job_dir / "job.toml", [f"train.max_steps={n}"]) for n in (3, 4, 5)]
        client.cancel_job(jobs[1].job_id, "no")
        run = client.run(jobs[2].job_id)
        before = {j.job_id: (j.state, j.reason, j.spec) for j in client.list_jobs(1000)}

        events: list[JobEventInfo] = []
        watcher = threading.Thread(target=lambda: events.extend(run.events()))
        watcher.start()

        async def learn(store: JobStore, steps: range) -> None:
            await store.set_state(run.job_id, JobState.RUNNING, allowed_from=(JobState.QUEUED, JobState.RUNNING))
            for step in steps:
                await store.append_step(run.job_id, {"step": step, "reward_mean": step}, lease_epoch=0)
                await asyncio.sleep(0.05)

        infra.store(lambda s: learn(s, range(1, 3)))
        time.sleep(0.5)
        proc.kill()
        infra.store(lambda s: learn(s, range(3, 6)))  # steps while the gateway is down
        proc.start()
        infra.store(lambda s: s.set_state(run.job_id, JobState.SUCCEEDED))
        watcher.join(30)
        assert not watcher.is_alive()

        after = {j.job_id: (j.state, j.reason, j.spec) for j in client.list_jobs(1000)}
        assert {k: v for k, v in after.items() if k != run.job_id} == {
            k: v for k, v in before.items() if k != run.job_id}
        assert {j.job_id for j in jobs} <= set(after)
        assert [e.step.step for e in events if e.step] == [1, 2, 3, 4, 5]  # each once, none lost
        assert [e.state for e in events if e.state][-1] == "succeeded"
        client.close()
    finally:
        proc.stop()
