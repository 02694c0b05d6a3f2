"""kill -9 of the learner mid-step and mid-checkpoint (real processes, tiny model).

Job A runs uninterrupted. Job B, with the same spec, seed and groups, is killed after step 3
(mid-step: checkpoint 2 is the last complete one), resumed, killed again while checkpoint 4 is
being written (a partial step-00000004.tmp exists), and resumed to the end. B must reproduce A
step for step: same groups per step, same losses, same final weights, and replay's counters must
show every group trained exactly once. A LoRA job killed mid-step ends with the same adapters as an
uninterrupted one, in its checkpoint and in its published (adapter) version.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from learner_fleet import create_job, insert_groups, learner_process, replay_service, spec_for
from safetensors.torch import load_file

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.replay.client import ReplayClient
from fleetrl.tasks import bus
from fleetrl.train import checkpoint as ckpt
from fleetrl.weights.store import WeightStore, decode_safetensors

STEPS, PPS = 6, 2
FIRST_STEPS = 3
"""Steps job B's first learner gets data for: it is killed waiting for step 4's, so the kill can never
land after step 4 and its checkpoint (a fast step once outran the test's poll)."""


def metrics(run_dir: Path, job_id: str) -> list[dict[str, Any]]:
    path = run_dir / "jobs" / job_id / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def wait_until(what: str, cond: Any, proc: subprocess.Popen[bytes], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"learner exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def finish(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, "learner did not finish"
        await asyncio.sleep(0.1)
    assert proc.returncode == 0


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def test_kill_mid_step_and_mid_checkpoint_resumes_exactly(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2, keep_checkpoints=3)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        a = await create_job(jobs, spec)
        await insert_groups(replay, a, STEPS * PPS + 2)
        await finish(learner_process(nats_url, redis_url, addr, run_dir, log))

        b = await create_job(jobs, spec)
        await insert_groups(replay, b, FIRST_STEPS * PPS)  # step 4 then waits for data: killed mid-step
        first = learner_process(nats_url, redis_url, addr, run_dir, log)
        await wait_until("step 3", lambda: len(metrics(run_dir, b.job_id)) >= FIRST_STEPS, first)
        kill(first)
        await insert_groups(replay, b, STEPS * PPS + 2, skip=FIRST_STEPS * PPS)
        root = ckpt.checkpoint_root(run_dir, b.job_id)
        assert ckpt.complete_steps(root)[-1] == 2

        second = learner_process(nats_url, redis_url, addr, run_dir, log, FLEETRL_LEARNER_CHECKPOINT_DELAY_S="30")
        await wait_until("checkpoint 4 written", lambda: any(root.glob("step-00000004*.tmp/state.json")), second)
        kill(second)
        assert ckpt.complete_steps(root)[-1] == 2  # step 4 never became complete

        await finish(learner_process(nats_url, redis_url, addr, run_dir, log))
        stats_a, stats_b = await replay.stats(a.job_id), await replay.stats(b.job_id)
    done = await jobs.get(b.job_id)
    steps_b = await jobs.steps(b.job_id)
    await jobs.close()

    assert done.state == JobState.SUCCEEDED, done.reason
    assert log.read_text().count(f"job {b.job_id} resumed from step 2") == 2
    ma, mb = metrics(run_dir, a.job_id), metrics(run_dir, b.job_id)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    assert [m["task_ids"] for m in mb] == [m["task_ids"] for m in ma]
    assert [m["loss"] for m in mb] == [m["loss"] for m in ma]
    trained = [t for m in mb for t in m["task_ids"]]
    assert len(trained) == len(set(trained)) == STEPS * PPS  # nothing skipped, nothing twice
    for stats in (stats_a, stats_b):
        assert stats.committed == STEPS * PPS and stats.size_groups == 2 and stats.leased_groups == 0
        assert stats.duplicates == 0 and stats.stale_dropped == 0
    assert [s["step"] for s in steps_b] == list(range(1, STEPS + 1))
    final_a = load_file(str(ckpt.checkpoint_root(run_dir, a.job_id) / f"step-{STEPS:08d}" / "model.safetensors"))
    final_b = load_file(str(root / f"step-{STEPS:08d}" / "model.safetensors"))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


async def test_lora_kill_mid_step_resumes_with_identical_adapters(nats_url: str, redis_url: str,
                                                                   tmp_path: Path) -> None:
    """A LoRA job killed (SIGKILL) after step 3 resumes from checkpoint 2 and ends with the adapters an
    uninterrupted run of the same spec ends with: bit-identical in the checkpoint and as published."""
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=STEPS, checkpoint_interval=2, keep_checkpoints=3, lora={"rank": 4, "alpha": 8})
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        a = await create_job(jobs, spec)
        await insert_groups(replay, a, STEPS * PPS + 2)
        await finish(learner_process(nats_url, redis_url, addr, run_dir, log))

        b = await create_job(jobs, spec)
        await insert_groups(replay, b, FIRST_STEPS * PPS)  # step 4 then waits for data: killed mid-step
        first = learner_process(nats_url, redis_url, addr, run_dir, log)
        await wait_until("step 3", lambda: len(metrics(run_dir, b.job_id)) >= FIRST_STEPS, first)
        kill(first)
        await insert_groups(replay, b, STEPS * PPS + 2, skip=FIRST_STEPS * PPS)
        assert ckpt.complete_steps(ckpt.checkpoint_root(run_dir, b.job_id))[-1] == 2
        await finish(learner_process(nats_url, redis_url, addr, run_dir, log))
    done = await jobs.get(b.job_id)
    await jobs.close()
    assert done.state == JobState.SUCCEEDED, done.reason
    assert f"job {b.job_id} resumed from step 2" in log.read_text()
    assert [m["loss"] for m in metrics(run_dir, b.job_id)] == [m["loss"] for m in metrics(run_dir, a.job_id)]
    final_a, final_b = (load_file(str(ckpt.checkpoint_root(run_dir, job.job_id) / f"step-{STEPS:08d}" /
                                      "model.safetensors")) for job in (a, b))
    assert final_a.keys() == final_b.keys() and all(".lora_" in k for k in final_a)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    nc = await bus.connect(nats_url, "crash-test")
    store = WeightStore(nc, bus.jetstream(nc))
    pointers = [await store.latest(job.job_id) for job in (a, b)]
    published = [decode_safetensors(await store.pull(job.job_id, p)) for job, p in zip((a, b), pointers, strict=True)
                 if p is not None]
    await nc.close()
    assert [(p.version, p.kind) for p in pointers if p is not None] == [(STEPS, "adapter")] * 2
    assert pointers[0].sha256 == pointers[1].sha256  # type: ignore[union-attr]
    assert all(".lora_A." in k or ".lora_B." in k for k in published[1])
