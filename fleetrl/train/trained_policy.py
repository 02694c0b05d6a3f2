"""The trained policy of one job: model, optimizer, scheduler, and their checkpointed state.

`Policy.step(groups)` is one call of `optim.train_step` (the only place the update is written).
Data parallelism (torch.distributed, gloo on CPU, NCCL on GPU): every rank holds a DDP-wrapped
replica and is given the whole step's groups; `Policy.step` has `train_step` train the rank's
whole-group share normalised by the whole batch's token and sequence counts, so the summed gradient
equals the one-rank gradient (see `Policy.step` for empty shares). `reduce_over_ranks` then makes the step's
metrics those of one rank on the whole batch: sums added, token and sequence means weighted by
each rank's tokens and sequences. Under torchrun only rank 0 runs the service; it drives
the other ranks through `Followers` (one `broadcast_object_list` per command: the job's spec,
the checkpoint to restore, each step's serialised groups), and `follow()` is their whole loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from peft import PeftModel
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.errors import FailedPrecondition
from fleetrl.policy import lora, models
from fleetrl.policy.lora import SharedBases
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec.config import JobSpec
from fleetrl.train import checkpoint as ckpt
from fleetrl.train.critic import with_critic
from fleetrl.train.losses import LossConfig, loss_config_for
from fleetrl.train.optim import (
    BATCH_METRICS,
    RANK_TIMINGS,
    SEQUENCE_MEANS,
    STEP_SUMS,
    build_optimizer,
    build_scheduler,
    train_step,
    trainable,
)


def checkpoint_activations(model: PreTrainedModel) -> None:
    """`train.activation_checkpointing`: each decoder layer's activations recomputed in the backward
    (non-reentrant checkpointing: it needs no input that requires grad, so it works under LoRA's
    frozen embedding and in DDP)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def reduce_over_ranks(metrics: dict[str, float], device: str) -> dict[str, float]:
    """One rank's train_step metrics -> the whole step's, on every rank (one all_reduce on `device`:
    NCCL reduces only CUDA tensors).

    Sums are added; sequence and token means are weighted by each rank's sequences and tokens;
    batch metrics are already the whole step's; timings stay this rank's. Every rank took the same
    branch of train_step on the same groups, so every rank holds the same keys."""
    names = sorted(k for k in metrics if k not in (*BATCH_METRICS, *RANK_TIMINGS))
    weights = {k: _weight_name(k) for k in names}
    weighted = torch.tensor([metrics[k] * (metrics[w] if w else 1.0) for k, w in weights.items()],
                            dtype=torch.float64, device=device)
    dist.all_reduce(weighted)
    totals = dict(zip(names, weighted.tolist(), strict=True))
    return {**metrics, **{k: totals[k] / (max(totals[w], 1.0) if w else 1.0) for k, w in weights.items()}}


