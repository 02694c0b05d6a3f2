"""RL objectives as pure functions of tensors: advantages, KL estimators, the policy-gradient surrogates.

Design choice (prime-rl's trainer/rl/loss.py): `policy_loss(inputs, cfg) -> LossOutputs` holds no
trainer state, and every variant is picked from a registry by name (`ADVANTAGES`, `SURROGATES`,
`KL_ESTIMATORS`, `LOSS_AGGREGATIONS`) instead of an if-ladder in the trainer. The loss is

    w_t     = min(exp(old_logprobs_t - behaviour_logprobs_t), tis_cap)          (detached)
    loss_t  = pg_t(w) + kl_coef * KL_t(policy || ref) - entropy_coef * H_t,     0 on dropped tokens

with w_t and the dropped tokens those of `cfg.off_policy` (fleetrl/train/off_policy.py: the truncated
IS above by default, or a token, sequence, geometric-mean or IcePop mask), the surrogate pg_t of
`cfg.surrogate` (r_t = exp(logprobs_t - old_logprobs_t), clip(x) =
clamp(x, 1 - clip_eps, 1 + clip_eps_high), sg = stop-gradient):

    clip   (PPO/GRPO)  pg_t = -w_t * min(r_t * A, clip(r_t) * A)
    gspo   (GSPO)      s_i = exp(mean_t log r_t) over sequence i's tokens, w_i the geometric mean of its w_t,
                       pg_t = -w_i * min(s_i * A_i, clip(s_i) * A_i) on every token of sequence i
    cispo  (CISPO)     pg_t = -w_t * sg(clip(r_t)) * A * logprobs_t
    importance_sampling  pg_t = -w_t * r_t * A          (no clip: Tinker's `importance_sampling` loss)
    nll    (sft)       pg_t = -logprobs_t                  (supervised: the tokens are demonstrations, so no
                                                           advantage, ratio or IS weight enters)

aggregated over real completion tokens by `loss_agg`. A is one advantage per sequence from its
group's rewards (`ADVANTAGES`), or, for ppo (`advantage == GAE`), per token from the critic's GAE
(fleetrl/train/critic.py, which adds the value loss). Normalisers take the WHOLE step batch's
token and sequence counts when `LossInputs.num_tokens` / `num_sequences` are given, so summing
the gradients of micro-batches gives exactly the full-batch gradient.

Masked columns (prompt, padding, environment tokens) are taken out with `torch.where` before any
exp, log or sum, never multiplied by the mask (`_on_real`): their log-probs may be -1e4 or -inf, and
0 * inf is NaN, in the loss and in its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from fleetrl.spec.config import JobSpec
from fleetrl.train.off_policy import OFF_POLICY, Correction, mismatch_metrics

GRPO_STD_EPS = 1e-6
"""Added to the group's reward std in GRPO advantages, so a constant group gives 0, not NaN."""


@dataclass(frozen=True)
class LossConfig:
    """Resolved objective of a job: JobSpec.algorithm with the preset of its `name` applied."""

    clip_eps: float
    clip_eps_high: float
    loss_agg: str
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    tis_cap: float
    max_new_tokens: int
    """Dr. GRPO's constant length normaliser: rollout.max_new_tokens, or environment.max_total_tokens
    for a job with an environment (a bound on an episode's policy tokens)."""
    advantage: str
    skip_zero_variance_groups: bool
    surrogate: str = "clip"
    gamma: float = 1.0
    lam: float = 1.0
    value_coef: float = 0.0
    value_clip_eps: float | None = None
    normalize_advantages: bool = False
    off_policy: str = "tis"
    """The actor/learner mismatch correction, by fleetrl/train/off_policy.py's OFF_POLICY name."""
    off_policy_band: tuple[float, float] = (0.0, math.inf)
    """[low, high] of a masking off_policy method (unused by tis, which truncates at tis_cap)."""

    @property
    def uses_critic(self) -> bool:
        """True when advantages are GAE from a learned critic (fleetrl/train/critic.py)."""
        return self.advantage == GAE


GAE = "gae"
"""LossConfig.advantage of ppo: token-level GAE from the critic, not a group estimator of ADVANTAGES."""


@dataclass(frozen=True)
class _Preset:
    advantage: str
    loss_agg: str
    clip_eps_high: float | None  # None: same as clip_eps
    skip_zero_variance_groups: bool
    surrogate: str = "clip"
    clip_eps: float = 0.2


