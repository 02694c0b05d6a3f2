"""Data parallelism: 2 gloo ranks on CPU give the same losses, metrics and updates as 1 rank.

Each rank is a real process (torchrun, tests/learner/ddp_rank.py) with a DDP replica; both are given the
whole batch and train their whole-group share of it, exactly as the learner's ranks do. The steps
include shares that are uneven, empty (fewer groups than ranks) and, under dapo, a batch where only one
group or none is trainable; ppo's critic and its whitened advantages match too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from ddp_rank import steps
from learner_fleet import REPO, create_job, insert_groups, learner_process, replay_service, spec_for, started

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.launcher.embedded import free_port
from fleetrl.replay.client import ReplayClient
from fleetrl.train.optim import BATCH_METRICS, RANK_TIMINGS


def test_two_ranks_match_one(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    expected = steps()
    out = tmp_path / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(Path(__file__).with_name("ddp_rank.py")), str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=180)
    got = torch.load(out)
    for job, one in expected.items():
        for step, (want, have) in enumerate(zip(one["metrics"], got[job]["metrics"], strict=True)):
            assert have.keys() == want.keys(), (job, step)
            for key in want.keys() - set(RANK_TIMINGS):
                exact = key in BATCH_METRICS and key != "grad_norm"  # computed from the whole batch on each rank
                tolerance = 0.0 if exact else 1e-5 * max(1.0, abs(want[key]))
                assert abs(have[key] - want[key]) <= tolerance, (job, step, key, have[key], want[key])
        for name, tensor in one["params"].items():
            torch.testing.assert_close(got[job]["params"][name], tensor, rtol=1e-4, atol=2e-5)  # Adam amplifies ulps
    grpo, dapo = expected["grpo_kl"]["metrics"], expected["dapo"]["metrics"]
    assert all(m["loss"] != 0.0 and m["entropy"] > 0 for m in grpo) and grpo[1]["kl"] > 0
    assert [m["groups_skipped"] for m in dapo] == [2.0, 2.0, 2.0] and dapo[1]["sequences"] == 3.0
    assert dapo[2]["tokens"] == dapo[2]["loss"] == dapo[2]["kl"] == 0.0  # nothing trainable: no update, 0s
    assert all(m["value_loss"] > 0 for m in expected["ppo"]["metrics"])
    assert expected["ppo"]["params"]["critic.weight"].abs().sum() > 0


async def test_torchrun_service_matches_one_rank(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """The whole service under `torchrun --nproc_per_node 2`: same groups and losses as 1 rank."""
    jobs = JobStore.from_url(redis_url)
    spec = spec_for(max_steps=3, checkpoint_interval=2)
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        one = await create_job(jobs, spec)
        await insert_groups(replay, one, 6)
        proc = learner_process(nats_url, redis_url, addr, run_dir, log)
        deadline = asyncio.get_running_loop().time() + 120
        while proc.poll() is None:
            assert asyncio.get_running_loop().time() < deadline, "1-rank learner did not finish"
            await asyncio.sleep(0.1)
        two = await create_job(jobs, spec)
        await insert_groups(replay, two, 6)
        env = {**os.environ, "FLEETRL_LEARNER_LEASE_S": "3", "FLEETRL_LEARNER_LISTEN": "127.0.0.1:0",
               "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5", "FLEETRL_LEARNER_TORCH_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "fleetrl.services.learner", "--once", "--nats-url", nats_url, "--redis-url",
               redis_url, "--replay-addr", addr, "--run-dir", str(run_dir)]
        ddp = started(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                       start_new_session=True))
        deadline = asyncio.get_running_loop().time() + 120
        while ddp.poll() is None:
            assert asyncio.get_running_loop().time() < deadline, "torchrun learner did not finish"
            await asyncio.sleep(0.1)
    states = [(await jobs.get(j.job_id)).state for j in (one, two)]
    await jobs.close()
    assert ddp.returncode == 0, log.read_text()[-3000:]
    assert states == [JobState.SUCCEEDED, JobState.SUCCEEDED]
    assert "rank 1 of 2 (gloo): following rank 0" in log.read_text()

    def lines(job_id: str) -> list[dict[str, float]]:
        return [json.loads(x) for x in (run_dir / "jobs" / job_id / "metrics.jsonl").read_text().splitlines()]

    a, b = lines(one.job_id), lines(two.job_id)
    assert [m["task_ids"] for m in a] == [m["task_ids"] for m in b]
    for ma, mb in zip(a, b, strict=True):
        assert abs(ma["loss"] - mb["loss"]) <= 1e-4 * max(1.0, abs(ma["loss"])), (ma["loss"], mb["loss"])
        assert (ma["tokens"], ma["sequences"]) == (mb["tokens"], mb["sequences"])
