"""AdamW, the warmup-then-decay schedule, and `train_step`: one optimizer step on a list of groups.

`train_step` is the only place the learning update is written. The distributed trainer and the
single-process reference loop both call it, which is what makes their losses equal. It reads as the
single-process algorithm: a data-parallel rank (`trained_policy.Policy.step`) only says which of the
step's trainable groups it trains and how its loss is scaled (`train`, `loss_scale`).

Schedule of one step (documented choice): the batch is built once; `epochs_per_step` passes go
over it, each pass accumulating gradients over micro-batches of `micro_batch_samples` sequences (and at
most `micro_batch_tokens` padded tokens) and ending in ONE grad-norm clip and ONE optimizer.step();
the scheduler steps once per call.
`old_logprobs` are the learner's log-probs from the first pass (taken before any update of this
step), so the first pass is exactly on the learner's policy and later passes are clipped against
it. Losses are normalised by the whole batch's token/sequence counts, so the accumulated gradient
of a pass equals the gradient of the full batch in one piece. The entropy is computed only where
it is used: on the first pass (the step's metrics are the first pass's) and, when `entropy_coef`
> 0, on every pass with its gradient; the frozen reference gives log-probs only. A job with a
critic (ppo) first takes one no-grad pass for the values its token advantages and value targets
come from (`critic.gae_micro_batches`); its passes then read logits and values from one forward.

Non-finite guard: a pass whose loss or gradient norm is not finite (on any rank) applies nothing: its
gradients are zeroed, optimizer.step() is not called, the step's remaining passes are not run and the
scheduler does not step (a skipped update is not a step of the schedule). The step reports
`nonfinite_steps` 1; passes before that one (epochs_per_step > 1) stay applied. JobRun counts such
steps and fails the job after `train.max_nonfinite_steps_in_a_row` of them in a row.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec.config import JobSpec, OptimConfig
from fleetrl.train.batch import (
    TrainBatch,
    attention_cost_ratio,
    build_batch,
    completion_forward,
    completion_logprobs,
    group_advantages,
    group_rewards,
    has_signal,
    micro_batches,
    policy_of,
    policy_tokens,
    share_prompts,
    target_logprobs,
)
from fleetrl.train.critic import CRITIC_TOKEN_MEANS, ValueTargets, actor_critic_loss, gae_micro_batches
from fleetrl.train.losses import LossConfig, LossInputs, LossOutputs, policy_loss
from fleetrl.train.off_policy import SEQUENCE_MEANS as OFF_POLICY_SEQUENCE_MEANS

PAD_ID = 0
"""Id written into padding positions; attention_mask hides them, so any valid id works."""

STEP_SUMS = ("loss", "tokens", "sequences")
"""train_step metrics that are sums over the trained samples (a data-parallel step adds the ranks')."""
SEQUENCE_MEANS = ("completion_len_mean", *OFF_POLICY_SEQUENCE_MEANS)
"""train_step metrics that are means over the trained sequences."""
BATCH_METRICS = ("reward_mean", "reward_std", "groups", "groups_skipped", "lr", "grad_norm", "nonfinite_steps")
"""train_step metrics of the whole step, the same on every rank (grad_norm is taken after DDP's all-reduce;
nonfinite_steps, 1 when the update was skipped as not finite, is decided over every rank)."""
RANK_TIMINGS = ("forward_backward_s", "optimizer_s")
"""Wall-clock seconds of this rank's passes. Every other train_step metric is a mean over real
completion tokens (TOKEN_MEANS)."""
TOKEN_MEANS = ("ratio_mean", "clip_low_frac", "clip_high_frac", "clip_frac", "tis_frac", "tis_weight_mean",
               "pg_token_mean", "kl", "entropy", "mismatch_logprob_abs_diff", "mismatch_k3_kl", "offpolicy_masked_frac")
"""The token-mean metrics of losses.policy_loss that a step reports (tests/learner/test_losses.py
checks that a step with nothing to train reports the same keys as one that trained)."""


def build_optimizer(
    model: torch.nn.Module, optim_cfg: OptimConfig, critic: torch.nn.Module | None = None,
    critic_lr: float | None = None,
) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters, and the critic's (ppo) as a second parameter group
    at `critic_lr` (None: the policy's learning rate); the schedule scales both alike.

    The fused implementation (one kernel per parameter, no temporary copies of the whole state)
    where every parameter is on a CPU or CUDA device: on the demo's full fine-tuning step it took
    the optimizer from 0.25-0.55 s to about 0.1 s (2 cores, 2026-12-05)."""
    groups: list[dict[str, object]] = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if critic is not None:
        groups.append({"params": list(critic.parameters()), "lr": critic_lr or optim_cfg.learning_rate})
    devices = {p.device.type for group in groups for p in cast(list[Tensor], group["params"])}
    return torch.optim.AdamW(
        groups, lr=optim_cfg.learning_rate, betas=optim_cfg.betas, weight_decay=optim_cfg.weight_decay,
        fused=devices <= {"cpu", "cuda"},
    )


def lr_factor(step: int, optim_cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak learning rate for the optimizer step with 0-based index `step`.

    Warmup: (step + 1) / warmup_steps for the first warmup_steps steps (so step 0 already moves).
    Then the peak at step == warmup_steps, decaying (linear or cosine) to min_lr_ratio at the last
    step, max_steps - 1; `constant` stays at the peak.
    """
    warmup = optim_cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if optim_cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - 1 - warmup))
    floor = optim_cfg.min_lr_ratio
    shape = 1.0 - progress if optim_cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig, max_steps: int) -> LambdaLR:
    """LambdaLR following lr_factor; call scheduler.step() once per train_step."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, optim_cfg, max_steps))


@dataclass
class _Cached:
    """What the first pass computes per micro-batch and later passes reuse."""

    old_logprobs: list[Tensor] = field(default_factory=list)
    ref_logprobs: list[Tensor | None] = field(default_factory=list)


_NOT_MEANS = ("tokens", "sequences", "loss", "pg_loss")
"""The metrics of policy_loss that are not token or sequence means (the step reports the first three its own way)."""


@dataclass
class _Totals:
    """Token-weighted (sequence-weighted for SEQUENCE_MEANS) sums of micro-batch metrics over the first pass."""

    sums: dict[str, float] = field(default_factory=dict)
    loss: float = 0.0

    def add(self, metrics: dict[str, float], loss: float) -> None:
        self.loss += loss
        for key, value in metrics.items():
            if key not in _NOT_MEANS:
                count = metrics["sequences"] if key in SEQUENCE_MEANS else metrics["tokens"]
                self.sums[key] = self.sums.get(key, 0.0) + value * count

    def means(self, tokens: float, sequences: float) -> dict[str, float]:
        return {key: value / max(sequences if key in SEQUENCE_MEANS else tokens, 1.0)
                for key, value in self.sums.items()}


def _ref_logprobs(
    ref_model: torch.nn.Module | None, micro: TrainBatch, cfg: LossConfig, temperature: float
) -> Tensor | None:
    if ref_model is None or cfg.kl_coef == 0:
        return None
    with torch.no_grad():
        return completion_logprobs(ref_model, micro, temperature)[0]


def _sync_context(model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[object]:
    """DDP's no_sync() for every micro-batch but the last of a pass; nothing for a plain module."""
    no_sync: Callable[[], contextlib.AbstractContextManager[object]] | None = getattr(model, "no_sync", None)
    return contextlib.nullcontext() if last or no_sync is None else no_sync()