PRESETS: dict[str, _Preset] = {
    "grpo": _Preset("grpo", "seq_mean_token_mean", None, False),
    "dr_grpo": _Preset("dr_grpo", "seq_mean_token_sum_norm", None, False),
    "dapo": _Preset("grpo", "token_mean", 0.28, True),
    "ppo": _Preset(GAE, "token_mean", None, False),
    "ppo_rloo": _Preset("rloo", "token_mean", None, False),
    # GSPO paper (arXiv 2507.18071): sequence ratios stay near 1, so the clip range is 3e-4 / 4e-4
    "gspo": _Preset("grpo", "seq_mean_token_mean", 4e-4, False, surrogate="gspo", clip_eps=3e-4),
    # MiniMax-M1 (arXiv 2506.13585) clips only the upper side of the detached weight
    "cispo": _Preset("grpo", "token_mean", 4.0, False, surrogate="cispo", clip_eps=1.0),
    # supervised fine-tuning: the mean negative log-likelihood of the step's assistant tokens
    "sft": _Preset("grpo", "token_mean", None, False, surrogate="nll"),
}
"""Defaults per algorithm name for the fields a JobSpec leaves as None."""


def loss_config_for(spec: JobSpec) -> LossConfig:
    """The LossConfig of a job: explicit fields win, None fields take the algorithm's preset."""
    algo = spec.algorithm
    preset = PRESETS[algo.name]
    low = algo.clip_eps if algo.clip_eps is not None else preset.clip_eps
    high = algo.clip_eps_high if algo.clip_eps_high is not None else preset.clip_eps_high
    return LossConfig(
        surrogate=preset.surrogate,
        clip_eps=low,
        clip_eps_high=high if high is not None else low,
        loss_agg=algo.loss_agg or preset.loss_agg,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
        tis_cap=algo.tis_cap,
        max_new_tokens=spec.environment.max_total_tokens if spec.environment else spec.rollout.max_new_tokens,
        advantage=algo.advantage or preset.advantage,
        skip_zero_variance_groups=algo.skip_zero_variance_groups or preset.skip_zero_variance_groups,
        gamma=algo.gamma,
        lam=algo.lam,
        value_coef=algo.value_coef,
        value_clip_eps=algo.value_clip_eps,
        normalize_advantages=algo.normalize_advantages,
        off_policy=algo.off_policy.method,
        off_policy_band=algo.off_policy.band(),
    )


# --------------------------------------------------------------------------- advantages


def _grpo_advantages(rewards_G: Tensor) -> Tensor:
    """(r - mean) / (std + eps), std with Bessel's correction (as TRL and verl); G = 1 gives 0."""
    centred = rewards_G - rewards_G.mean()
    if rewards_G.numel() < 2:
        return centred
    return centred / (rewards_G.std() + GRPO_STD_EPS)


def _dr_grpo_advantages(rewards_G: Tensor) -> Tensor:
    """r - mean: Dr. GRPO drops the std division, which over-weights near-constant groups."""
    return rewards_G - rewards_G.mean()


def _rloo_advantages(rewards_G: Tensor) -> Tensor:
    """r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean); G = 1 gives 0."""
    size = rewards_G.numel()
    centred = rewards_G - rewards_G.mean()
    return centred * (size / (size - 1)) if size > 1 else centred


ADVANTAGES: dict[str, Callable[[Tensor], Tensor]] = {
    "grpo": _grpo_advantages,
    "dr_grpo": _dr_grpo_advantages,
    "rloo": _rloo_advantages,
}
"""Group advantage estimators by AlgorithmConfig.advantage name: rewards (G,) -> advantages (G,)."""


def compute_group_advantages(rewards_G: Tensor, kind: str) -> Tensor:
    """Advantages (G,) of one group's rewards (G,) by estimator name (see ADVANTAGES)."""
    return ADVANTAGES[kind](rewards_G.to(torch.float32))


# --------------------------------------------------------------------------- KL


def _kl_k1(log_ratio: Tensor) -> Tensor:
    return -log_ratio


def _kl_k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _kl_k3(log_ratio: Tensor) -> Tensor:
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}
"""Schulman's estimators of KL(policy || ref) from log r = ref_logprobs - logprobs of sampled tokens."""


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL(policy || ref) estimate (B, T): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    return KL_ESTIMATORS[estimator](ref_logprobs - logprobs)


