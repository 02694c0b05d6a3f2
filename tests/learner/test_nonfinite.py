"""Non-finite guards: masked columns never reach a loss; a step with a non-finite loss or gradient
applies nothing; too many of them in a row fail the job."""

from __future__ import annotations

import asyncio
import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from learner_fleet import create_job, make_group, replay_service, spec_for
from prometheus_client import REGISTRY
from torch import Tensor

from fleetrl.jobs.store import JobState, JobStore
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.services.learner.service import serve
from fleetrl.spec.config import JobSpec
from fleetrl.tasks.feeder import task_ids_in_order
from fleetrl.train.losses import LossInputs, loss_config_for, policy_loss
from fleetrl.train.settings import LearnerSettings
from fleetrl.train.trained_policy import Policy


def refuse(constant: str) -> None:
    raise ValueError(f"metrics.jsonl holds {constant}, which is not JSON")


REAL = [1, 2, 4]
"""The real columns of the wide inputs; column 0 stands for a prompt token, 3 for an environment token,
5 for padding."""


def widen(real_BT: Tensor, fill: float) -> Tensor:
    """(B, 3) on the REAL columns of (B, 6), `fill` on the masked ones."""
    wide = torch.full((real_BT.shape[0], 6), fill)
    wide[:, REAL] = real_BT
    return wide


@pytest.mark.parametrize("masked_logprob", [-1e4, -math.inf])
@pytest.mark.parametrize(("name", "loss_agg"), [("gspo", "seq_mean_token_mean"), ("grpo", "token_mean"),
                                                 ("cispo", "token_mean"), ("dr_grpo", "seq_mean_token_sum_norm")])
def test_masked_columns_never_reach_the_loss(name: str, loss_agg: str, masked_logprob: float) -> None:
    """Masked columns whose log-probs are -1e4 or -inf (behaviour 0, as build_batch pads them) give the
    loss, gradient and metrics of the same inputs without those columns. Before, GSPO's log of the
    truncated-IS weight was log(exp(-1e4)) = -inf there, and -inf * 0 made the loss NaN."""
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(2, 3, generator=gen) * 2
    lp, beh, ref = (old + torch.randn(2, 3, generator=gen) * 0.3 for _ in range(3))
    entropy, adv = torch.rand(2, 3, generator=gen), torch.tensor([1.0, -0.5])
    spec = JobSpec(prompts="p.jsonl", reward={"builtin": "numeric_match"}, algorithm={"name": name})
    cfg = replace(loss_config_for(spec), loss_agg=loss_agg, clip_eps=0.2, clip_eps_high=0.2, kl_coef=0.1,
                  entropy_coef=0.01)
    narrow_lp, wide_lp = lp.clone().requires_grad_(True), widen(lp, masked_logprob).requires_grad_(True)
    narrow = policy_loss(LossInputs(narrow_lp, old, beh, adv, torch.ones(2, 3), ref, entropy), cfg)
    mask = widen(torch.ones(2, 3), 0.0)
    wide = policy_loss(LossInputs(wide_lp, widen(old, masked_logprob), widen(beh, 0.0), adv, mask,
                                  widen(ref, masked_logprob), widen(entropy, 0.5)), cfg)
    narrow.loss.backward()
    wide.loss.backward()
    assert wide_lp.grad is not None and narrow_lp.grad is not None
    assert math.isfinite(wide.loss.item()) and wide.loss.item() == pytest.approx(narrow.loss.item(), abs=1e-6)
    torch.testing.assert_close(wide_lp.grad[:, REAL], narrow_lp.grad, atol=1e-7, rtol=1e-6)
    assert torch.equal(wide_lp.grad[:, [0, 3, 5]], torch.zeros(2, 3))
    assert wide.metrics == pytest.approx(narrow.metrics, abs=1e-6)


def poisoned(group: common_pb2.Group) -> common_pb2.Group:
    """The group with one behaviour log-prob NaN: its truncated-IS weight, so the step's loss, is NaN."""
    group.samples[0].behaviour_logprobs[0] = math.nan
    return group


def groups_of(first: int) -> list[common_pb2.Group]:
    return [make_group("j", f"0/{i}", 0, 3) for i in range(first, first + 2)]


