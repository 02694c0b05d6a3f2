"""Tinker's built-in loss functions, by the names the SDK sends (`cross_entropy`, `importance_sampling`, `ppo`).

Every one is a sum over the datums' tokens, as in Tinker: no normaliser, so the caller's weights or
advantages set the scale and chunks of one `forward_backward` add up to the whole batch's gradient.
With `logprobs_t` the training policy's log-prob of `target_tokens[t]` after `model_input[:t+1]`:

    cross_entropy        loss = -sum_t weights_t * logprobs_t
    importance_sampling  loss = -sum_t r_t * advantages_t,                         r_t = exp(logprobs_t - q_t)
    ppo                  loss = -sum_t min(r_t * A_t, clip(r_t, low, high) * A_t)   (low 0.8, high 1.2)

where q_t are the sampler's log-probs (`loss_fn_inputs["logprobs"]`). The two policy-gradient losses
are fleetrl's own surrogates (`fleetrl.train.losses.policy_loss`, the `importance_sampling` and `clip`
surrogates summed with `token_sum`), so the learner and the Tinker API share one implementation.

Design choice: a loss is a `TinkerLoss` record in `LOSSES` (its required and optional inputs, the
settings it takes, and its function), so a new built-in loss is one entry, and the service checks a
request's inputs against the record before any compute runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from fleetrl.train.losses import LossConfig, LossInputs, policy_loss


@dataclass(frozen=True)
class LossBatch:
    """The per-token tensors of one forward_backward chunk, padded to (B, T)."""

    logprobs: Tensor  # (B, T) the training policy's log-probs of the targets, differentiable
    mask: Tensor  # (B, T) 1 on each datum's real positions
    inputs: dict[str, Tensor]  # loss_fn_inputs other than target_tokens, float32 (B, T), 0 on padding


@dataclass(frozen=True)
class TinkerLoss:
    """One built-in loss: what it reads and how it is computed."""

    name: str
    required: tuple[str, ...]
    """loss_fn_inputs keys besides target_tokens that a datum must carry."""
    optional: tuple[str, ...]
    settings: Mapping[str, float]
    """loss_fn_config keys it accepts, with their defaults."""
    fn: Callable[[LossBatch, Mapping[str, float]], tuple[Tensor, dict[str, float]]]
    """(batch, settings) -> (scalar loss, metrics named `<name>:<reduction>`)."""


def _cross_entropy(batch: LossBatch, settings: Mapping[str, float]) -> tuple[Tensor, dict[str, float]]:
    weights = batch.inputs.get("weights", batch.mask)
    loss = -torch.where(batch.mask > 0, batch.logprobs * weights, 0.0).sum()
    return loss, {"loss:sum": float(loss.detach())}


def _policy_gradient(surrogate: str) -> Callable[[LossBatch, Mapping[str, float]], tuple[Tensor, dict[str, float]]]:
    def fn(batch: LossBatch, settings: Mapping[str, float]) -> tuple[Tensor, dict[str, float]]:
        sampler = batch.inputs["logprobs"]
        low = settings.get("clip_low_threshold", 0.8)
        high = settings.get("clip_high_threshold", 1.2)
        cfg = LossConfig(clip_eps=1.0 - low, clip_eps_high=high - 1.0, loss_agg="token_sum", kl_coef=0.0,
                         kl_estimator="k1", entropy_coef=0.0, tis_cap=math.inf, max_new_tokens=1,
                         advantage="grpo", skip_zero_variance_groups=False, surrogate=surrogate)
        out = policy_loss(LossInputs(logprobs=batch.logprobs, old_logprobs=sampler, behaviour_logprobs=sampler,
                                     advantages=batch.inputs["advantages"], mask=batch.mask), cfg)
        metrics = {"loss:sum": out.metrics["loss"], "ratio:mean": out.metrics["ratio_mean"]}
        if surrogate == "clip":
            metrics["clip_frac:mean"] = out.metrics["clip_frac"]
        return out.loss, metrics

    return fn


LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": TinkerLoss("cross_entropy", (), ("weights",), {}, _cross_entropy),
    "importance_sampling": TinkerLoss("importance_sampling", ("logprobs", "advantages"), (), {},
                                      _policy_gradient("importance_sampling")),
    "ppo": TinkerLoss("ppo", ("logprobs", "advantages"), (),
                      {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, _policy_gradient("clip")),
}
"""The built-in losses fleetrl serves, by the SDK's `loss_fn` name."""
