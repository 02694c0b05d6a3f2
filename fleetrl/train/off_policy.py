"""Corrections of the actor/learner mismatch: which tokens the policy loss keeps, the detached weight of
each, and the step's mismatch metrics.

With rho_t = exp(old_t - behaviour_t), the learner's probability of a sampled policy token (under the
weights current at the start of the step) over the actor's, each method of `OFF_POLICY` gives a
weight w_t (detached) and drops the tokens outside its band (inclusive bands, compared in log space):

    tis            w_t = min(rho_t, tis_cap), nothing dropped                (truncated IS)
    token_mask     w_t = rho_t,    drop t     if rho_t not in [low, high]   (token-level masked IS)
    sequence_mask  w_t = rho_i,    drop seq i if rho_i = prod_t rho_t not in [low, high]
    geo_mean_mask  w_t = 1,        drop seq i if exp(mean_t log rho_t) not in [low, high]
    icepop         w_t = M(rho_t; alpha, beta) = rho_t in [alpha, beta], 0 (dropped) outside

products and means over sequence i's policy tokens. Sources: truncated IS, Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"; token and sequence masked IS,
Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch", as verl's rollout correction implements them (docs/algo/rollout_corr_math.md §3.3-3.4:
`rollout_is` token/sequence weights with the `rollout_rs` token/sequence rejection of the same band);
the geometric mask is verl's `rollout_rs = "geometric"` (§3.3.3), a rejection with no IS weight;
IcePop is the Ling team's objective (the IcePop post, 2025, and the Ring-1T report, arXiv 2510.18855):
the mask M(k; alpha, beta) times the clipped surrogate, summed over tokens / sum_i |y_i|. token_mask and
icepop share the formula and differ in their default band (config.py's OFF_POLICY_BANDS): icepop's
[0.5, 5] is the reference band NeMo RL's `icepop` names.

Design choice: a dropped token leaves the loss entirely (its surrogate, KL and entropy terms; its
gradient is exactly 0) but still counts in the aggregation's normaliser, as the 1 / sum_i |y_i| of
IcePop's objective and NeMo RL's global token normaliser do. verl instead removes rejected tokens from
its response mask, normaliser included; here the normaliser is the whole step's count, fixed before
the first micro-batch's backward (fleetrl/train/optim.py), while a mask needs that micro-batch's
log-probs, so dropping a token would otherwise change the gradients already accumulated.

Mismatch metrics (`mismatch_metrics`), on the same policy tokens: the mean |old_t - behaviour_t|
and k3 = exp(r) - 1 - r with r = old_t - behaviour_t, Schulman's estimator of KL(actor || learner)
(the tokens are sampled from the actor; verl's `k3_kl` is the same), and the fractions of policy
tokens and of sequences the correction dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

SEQUENCE_MEANS = ("offpolicy_masked_seq_frac",)
"""mismatch_metrics that are means over the micro-batch's sequences (every other one is a token mean)."""


@dataclass
class Correction:
    """What one method does to a micro-batch (B sequences, T completion positions); all detached."""

    weight_BT: Tensor  # (B, T) the weight of each kept token's loss, 0 on dropped tokens
    log_weight_BT: Tensor  # (B, T) log of weight_BT on kept policy tokens, 0 elsewhere (GSPO's geometric mean)
    keep_BT: Tensor  # (B, T) bool, False on the policy tokens the method drops, True elsewhere
    truncated_BT: Tensor  # (B, T) bool, True where the weight was truncated (tis)


def _tis(log_rho: Tensor, mask: Tensor, tis_cap: float, band: tuple[float, float]) -> Correction:
    """min(rho_t, tis_cap) on every token (computed as exp then clamp, as it always was)."""
    rho = torch.exp(log_rho)
    keep = torch.ones_like(mask, dtype=torch.bool)
    return Correction(rho.clamp(max=tis_cap), log_rho.clamp(max=math.log(tis_cap)), keep, rho > tis_cap)


def _masked(log_w: Tensor, keep: Tensor, mask: Tensor) -> Correction:
    """The Correction of weights exp(log_w) on the kept tokens; keep is forced True off the policy tokens."""
    keep = keep | (mask <= 0)
    log_w = torch.where(keep & (mask > 0), log_w, 0.0)
    weight = torch.where(keep, torch.exp(log_w), 0.0)
    return Correction(weight, log_w, keep, torch.zeros_like(keep))


def _in_band(log_x: Tensor, band: tuple[float, float]) -> Tensor:
    return (log_x >= math.log(band[0])) & (log_x <= math.log(band[1]))


def _token_mask(log_rho: Tensor, mask: Tensor, tis_cap: float, band: tuple[float, float]) -> Correction:
    """Token-level masked IS: rho_t on the tokens whose rho_t is in the band, the others dropped."""
    return _masked(log_rho, _in_band(log_rho, band), mask)


def _sequence_mask(log_rho: Tensor, mask: Tensor, tis_cap: float, band: tuple[float, float]) -> Correction:
    """Sequence-level masked IS: the sequence ratio prod_t rho_t on each token of the sequences whose
    ratio is in the band, the other sequences dropped."""
    log_seq_B1 = log_rho.sum(-1, keepdim=True)  # log_rho is 0 off the policy tokens
    return _masked(log_seq_B1.expand_as(log_rho), _in_band(log_seq_B1, band).expand_as(mask), mask)


def _geo_mean_mask(log_rho: Tensor, mask: Tensor, tis_cap: float, band: tuple[float, float]) -> Correction:
    """Geometric-mean rejection: the sequences whose exp(mean_t log rho_t) is outside the band dropped,
    the others kept with weight 1 (no IS weight)."""
    log_geo_B1 = log_rho.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return _masked(torch.zeros_like(log_rho), _in_band(log_geo_B1, band).expand_as(mask), mask)


OFF_POLICY: dict[str, Callable[[Tensor, Tensor, float, tuple[float, float]], Correction]] = {
    "tis": _tis,
    "token_mask": _token_mask,
    "sequence_mask": _sequence_mask,
    "geo_mean_mask": _geo_mean_mask,
    "icepop": _token_mask,  # IcePop's M(k; alpha, beta) = k inside the band, 0 outside: token-level masked IS
}
"""Corrections by AlgorithmConfig.off_policy.method: (log rho (B, T), 0 off the policy tokens; the mask
(B, T); tis_cap; the band) -> Correction."""


def mismatch_metrics(log_rho: Tensor, mask: Tensor, correction: Correction) -> dict[str, float]:
    """The micro-batch's mismatch metrics (module docstring): token means over its policy tokens, and the
    fraction of its sequences with a dropped token (a sequence mean, SEQUENCE_MEANS)."""
    real = mask > 0
    tokens = mask.sum().clamp(min=1)
    dropped = real & ~correction.keep_BT

    def token_mean(values: Tensor) -> float:
        return float(torch.where(real, values, 0.0).sum() / tokens)

    return {
        "mismatch_logprob_abs_diff": token_mean(log_rho.abs()),
        "mismatch_k3_kl": token_mean(torch.expm1(log_rho) - log_rho),
        "offpolicy_masked_frac": token_mean(dropped.to(mask.dtype)),
        "offpolicy_masked_seq_frac": float(dropped.any(-1).to(mask.dtype).mean()),
    }