# --------------------------------------------------------------------------- aggregation


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch (B sequences, T completion positions)."""

    logprobs: Tensor  # (B, T) current policy, requires grad
    old_logprobs: Tensor  # (B, T) learner's policy at the start of the step, detached
    behaviour_logprobs: Tensor  # (B, T) the actor's policy that sampled the tokens
    advantages: Tensor  # (B,) or (B, T)
    mask: Tensor  # (B, T) 1 for real completion tokens
    ref_logprobs: Tensor | None = None  # (B, T) frozen reference, for the KL term
    entropy: Tensor | None = None  # (B, T) per-token entropy of the current policy
    num_tokens: float | None = None  # real tokens in the whole step batch (None: this micro-batch's)
    num_sequences: float | None = None  # sequences in the whole step batch (None: this micro-batch's)


@dataclass
class LossOutputs:
    """The scalar to backpropagate and micro-batch metrics (token means over real tokens)."""

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _on_real(values_BT: Tensor, mask: Tensor) -> Tensor:
    """values_BT on the real tokens of mask (B, T), 0 on the others: a select, so a masked column's
    inf or NaN reaches neither the result nor, when the select comes before an exp or a log, its gradient."""
    return torch.where(mask > 0, values_BT, 0.0)


def _token_mean(loss_BT: Tensor, inputs: LossInputs, cfg: LossConfig) -> Tensor:
    """Sum over every real token of the step, divided by the step's token count (DAPO)."""
    num_tokens = inputs.num_tokens if inputs.num_tokens is not None else inputs.mask.sum().clamp(min=1)
    return _on_real(loss_BT, inputs.mask).sum() / num_tokens


def _seq_mean_token_mean(loss_BT: Tensor, inputs: LossInputs, cfg: LossConfig) -> Tensor:
    """Mean over each sequence's tokens, then mean over the step's sequences (GRPO paper)."""
    per_seq = _on_real(loss_BT, inputs.mask).sum(-1) / inputs.mask.sum(-1).clamp(min=1)
    return per_seq.sum() / _num_sequences(inputs)


def _seq_mean_token_sum_norm(loss_BT: Tensor, inputs: LossInputs, cfg: LossConfig) -> Tensor:
    """Sum over each sequence's tokens / max_new_tokens, mean over sequences (Dr. GRPO): no length bias."""
    per_seq = _on_real(loss_BT, inputs.mask).sum(-1) / cfg.max_new_tokens
    return per_seq.sum() / _num_sequences(inputs)


def _token_sum(loss_BT: Tensor, inputs: LossInputs, cfg: LossConfig) -> Tensor:
    """Sum over every real token, no normaliser: Tinker's losses are sums, the caller scales them."""
    return _on_real(loss_BT, inputs.mask).sum()


def _num_sequences(inputs: LossInputs) -> float:
    return inputs.num_sequences if inputs.num_sequences is not None else float(inputs.mask.shape[0])


