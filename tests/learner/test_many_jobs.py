"""One learner, several LoRA jobs on one base (`LearnerSettings.max_jobs`): the base held once, each job
trained exactly as it would be alone, a kill of the learner holding both resumed exactly.

Job A runs alone. Jobs B and C have A's spec, seed and groups and run together on one learner process
with max_jobs 2; it is SIGKILLed once both have trained 3 steps (checkpoint 2 is their last complete
one), and a second such learner resumes both. Each must reproduce A step for step (same losses) and end
with A's adapters bit for bit, and replay must show every group of each committed exactly once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch
from learner_fleet import create_job, insert_groups, learner_process, make_group, replay_service, spec_for
from safetensors.torch import load_file
from test_crash import FIRST_STEPS, PPS, STEPS, finish, kill, metrics, wait_until

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.policy.lora import SharedBases
from fleetrl.replay.client import ReplayClient
from fleetrl.services.learner.service import next_claim
from fleetrl.spec.config import JobSpec
from fleetrl.train import checkpoint as ckpt
from fleetrl.train.settings import LearnerSettings
from fleetrl.train.trained_policy import Policy

LORA = {"rank": 4, "alpha": 8}


def lora_spec(**train: Any) -> JobSpec:
    return spec_for(lora=LORA, **train)


async def test_a_learner_adds_only_lora_jobs_on_its_base(redis_url: str) -> None:
    """A learner that runs a LoRA job claims next only a LoRA job on the same base, passing over older
    jobs it could not share with (a full fine-tune, another base); a full fine-tune runs alone.
    On a database of its own, emptied first: a claim takes the oldest claimable job, and a learner id resumes
    the job it held, so another test's jobs on the session's Valkey would answer these claims."""
    jobs = JobStore.from_url(redis_url.rsplit("/", 1)[0] + "/9")
    await jobs.redis.flushdb()
    lora_job = await create_job(jobs, lora_spec())
    full_job = await create_job(jobs, spec_for())
    other_base = await create_job(jobs, spec_for(lora=LORA).model_copy(update={"model": "tiny-qwen2"}))
    second_lora = await create_job(jobs, lora_spec())
    settings = LearnerSettings(max_jobs=2)
    assert next_claim(settings, []) == ""
    first = await jobs.claim("L1", 30, lora_base=next_claim(settings, []) or "")
    assert first is not None and first.job_id == lora_job.job_id
    assert next_claim(settings, [first]) == "tiny-llama"
    second = await jobs.claim("L1", 30, lora_base="tiny-llama")
    assert second is not None and second.job_id == second_lora.job_id
    assert next_claim(settings, [first, second]) is None  # max_jobs reached
    assert await jobs.claim("L1", 30, lora_base="tiny-llama") is None  # none left on the base
    assert (await jobs.get(full_job.job_id)).state == JobState.QUEUED
    assert (await jobs.get(other_base.job_id)).state == JobState.QUEUED
    full = await jobs.claim("L2", 30)
    assert full is not None and full.job_id == full_job.job_id
    assert next_claim(LearnerSettings(max_jobs=4), [full]) is None  # a full fine-tune runs alone
    await jobs.close()


def test_lora_policies_share_their_base_and_train_as_each_alone() -> None:
    """Two LoRA policies from one SharedBases hold the same base tensors (one copy); a step of one changes
    neither the other's adapters nor the base, and each trains exactly as a policy on its own base."""
    spec = lora_spec()
    groups = [make_group("j", f"t{i}", 0, spec.rollout.samples_per_prompt) for i in range(2)]
    bases = SharedBases()
    first, second = Policy(spec, bases=bases), Policy(spec, bases=bases)
    alone = Policy(spec)
    assert bases.held() == {("tiny-llama", "cpu"): 2}
    shared = {n: p.data_ptr() for n, p in first.model.named_parameters() if ".lora_" not in n}
    assert shared == {n: p.data_ptr() for n, p in second.model.named_parameters() if ".lora_" not in n}
    assert shared != {n: p.data_ptr() for n, p in alone.model.named_parameters() if ".lora_" not in n}
    base_before = {n: p.detach().clone() for n, p in first.model.named_parameters() if ".lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in second.model.named_parameters() if p.requires_grad}

    losses = [first.step(groups)["loss"] for _ in range(2)]
    assert all(torch.equal(p, adapters[n]) for n, p in second.model.named_parameters() if p.requires_grad)
    assert all(torch.equal(p, base_before[n]) for n, p in first.model.named_parameters() if ".lora_" not in n)
    assert [second.step(groups)["loss"] for _ in range(2)] == losses == [alone.step(groups)["loss"] for _ in range(2)]
    trained = dict(first.model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in alone.model.named_parameters() if p.requires_grad)

    first.close()
    assert bases.held() == {("tiny-llama", "cpu"): 1}
    second.close()
    second.close()  # idempotent
    assert bases.held() == {}


async def test_two_lora_jobs_on_one_learner_train_as_each_alone_through_a_kill(
        nats_url: str, redis_url: str, tmp_path: Path) -> None:
    jobs = JobStore.from_url(redis_url)
    spec = lora_spec(max_steps=STEPS, checkpoint_interval=2, keep_checkpoints=3)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        a = await create_job(jobs, spec)
        await insert_groups(replay, a, STEPS * PPS + 2)
        await finish(learner_process(nats_url, redis_url, addr, run_dir, log))

        pair = [await create_job(jobs, spec) for _ in range(2)]
        for job in pair:
            await insert_groups(replay, job, FIRST_STEPS * PPS)  # step 4 then waits for data: killed mid-step
        first = learner_process(nats_url, redis_url, addr, run_dir, log, FLEETRL_LEARNER_MAX_JOBS="2")
        holders: set[tuple[str | None, ...]] = set()

        def both_at_step_3() -> bool:
            return all(len(metrics(run_dir, job.job_id)) >= FIRST_STEPS for job in pair)

        async def watch_holders() -> None:
            while True:
                holders.add(tuple([await jobs.lease_holder(job.job_id) for job in pair]))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_holders())
        await wait_until("both jobs at step 3", both_at_step_3, first)
        watcher.cancel()
        kill(first)
        learner_ids = {holder for seen in holders for holder in seen if holder}
        assert len(learner_ids) == 1 and any(all(seen) for seen in holders)  # one learner held both at once
        for job in pair:
            await insert_groups(replay, job, STEPS * PPS + 2, skip=FIRST_STEPS * PPS)
            assert ckpt.complete_steps(ckpt.checkpoint_root(run_dir, job.job_id))[-1] == 2
        second = learner_process(nats_url, redis_url, addr, run_dir, log, once=False, FLEETRL_LEARNER_MAX_JOBS="2")
        ends = [f"job {job.job_id} ledger" for job in pair]  # logged once the job has succeeded
        await wait_until("both jobs' ends", lambda: all(end in log.read_text() for end in ends), second, 120)
        kill(second)
        stats = [await replay.stats(job.job_id) for job in pair]
        states = [(await jobs.get(job.job_id)).state for job in pair]
    await jobs.close()
    assert states == [JobState.SUCCEEDED] * 2, states
    text = log.read_text()
    losses_a = [m["loss"] for m in metrics(run_dir, a.job_id)]
    final_a = load_file(str(ckpt.checkpoint_root(run_dir, a.job_id) / f"step-{STEPS:08d}" / "model.safetensors"))
    for job, stat in zip(pair, stats, strict=True):
        assert f"job {job.job_id} resumed from step 2" in text
        lines = metrics(run_dir, job.job_id)
        assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
        assert [m["loss"] for m in lines] == losses_a
        final = load_file(str(ckpt.checkpoint_root(run_dir, job.job_id) / f"step-{STEPS:08d}" / "model.safetensors"))
        assert final.keys() == final_a.keys() and all(torch.equal(final[k], final_a[k]) for k in final)
        assert stat.committed == STEPS * PPS and stat.leased_groups == 0  # each group trained once
        trained = [t for m in lines for t in m["task_ids"]]
        assert len(trained) == len(set(trained)) == STEPS * PPS
    print(json.dumps({"holders_seen": sorted(map(str, holders))}))