def _weight_name(metric: str) -> str | None:
    """The count a metric is a mean over (None: a sum)."""
    if metric in STEP_SUMS:
        return None
    return "sequences" if metric in SEQUENCE_MEANS else "tokens"


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
    """Model + optimizer + scheduler (+ frozen reference, + critic) of a job, on one rank."""

    spec: JobSpec
    model: PreTrainedModel | PeftModel
    """The policy: what is published (merged, for a LoRA job's base wrapped with its adapters), exported
    and checkpointed."""
    tokenizer: PreTrainedTokenizerBase
    critic: torch.nn.Linear | None
    """ppo's value head (fleetrl/train/critic.py), never published; None without a critic."""
    module: torch.nn.Module
    """What train_step drives: the model (or, with a critic, an ActorCritic of both), or its DDP wrapper."""
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_cfg: LossConfig
    device: str
    rank: int
    world: int
    followers: Followers | None
    _bases: SharedBases | None
    """Where this LoRA job's base is shared from (given back by `close`); None: the policy owns its model."""

    def __init__(self, spec: JobSpec, device: str = "cpu", followers: Followers | None = None,
                 bases: SharedBases | None = None) -> None:
        """`bases`: where a LoRA job takes its base (held once by the learner for all its jobs on it); a
        full fine-tune, or a job without them, loads its own copy."""
        self.spec = spec
        self.device = device
        self.followers = followers
        if followers is not None:
            followers.send("job", spec.model_dump_json(), device)
        self._bases = bases if spec.train.lora is not None and followers is None else None
        base, self.tokenizer = (self._bases.take(spec.model, device) if self._bases is not None
                                else models.load(spec.model, device=device))
        try:
            self._build(base, spec, device)
        except BaseException:
            self.close()
            raise

    def _build(self, base: PreTrainedModel, spec: JobSpec, device: str) -> None:
        """Everything around the loaded base: adapters, reference, critic, DDP, optimizer, scheduler."""
        self.model, self.ref_model = base, None
        if spec.train.activation_checkpointing:
            checkpoint_activations(base)
        if spec.train.lora is not None:
            self.model = lora.wrap(base, spec.train.lora, spec.seed)
            if spec.algorithm.kl_coef > 0:
                self.ref_model = lora.FrozenBase(self.model)  # the base itself: no second copy
        elif spec.algorithm.kl_coef > 0:
            self.ref_model, _ = models.load(spec.model, device=device)
            self.ref_model.requires_grad_(False)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.loss_cfg = loss_config_for(spec)
        # JobSpec refuses a critic with LoRA, so only a plain model meets a critic here
        self.module, self.critic = with_critic(cast(PreTrainedModel, self.model), self.loss_cfg)
        if self.world > 1:
            device_ids = None if device == "cpu" else [torch.cuda.current_device()]
            self.module = DistributedDataParallel(self.module, device_ids=device_ids)
        self.optimizer = build_optimizer(self.model, spec.optim, self.critic, spec.algorithm.value_learning_rate)
        self.scheduler = build_scheduler(self.optimizer, spec.optim, spec.train.max_steps)

    def close(self) -> None:
        """Give a shared base back (the learner drops it with its last job); idempotent."""
        if self._bases is not None:
            self._bases.give_back(self.spec.model, self.device)
            self._bases = None

    def step(self, groups: list[common_pb2.Group]) -> dict[str, float]:
        """One optimizer step on the whole step's groups (each rank is given all of them)."""
        if self.followers is not None:
            self.followers.send("step", [g.SerializeToString() for g in groups])
        if self.world == 1:
            return train_step(self.module, self.optimizer, self.scheduler, groups, self.loss_cfg, self.spec,
                              self.ref_model)
        return reduce_over_ranks(self._rank_step(groups), self.device)

    def _rank_step(self, groups: list[common_pb2.Group]) -> dict[str, float]:
        """This rank's part of a data-parallel step (`module` a DDP replica).

        Every rank is given the whole step's groups, so every rank derives the same trainable groups
        and the same decision to step or not, with no collective. Rank r trains trainable[r::world],
        its loss scaled by `world` because DDP averages gradients over ranks while the loss wants
        their sum. A rank whose share is empty (fewer trainable groups than ranks) runs the same
        passes on trainable[0] with its loss scaled by 0, so it makes the same DDP collectives and
        adds nothing to the gradient; its loss, tokens and sequences are reported as 0, so the sums
        and weighted means over ranks (`reduce_over_ranks`) count each trainable group once."""
        kept = trainable(groups, self.loss_cfg)
        share = kept[self.rank::self.world]
        metrics = train_step(self.module, self.optimizer, self.scheduler, groups, self.loss_cfg, self.spec,
                             self.ref_model, train=share or kept[:1], loss_scale=float(self.world) if share else 0.0)
        if kept and not share:
            metrics.update(loss=0.0, tokens=0.0, sequences=0.0)
        return metrics

    def state(self, step: int, extra: dict[str, object]) -> ckpt.Checkpoint:
        """A LoRA job's checkpoint holds the adapters (the base is reloaded from the model name)."""
        weights = (lora.adapter_state_dict(self.model) if isinstance(self.model, PeftModel)
                   else models.state_dict_for_publish(self.model, torch.float32))
        return ckpt.Checkpoint(
            step=step, model=weights,
            optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(), rng=ckpt.rng_state(),
            state=dict(extra), critic=None if self.critic is None else models.state_dict_for_publish(
                self.critic, torch.float32),
        )

    def restore(self, saved: ckpt.Checkpoint, root: Path | None = None) -> None:
        """Load a checkpoint (followers load the same one from `root`, a shared filesystem)."""
        if self.followers is not None:
            self.followers.send("restore", str(root), saved.step)
        if self.critic is not None and saved.critic is None:
            raise FailedPrecondition(
                f"checkpoint step {saved.step} has no critic: the job was started when algorithm.name='ppo' "
                "meant the RLOO-baseline variant without one, now called 'ppo_rloo'; resubmit it with "
                "algorithm.name = \"ppo_rloo\" (or as a new ppo job)")
        if isinstance(self.model, PeftModel):
            lora.load_adapters(self.model, saved.model)
        else:
            models.load_state_dict_inplace(self.model, saved.model)
        if self.critic is not None and saved.critic is not None:
            models.load_state_dict_inplace(self.critic, saved.critic)
        self.optimizer.load_state_dict(saved.optimizer)
        self.scheduler.load_state_dict(saved.scheduler)
        ckpt.set_rng_state(saved.rng)


    def exportable(self) -> PreTrainedModel:
        """The model to export as an HF directory: a LoRA job's merged into a fresh base copy."""
        if isinstance(self.model, PeftModel):
            return lora.merged_model(self.model, self.spec.model)
        return self.model


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
