"""One rank of test_ddp's train-step check, run under torchrun: `ddp_rank.py OUT_PATH`."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from learner_fleet import make_group, spec_for

from services.learner.policy import Policy
from services.proto.fleetrl.v1 import common_pb2

SPEC = dict(max_steps=2, micro_batch_samples=2, epochs_per_step=2)


def batch() -> list[common_pb2.Group]:
    return [make_group("j", f"0/{i}", 0, 3, seed=5) for i in range(5)]  # 5 groups: uneven shares


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    policy = Policy(spec_for(**SPEC))
    metrics = policy.step(batch())
    if dist.get_rank() == 0:
        params = {k: v.clone() for k, v in policy.model.state_dict().items()}
        torch.save({"loss": metrics["loss"], "params": params}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