LOSS_AGGREGATIONS: dict[str, Callable[[Tensor, LossInputs, LossConfig], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
    "token_sum": _token_sum,
}
"""Per-token loss (B, T) -> scalar, by AlgorithmConfig.loss_agg name."""


# --------------------------------------------------------------------------- surrogates


@dataclass
class Surrogate:
    """A policy-gradient surrogate's per-token loss and what its clip did, for the metrics."""

    pg_BT: Tensor  # (B, T) loss with the off-policy weights applied, before aggregation
    ratio_BT: Tensor  # (B, T) the ratio the surrogate clips (a sequence's ratio on each of its tokens), detached
    clip_low_BT: Tensor  # (B, T) bool: the lower clip bound changed this token's gradient
    clip_high_BT: Tensor  # (B, T) bool: the upper clip bound did


def _log_ratio(inputs: LossInputs) -> Tensor:
    """log r_t = logprobs_t - old_logprobs_t on real tokens, 0 (r = 1) on masked columns (B, T)."""
    return _on_real(inputs.logprobs - inputs.old_logprobs, inputs.mask)


def _log_rho(inputs: LossInputs) -> Tensor:
    """log rho_t = old_logprobs_t - behaviour_logprobs_t (the learner's probability of the token over the
    actor's, which every off-policy correction starts from) on real tokens, 0 on masked columns (B, T),
    detached."""
    return _on_real(inputs.old_logprobs - inputs.behaviour_logprobs, inputs.mask).detach()


def _clip_surrogate(inputs: LossInputs, adv: Tensor, w: Correction, cfg: LossConfig) -> Surrogate:
    """PPO's clipped surrogate on token ratios: a clipped token's gradient is zero."""
    ratio = torch.exp(_log_ratio(inputs))  # (B, T)
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
    pg_BT = -torch.minimum(ratio * adv, clipped * adv)
    ratio = ratio.detach()
    return Surrogate(w.weight_BT * pg_BT, ratio, (ratio < 1 - cfg.clip_eps) & (adv < 0),
                     (ratio > 1 + cfg.clip_eps_high) & (adv > 0))


def _gspo_surrogate(inputs: LossInputs, adv: Tensor, w: Correction, cfg: LossConfig) -> Surrogate:
    """GSPO: one length-normalised ratio per sequence, clipped per sequence, on each of its tokens.

    Token-level advantages are averaged over the sequence's tokens (GSPO defines A per sequence);
    the off-policy weights enter as their geometric mean over the sequence, like the ratio. Both
    means are taken of log-prob differences (`_log_ratio`, `w.log_weight_BT`), never of the log of an
    exp that may underflow to 0 (so `w.weight_BT` itself is not used here). `inputs.mask` holds only
    the tokens the off-policy correction kept, so a dropped token is in neither mean.
    """
    mask = inputs.mask
    lengths_B = mask.sum(-1).clamp(min=1)
    log_s_B = _log_ratio(inputs).sum(-1) / lengths_B
    s_B1 = torch.exp(log_s_B)[:, None]  # (B, 1)
    adv_B1 = adv if adv.shape[-1] == 1 else (_on_real(adv, mask).sum(-1) / lengths_B)[:, None]
    w_B1 = torch.exp(w.log_weight_BT.sum(-1) / lengths_B)[:, None]
    clipped = s_B1.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
    pg_B1 = -w_B1 * torch.minimum(s_B1 * adv_B1, clipped * adv_B1)
    s_BT = s_B1.detach().expand_as(mask)
    return Surrogate(pg_B1.expand_as(mask), s_BT, ((s_B1 < 1 - cfg.clip_eps) & (adv_B1 < 0)).expand_as(mask),
                     ((s_B1 > 1 + cfg.clip_eps_high) & (adv_B1 > 0)).expand_as(mask))


def _cispo_surrogate(inputs: LossInputs, adv: Tensor, w: Correction, cfg: LossConfig) -> Surrogate:
    """CISPO: REINFORCE weighted by the clipped, detached ratio; every token keeps its gradient.

    The loss's value is -w * A * logprob (its gradient is what matters); a clipped token's
    gradient is scaled by the clip bound instead of zeroed as in PPO.
    """
    ratio = torch.exp(_log_ratio(inputs)).detach()  # (B, T)
    weight = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
    pg_BT = -w.weight_BT * weight * adv * _on_real(inputs.logprobs, inputs.mask)
    return Surrogate(pg_BT, ratio, ratio < 1 - cfg.clip_eps, ratio > 1 + cfg.clip_eps_high)


def _importance_sampling_surrogate(inputs: LossInputs, adv: Tensor, w: Correction, cfg: LossConfig) -> Surrogate:
    """The unclipped importance-weighted policy gradient: -r_t * A on every token."""
    ratio = torch.exp(_log_ratio(inputs))  # (B, T)
    never = torch.zeros_like(ratio, dtype=torch.bool)
    return Surrogate(-w.weight_BT * ratio * adv, ratio.detach(), never, never)


def _nll_surrogate(inputs: LossInputs, adv: Tensor, w: Correction, cfg: LossConfig) -> Surrogate:
    """Supervised fine-tuning: the negative log-likelihood of each real token; nothing is clipped and no
    off-policy weight applies (a demonstration has no behaviour policy)."""
    never = torch.zeros_like(inputs.logprobs, dtype=torch.bool)
    return Surrogate(-_on_real(inputs.logprobs, inputs.mask), torch.ones_like(inputs.logprobs), never, never)


SURROGATES: dict[str, Callable[[LossInputs, Tensor, Correction, LossConfig], Surrogate]] = {
    "clip": _clip_surrogate,
    "importance_sampling": _importance_sampling_surrogate,
    "gspo": _gspo_surrogate,
    "cispo": _cispo_surrogate,
    "nll": _nll_surrogate,
}
"""Policy-gradient surrogates by LossConfig.surrogate (see the module docstring for the formulas)."""


# --------------------------------------------------------------------------- policy loss


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """The surrogate of cfg with the off-policy correction of cfg, KL and entropy terms, aggregated by cfg.

    A token the correction drops is out of every term (its loss and gradient are 0) and still in the
    aggregation's normaliser (fleetrl/train/off_policy.py says why)."""
    inputs = replace(inputs, mask=inputs.mask.to(inputs.logprobs.dtype))
    adv = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]  # (B, T) | (B, 1)
    log_rho = _log_rho(inputs)  # (B, T), 0 on masked columns
    correction = OFF_POLICY[cfg.off_policy](log_rho, inputs.mask, cfg.tis_cap, cfg.off_policy_band)
    keep = correction.keep_BT
    kept = replace(inputs, mask=torch.where(keep, inputs.mask, 0.0))  # a dropped token is not real to the surrogate
    surrogate = SURROGATES[cfg.surrogate](kept, adv, correction, cfg)
    surrogate = Surrogate(torch.where(keep, surrogate.pg_BT, 0.0), torch.where(keep, surrogate.ratio_BT, 1.0),
                          surrogate.clip_low_BT & keep, surrogate.clip_high_BT & keep)  # GSPO fills every column
    loss_BT = surrogate.pg_BT
    kl_BT = None
    if inputs.ref_logprobs is not None:
        kl_BT = kl_penalty(_on_real(inputs.logprobs, inputs.mask), _on_real(inputs.ref_logprobs, inputs.mask),
                           cfg.kl_estimator)
        loss_BT = loss_BT + cfg.kl_coef * kl_BT
    if inputs.entropy is not None and cfg.entropy_coef > 0:
        loss_BT = loss_BT - cfg.entropy_coef * inputs.entropy
    loss_BT = torch.where(keep, loss_BT, 0.0)
    aggregate = LOSS_AGGREGATIONS[cfg.loss_agg]
    loss = aggregate(loss_BT, inputs, cfg)
    metrics = _metrics(inputs, surrogate, correction, kl_BT)
    metrics.update(mismatch_metrics(log_rho, inputs.mask, correction))
    metrics["loss"] = float(loss.detach())
    metrics["pg_loss"] = float(aggregate(surrogate.pg_BT.detach(), inputs, cfg))
    return LossOutputs(loss=loss, metrics=metrics)