@pytest.mark.parametrize("plant", ["loss", "grad"])
def test_a_nonfinite_step_applies_nothing(plant: str) -> None:
    """After one good step (so AdamW has moments), a step with a NaN in its loss, or in one parameter's
    gradient, leaves the weights bit for bit, the optimizer's state and the schedule as they were; the
    next good step trains as usual."""
    policy = Policy(spec_for(max_steps=4))
    assert policy.step(groups_of(0))["nonfinite_steps"] == 0.0
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    optimizer, scheduler = copy.deepcopy(policy.optimizer.state_dict()), policy.scheduler.state_dict()
    groups = groups_of(2)
    hook = None
    if plant == "loss":
        groups[1] = poisoned(groups[1])
    else:
        hook = next(policy.model.parameters()).register_hook(lambda grad: grad * math.nan)
    skipped = policy.step(groups)
    assert skipped["nonfinite_steps"] == 1.0
    assert not math.isfinite(skipped["loss" if plant == "loss" else "grad_norm"])
    assert all(torch.equal(weights[k], v) for k, v in policy.model.state_dict().items())
    after = policy.optimizer.state_dict()
    assert after["param_groups"] == optimizer["param_groups"]
    for index, state in optimizer["state"].items():
        assert all(torch.equal(state[k], after["state"][index][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert policy.scheduler.state_dict() == scheduler
    assert all(p.grad is None for p in policy.model.parameters())
    if hook is not None:
        hook.remove()
    trained = policy.step(groups_of(4))
    assert trained["nonfinite_steps"] == 0.0 and policy.scheduler.state_dict() != scheduler
    assert any(not torch.equal(weights[k], v) for k, v in policy.model.state_dict().items())


async def test_nonfinite_steps_in_a_row_fail_the_job(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """max_nonfinite_steps_in_a_row 2: steps 1, 3 and 4 have a NaN loss, step 2 is finite. Step 2 resets
    the count, so the job fails at step 4, with the reason, through the learner's failure path; every
    step is reported with its flag and counted in the Prometheus counter."""
    jobs = JobStore.from_url(redis_url)
    record = await create_job(jobs, spec_for(max_steps=6, checkpoint_interval=10, max_nonfinite_steps_in_a_row=2))
    ids = task_ids_in_order(16, record.spec.seed, 8)
    groups = [make_group(record.job_id, t, 0, record.spec.rollout.samples_per_prompt) for t in ids]
    for index in (0, 4, 6):  # one group of each of steps 1, 3 and 4 (two groups a step, in fifo order)
        poisoned(groups[index])
    settings = LearnerSettings(nats_url=nats_url, redis_url=redis_url, run_dir=tmp_path, listen="127.0.0.1:0",
                               lease_s=3, sample_wait_s=0.5, learner_id="L1")
    async with replay_service(redis_url) as addr, ReplayClient(addr) as replay:
        await replay.configure(record.job_id, record.spec.replay)
        await replay.insert(groups)
        settings.replay_addr = addr
        await asyncio.wait_for(serve(settings, asyncio.Event(), once=True), 120)
    done = await jobs.get(record.job_id)
    await jobs.close()
    assert done.state == JobState.FAILED
    assert "NonFiniteSteps: 2 steps in a row had a non-finite loss or gradient (steps 3 to 4" in done.reason
    text = (tmp_path / "jobs" / record.job_id / "metrics.jsonl").read_text()
    lines = [json.loads(x, parse_constant=refuse) for x in text.splitlines()]  # strict JSON: no NaN or Infinity
    assert [(x["step"], x["nonfinite_steps"], x["nonfinite_steps_in_a_row"]) for x in lines] == [
        (1, 1.0, 1.0), (2, 0.0, 0.0), (3, 1.0, 1.0), (4, 1.0, 2.0)]
    assert [x["loss"] is None for x in lines] == [True, False, True, True]  # a non-finite loss is written as null
    counted = REGISTRY.get_sample_value("fleetrl_learner_nonfinite_steps_total", {"job": record.job_id})
    assert counted == 3.0