def _one_pass(
    model: torch.nn.Module,
    micros: list[TrainBatch],
    value_targets: list[ValueTargets] | None,
    cached: _Cached,
    cfg: LossConfig,
    counts: tuple[float, float],
    temperature: float,
    ref_model: torch.nn.Module | None,
    loss_scale: float,
) -> _Totals:
    """Forward/backward over every micro-batch, accumulating gradients; the first pass fills `cached`."""
    first = not cached.old_logprobs
    train_entropy = cfg.entropy_coef > 0
    totals = _Totals()
    for index, micro in enumerate(micros):
        if first:  # before the policy's forward, so its graph and the reference's pass are never alive together
            cached.ref_logprobs.append(_ref_logprobs(ref_model, micro, cfg, temperature))
        with _sync_context(model, last=index == len(micros) - 1):
            logprobs, entropy, values = _forward(model, micro, temperature, entropy=first or train_entropy,
                                                 entropy_grad=train_entropy, critic=value_targets is not None)
            if first:
                cached.old_logprobs.append(logprobs.detach())
            inputs = LossInputs(
                logprobs=logprobs,
                old_logprobs=cached.old_logprobs[index],
                behaviour_logprobs=micro.behaviour_logprobs,
                advantages=micro.advantages,
                mask=micro.completion_mask,
                ref_logprobs=cached.ref_logprobs[index],
                entropy=entropy,
                num_tokens=counts[0],
                num_sequences=counts[1],
            )
            loss = _loss(inputs, values, value_targets[index] if value_targets else None, cfg)
            (loss.loss * loss_scale).backward()
        totals.add(loss.metrics, loss.metrics["loss"])
    return totals


