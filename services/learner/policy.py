"""The trained policy of one job: model, optimizer, scheduler, and their checkpointed state.

`Policy.step(groups)` is one call of `optim.train_step` (the only place the update is written).
Data parallelism (torch.distributed, gloo on CPU, NCCL on GPU): every rank holds a DDP-wrapped
replica; `step` gives each rank a whole-group share of the batch (`shard`) and passes the whole
batch's token and sequence counts, so the summed gradient equals the one-rank gradient and the
all-reduced loss equals the one-rank loss. Under torchrun only rank 0 runs the service; it drives
the other ranks through `Followers` (one `broadcast_object_list` per command: the job's spec,
the checkpoint to restore, each step's serialised groups), and `follow()` is their whole loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from services.common import models
from services.common.config import JobSpec
from services.learner import checkpoint as ckpt
from services.learner.batch import has_signal
from services.learner.losses import LossConfig, loss_config_for
from services.learner.optim import build_optimizer, build_scheduler, train_step
from services.proto.fleetrl.v1 import common_pb2

SUMMED_METRICS = ("loss", "tokens", "sequences")
"""Step metrics summed over ranks; the other metrics (means) are rank 0's share of the batch."""


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def shard(groups: list[common_pb2.Group], rank: int, world: int) -> list[common_pb2.Group]:
    """Rank's share: groups rank, rank + world, ... (groups stay whole for their advantages)."""
    return groups[rank::world]


def global_counts(groups: list[common_pb2.Group], cfg: LossConfig) -> tuple[float, float]:
    """(completion tokens, sequences) of the groups train_step will train on."""
    kept = [g for g in groups if has_signal(g)] if cfg.skip_zero_variance_groups else groups
    tokens = sum(len(s.completion_token_ids) for g in kept for s in g.samples)
    return float(tokens), float(sum(len(g.samples) for g in kept))


class Followers:
    """Rank 0's side of the command channel to the other ranks."""

    @staticmethod
    def if_distributed() -> Followers | None:
        return Followers() if dist.is_initialized() and dist.get_world_size() > 1 else None

    def send(self, *command: Any) -> None:
        dist.broadcast_object_list([command], src=0)


def receive() -> tuple[Any, ...]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return tuple(box[0])


class Policy:
    """Model + optimizer + scheduler (+ frozen reference) of a job, on one rank."""

    spec: JobSpec
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    module: torch.nn.Module
    """What train_step drives: the model, or its DDP wrapper."""
    ref_model: PreTrainedModel | None
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_cfg: LossConfig
    rank: int
    world: int
    followers: Followers | None

    def __init__(self, spec: JobSpec, device: str = "cpu", followers: Followers | None = None) -> None:
        self.spec = spec
        self.followers = followers
        if followers is not None:
            followers.send("job", spec.model_dump_json(), device)
        self.model, self.tokenizer = models.load(spec.model, device=device)
        self.ref_model = None
        if spec.algorithm.kl_coef > 0:
            self.ref_model, _ = models.load(spec.model, device=device)
            self.ref_model.requires_grad_(False)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.module = self.model
        if self.world > 1:
            self.module = DistributedDataParallel(self.model, device_ids=None if device == "cpu" else [self.rank])
        self.optimizer = build_optimizer(self.model, spec.optim)
        self.scheduler = build_scheduler(self.optimizer, spec.optim, spec.train.max_steps)
        self.loss_cfg = loss_config_for(spec)

    def step(self, groups: list[common_pb2.Group]) -> dict[str, float]:
        """One optimizer step on the whole step's groups (each rank is given all of them)."""
        if self.followers is not None:
            self.followers.send("step", [g.SerializeToString() for g in groups])
        if self.world == 1:
            return train_step(self.module, self.optimizer, self.scheduler, groups, self.loss_cfg, self.spec,
                              self.ref_model)
        metrics = train_step(
            self.module, self.optimizer, self.scheduler, shard(groups, self.rank, self.world), self.loss_cfg,
            self.spec, self.ref_model, global_counts=global_counts(groups, self.loss_cfg), loss_scale=self.world,
        )
        sums = torch.tensor([metrics.get(k, 0.0) for k in SUMMED_METRICS], dtype=torch.float64)
        dist.all_reduce(sums)  # each rank's loss is its share of the whole-batch normalised sum
        metrics.update(zip(SUMMED_METRICS, sums.tolist(), strict=True))
        return metrics

    def state(self, step: int, extra: dict[str, object]) -> ckpt.Checkpoint:
        return ckpt.Checkpoint(
            step=step, model=models.state_dict_for_publish(self.model, torch.float32),
            optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(), rng=ckpt.rng_state(),
            state=dict(extra),
        )

    def restore(self, saved: ckpt.Checkpoint, root: Path | None = None) -> None:
        """Load a checkpoint (followers load the same one from `root`, a shared filesystem)."""
        if self.followers is not None:
            self.followers.send("restore", str(root), saved.step)
        models.load_state_dict_inplace(self.model, saved.model)
        self.optimizer.load_state_dict(saved.optimizer)
        self.scheduler.load_state_dict(saved.scheduler)
        ckpt.set_rng_state(saved.rng)


def follow() -> None:
    """The loop of a rank other than 0: do what rank 0's Policy does, until it says exit."""
    policy: Policy | None = None
    while True:
        command = receive()
        if command[0] == "exit":
            return
        if command[0] == "job":
            policy = Policy(JobSpec.model_validate_json(command[1]), command[2])
        elif command[0] == "restore" and policy is not None:
            policy.restore(ckpt.load(Path(command[1]), int(command[2])))
        elif command[0] == "step" and policy is not None:
            policy.step([common_pb2.Group.FromString(raw) for raw in command[1]])
