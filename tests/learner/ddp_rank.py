"""One rank of test_ddp's train-step checks, run under torchrun: `ddp_rank.py OUT_PATH`.

`steps()` runs the same steps through a `Policy` in whichever process calls it: here under
torchrun (each rank trains its share), in test_ddp as the 1-rank baseline.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

import torch
import torch.distributed as dist
from learner_fleet import flat, make_group, spec_for

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.train.trained_policy import Policy

SPEC = dict(max_steps=4, micro_batch_samples=2, epochs_per_step=2)
GRPO_KL = dict(**SPEC, algorithm={"name": "grpo", "kl_coef": 0.05})
DAPO = dict(**SPEC, algorithm={"name": "dapo"})
PPO = dict(**SPEC, algorithm={"name": "ppo"})
"""ppo whitens its token advantages over the whole step: the ranks all-reduce the statistics."""


def group(index: int) -> common_pb2.Group:
    return make_group("j", f"0/{index}", 0, 3, seed=5)


def grpo_steps() -> list[list[common_pb2.Group]]:
    """5 groups (uneven shares), 5 more (the reference's KL is non-zero once the policy moved), then
    1 group: fewer groups than ranks, so rank 1's share is empty."""
    return [[group(i) for i in range(5)], [group(i) for i in range(5, 10)], [group(10)]]


def dapo_steps() -> list[list[common_pb2.Group]]:
    """Zero-variance groups dapo skips: every other one (a share of only skipped groups, had ranks
    been given every other group), all but one (one trainable group for two ranks), all of them."""
    return [[group(0), flat(group(1)), group(2), flat(group(3))],
            [group(4), flat(group(5)), flat(group(6))],
            [flat(group(7)), flat(group(8))]]


def steps() -> dict[str, Any]:
    """Each job's per-step metrics and final parameters."""
    out: dict[str, Any] = {}
    for name, spec, batches in (("grpo_kl", GRPO_KL, grpo_steps()), ("dapo", DAPO, dapo_steps()),
                                ("ppo", PPO, grpo_steps())):
        policy = Policy(spec_for(**spec))
        metrics = [policy.step(batch) for batch in batches]
        critic = policy.critic.state_dict() if policy.critic is not None else {}
        params = {**policy.model.state_dict(), **{f"critic.{k}": v for k, v in critic.items()}}
        out[name] = {"metrics": metrics, "params": {k: v.clone() for k, v in params.items()}}
    return out


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a mismatch fails, not hangs
    result = steps()
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