def _forward(
    model: torch.nn.Module, micro: TrainBatch, temperature: float, *, entropy: bool, entropy_grad: bool, critic: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(log-probs (B, T), entropy (B, T) or None, values (B, T) from the ActorCritic's head or None)."""
    if not critic:
        return (*completion_logprobs(model, micro, temperature, entropy=entropy, entropy_grad=entropy_grad), None)
    out = completion_forward(model, micro)
    logprobs, ent = target_logprobs(out, micro, temperature, entropy=entropy, entropy_grad=entropy_grad)
    return logprobs, ent, out.state_values


def _loss(inputs: LossInputs, values: Tensor | None, value_targets: ValueTargets | None,
          cfg: LossConfig) -> LossOutputs:
    """The policy loss, plus the critic's value loss on the forward's values when the job has a critic."""
    if value_targets is None or values is None:
        return policy_loss(inputs, cfg)
    return actor_critic_loss(inputs, values, value_targets, cfg)


def trainable(groups: list[common_pb2.Group], cfg: LossConfig) -> list[common_pb2.Group]:
    """The groups a step trains on: all of them, or those with reward variance when
    skip_zero_variance_groups is on. Dropped groups are not replaced by others."""
    return [group for group in groups if has_signal(group)] if cfg.skip_zero_variance_groups else list(groups)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    groups: list[common_pb2.Group],
    cfg: LossConfig,
    spec: JobSpec,
    ref_model: torch.nn.Module | None = None,
    *,
    train: list[common_pb2.Group] | None = None,
    loss_scale: float = 1.0,
) -> dict[str, float]:
    """One optimizer step on `groups` (see the module docstring for the pass/micro-batch schedule).

    Returns the step's metrics; `loss` and the token metrics are those of the first pass (the
    policy the samples were scored against). A step with no trainable group (every group skipped
    as zero-variance) applies no update and reports loss, tokens, sequences, grad_norm, the token
    metrics and the timings as 0, so every metrics line has the same keys; groups_skipped ==
    groups tells such a step apart. A step whose loss or gradient is not finite reports
    nonfinite_steps 1 and leaves the scheduler where it was (see the module docstring).

    `train` (default: every trainable group) is what this process trains, normalised by the counts
    of all the trainable groups, its loss multiplied by `loss_scale` (a data-parallel rank's share;
    see `trained_policy.Policy.step`).
    """
    rewards = torch.cat([group_rewards(group) for group in groups])
    kept = trainable(groups, cfg)
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(correction=0)),
               "groups": float(len(groups)), "groups_skipped": float(len(groups) - len(kept)),
               "lr": float(optimizer.param_groups[0]["lr"])}
    if not kept:  # no update this step, but the schedule still advances so it stays aligned with max_steps
        metrics.update(IDLE_METRICS)
        if cfg.uses_critic:
            metrics.update(dict.fromkeys(CRITIC_TOKEN_MEANS, 0.0))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of")
            scheduler.step()
        return metrics
    metrics.update(_update(model, optimizer, kept if train is None else train, cfg, spec, ref_model, _counts(kept),
                           loss_scale))
    if not metrics["nonfinite_steps"]:
        scheduler.step()
    return metrics


def _counts(groups: list[common_pb2.Group]) -> tuple[float, float]:
    """(policy tokens, sequences) of groups: the normalisers of the step's loss."""
    tokens = sum(policy_tokens(sample) for group in groups for sample in group.samples)
    return float(tokens), float(sum(len(group.samples) for group in groups))