def _masked_mean(values_BT: Tensor, mask: Tensor) -> float:
    return float(_on_real(values_BT.detach().to(mask.dtype), mask).sum() / mask.sum().clamp(min=1))


def _metrics(
    inputs: LossInputs,
    surrogate: Surrogate,
    correction: Correction,
    kl_BT: Tensor | None,
) -> dict[str, float]:
    """Token means over this micro-batch's real tokens, plus its token and sequence counts for weighting.

    tis_weight_mean is the mean off-policy weight applied (0 on dropped tokens), tis_frac the fraction of
    tokens whose weight was truncated (tis only: the masks drop tokens instead); a dropped token counts
    as ratio 1, unclipped, in the ratio and clip metrics."""
    mask = inputs.mask
    clip_low, clip_high = surrogate.clip_low_BT, surrogate.clip_high_BT
    return {
        "tokens": float(mask.sum()),
        "sequences": float(mask.shape[0]),
        "ratio_mean": _masked_mean(surrogate.ratio_BT, mask),
        "clip_low_frac": _masked_mean(clip_low, mask),
        "clip_high_frac": _masked_mean(clip_high, mask),
        "clip_frac": _masked_mean(clip_low | clip_high, mask),
        "tis_frac": _masked_mean(correction.truncated_BT, mask),
        "tis_weight_mean": _masked_mean(correction.weight_BT, mask),
        "pg_token_mean": _masked_mean(surrogate.pg_BT, mask),
        "kl": _masked_mean(kl_BT, mask) if kl_BT is not None else 0.0,
        "entropy": _masked_mean(inputs.entropy, mask) if inputs.entropy is not None else 0.0,
    }