def packing_cost_ratio(model: torch.nn.Module) -> float | None:
    """`batch.attention_cost_ratio` of the policy that `model` (train_step's module) wraps."""
    policy = policy_of(model)
    config: Any = getattr(policy, "config")  # noqa: B009  # a transformers config (untyped)
    head = config.vocab_size * config.hidden_size  # the token embedding, and the output projection
    body = sum(p.numel() for p in policy.parameters()) - head * (1 if config.tie_word_embeddings else 2)
    return attention_cost_ratio(config, body)


IDLE_METRICS = dict.fromkeys([*TOKEN_MEANS, *STEP_SUMS, *SEQUENCE_MEANS, "grad_norm", "nonfinite_steps",
                              *RANK_TIMINGS], 0.0)
"""What a step with nothing to train reports in place of `_update`'s metrics: all 0."""


def _advantaged_micro_batches(
    model: torch.nn.Module, groups: list[common_pb2.Group], cfg: LossConfig, spec: JobSpec, *, counted: bool
) -> tuple[list[TrainBatch], TrainBatch, list[ValueTargets] | None]:
    """(micro-batches with their advantages, the whole batch, the critic's value targets or None).

    Group estimators give each sequence one advantage; ppo's critic gives token-level GAE from a
    no-grad pass over the micro-batches (fleetrl/train/critic.py)."""
    device = next(model.parameters()).device  # batches are built on the CPU; the micro-batches go to the model
    advantages = group_advantages(groups, cfg) if not cfg.uses_critic else [group_rewards(g) for g in groups]
    batch = build_batch(groups, advantages, PAD_ID)
    ratio = packing_cost_ratio(model) if spec.train.share_prompts else None
    slices = micro_batches(batch, spec.train.micro_batch_samples, spec.train.micro_batch_tokens)
    micros = [share_prompts(m, ratio).to(device) for m in slices]
    if not cfg.uses_critic:
        return micros, batch, None
    micros, targets = gae_micro_batches(model, micros, cfg, counted=counted)
    return micros, batch, targets


def _update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[common_pb2.Group],
    cfg: LossConfig,
    spec: JobSpec,
    ref_model: torch.nn.Module | None,
    counts: tuple[float, float],
    loss_scale: float,
) -> dict[str, float]:
    """The epochs_per_step passes of a step; each ends with a clipped optimizer step, or, when its loss or
    gradient norm is not finite, with none and the end of the step.

    `counts`: (tokens, sequences) that normalise the loss; `loss_scale` multiplies it before backward.
    """
    micros, batch, value_targets = _advantaged_micro_batches(model, groups, cfg, spec, counted=loss_scale != 0)
    cached = _Cached()
    model.train()
    first: _Totals | None = None
    grad_norm = torch.tensor(0.0)
    finite = True
    seconds = {"forward_backward_s": 0.0, "optimizer_s": 0.0}  # wall clock; on GPU, up to the next sync
    for _ in range(spec.train.epochs_per_step):
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        totals = _one_pass(model, micros, value_targets, cached, cfg, counts, spec.rollout.temperature, ref_model,
                           loss_scale)
        first = first or totals
        between = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optim.max_grad_norm)
        seconds["forward_backward_s"] += between - started
        finite = _all_finite(totals.loss, grad_norm)
        if not finite:
            break
        optimizer.step()
        seconds["optimizer_s"] += time.perf_counter() - between
    optimizer.zero_grad(set_to_none=True)
    assert first is not None  # epochs_per_step >= 1
    return {
        **first.means(float(batch.num_tokens), float(batch.num_sequences)),
        "loss": first.loss,
        "grad_norm": float(grad_norm),
        "nonfinite_steps": float(not finite),
        "tokens": float(batch.num_tokens),
        "sequences": float(batch.num_sequences),
        "completion_len_mean": float(batch.completion_lens.float().mean()),
        **seconds,
    }


def _all_finite(loss: float, grad_norm: Tensor) -> bool:
    """Whether a pass's loss and total gradient norm are finite on every rank. The norm is the same on
    every rank (taken after DDP's all-reduce), the loss is each rank's own share's, so under DDP one
    all_reduce makes every replica take the same decision."""
    finite = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return finite
    flag = torch.tensor(int(finite), device=grad_norm.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)
