"""Off-policy corrections (algorithm.off_policy) and the mismatch metrics, against their papers' formulas."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from fleetrl.errors import ConfigError
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec.config import JobSpec, OptimConfig, parse_job_spec
from fleetrl.train.losses import LOSS_AGGREGATIONS, LossConfig, LossInputs, kl_penalty, loss_config_for, policy_loss
from fleetrl.train.optim import build_scheduler, train_step
from tests.learner.test_episode_losses import episode_groups
from tests.learner.test_losses import config, random_groups, tiny_model


def _before(inputs: LossInputs, cfg: LossConfig) -> Tensor:
    """policy_loss as it was before the off-policy presets (commit f19a620), operation for operation: the
    reference of the bit-identity test. Truncated IS w_t = min(exp(old_t - behaviour_t), tis_cap)."""
    mask = inputs.mask.to(inputs.logprobs.dtype)
    real = mask > 0
    adv = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
    log_tis = torch.where(real, inputs.old_logprobs - inputs.behaviour_logprobs, 0.0).detach()
    tis_w = torch.exp(log_tis).clamp(max=cfg.tis_cap)
    log_r = torch.where(real, inputs.logprobs - inputs.old_logprobs, 0.0)
    low, high = 1 - cfg.clip_eps, 1 + cfg.clip_eps_high
    if cfg.surrogate == "clip":
        ratio = torch.exp(log_r)
        pg = tis_w * -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    elif cfg.surrogate == "importance_sampling":
        pg = -tis_w * torch.exp(log_r) * adv
    elif cfg.surrogate == "cispo":
        weight = torch.exp(log_r).detach().clamp(low, high)
        pg = -tis_w * weight * adv * torch.where(real, inputs.logprobs, 0.0)
    else:  # gspo
        lengths = mask.sum(-1).clamp(min=1)
        s = torch.exp(log_r.sum(-1) / lengths)[:, None]
        adv_B1 = adv if adv.shape[-1] == 1 else (torch.where(real, adv, 0.0).sum(-1) / lengths)[:, None]
        w = torch.exp(log_tis.clamp(max=math.log(cfg.tis_cap)).sum(-1) / lengths)[:, None]
        pg = (-w * torch.minimum(s * adv_B1, s.clamp(low, high) * adv_B1)).expand_as(mask)
    loss_BT = pg
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(torch.where(real, inputs.logprobs, 0.0), torch.where(real, inputs.ref_logprobs, 0.0),
                        cfg.kl_estimator)
        loss_BT = loss_BT + cfg.kl_coef * kl
    if inputs.entropy is not None and cfg.entropy_coef > 0:
        loss_BT = loss_BT - cfg.entropy_coef * inputs.entropy
    return LOSS_AGGREGATIONS[cfg.loss_agg](loss_BT, replace(inputs, mask=mask), cfg)


def random_inputs(seed: int, per_token_advantages: bool = False, B: int = 5, T: int = 7) -> LossInputs:
    """Ratios old/behaviour spread over [0.2, 5] and beyond, current log-probs away from old, a ragged mask
    with holes (a multi-turn loss_mask), a reference and an entropy."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 3
    lp = (old + torch.randn(B, T, generator=gen) * 0.3).requires_grad_(True)
    behaviour = old + torch.randn(B, T, generator=gen) * 0.8
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.randn(B, T, generator=gen) if per_token_advantages else torch.randn(B, generator=gen)
    ref = old + torch.randn(B, T, generator=gen) * 0.2
    entropy = torch.rand(B, T, generator=gen).requires_grad_(True)
    return LossInputs(lp, old, behaviour, adv, mask, ref_logprobs=ref, entropy=entropy)


SURROGATE_AGGREGATIONS = [(s, a) for s in ("clip", "importance_sampling", "cispo", "gspo")
                          for a in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum")]


@pytest.mark.parametrize(("surrogate", "loss_agg"), SURROGATE_AGGREGATIONS)
def test_default_tis_is_bit_identical_to_before(surrogate: str, loss_agg: str) -> None:
    for seed, per_token in ((0, False), (1, True)):
        cfg = config(surrogate=surrogate, loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01, clip_eps=0.1,
                     clip_eps_high=0.15, tis_cap=1.5)
        new, old = random_inputs(seed, per_token), random_inputs(seed, per_token)
        out = policy_loss(new, cfg)
        reference = _before(old, cfg)
        out.loss.backward()
        reference.backward()
        assert torch.equal(out.loss.detach(), reference.detach())
        assert torch.equal(new.logprobs.grad, old.logprobs.grad)
        assert new.entropy is not None and old.entropy is not None
        assert torch.equal(new.entropy.grad, old.entropy.grad)


# --------------------------------------------------------------------------- the presets, by hand


def hand_inputs(rhos: list[list[float]], mask: list[list[float]], advantages: list[float],
                ratios: list[list[float]] | None = None, ref_shift: float | None = None) -> LossInputs:
    """old log-probs -1; behaviour = old - log rho (so exp(old - behaviour) = rho); current log-probs
    old + log r (r = 1 unless `ratios`); a reference at old + ref_shift and an entropy when ref_shift is set."""
    old = torch.full((len(rhos), len(rhos[0])), -1.0)
    behaviour = old - torch.tensor(rhos).log()
    lp = (old + torch.tensor(ratios or [[1.0] * len(row) for row in rhos]).log()).requires_grad_(True)
    extra: dict[str, Tensor] = {}
    if ref_shift is not None:
        extra = dict(ref_logprobs=old + ref_shift,
                     entropy=torch.full_like(old, 0.7).requires_grad_(True))
    return LossInputs(lp, old, behaviour, torch.tensor(advantages), torch.tensor(mask), **extra)  # type: ignore[arg-type]


def expected_weights(method: str, rhos: list[list[float]], mask: list[list[float]],
                     band: tuple[float, float], tis_cap: float = 2.0) -> list[list[float | None]]:
    """Each token's weight by its paper's formula in plain Python: None off the policy tokens, 0 for a
    dropped token. tis min(rho, C) (Yao et al.); token_mask / icepop rho_t * 1[rho_t in band] (token MIS,
    IcePop's M(k) = k in [alpha, beta]); sequence_mask prod_t rho_t * 1[prod in band] (sequence MIS);
    geo_mean_mask 1[(prod_t rho_t)^(1/|y|) in band] (verl's geometric rejection)."""
    low, high = band
    out: list[list[float | None]] = []
    for row_rho, row_mask in zip(rhos, mask, strict=True):
        policy = [rho for rho, m in zip(row_rho, row_mask, strict=True) if m]
        product = math.prod(policy)
        geo = product ** (1 / len(policy))
        row: list[float | None] = []
        for rho, m in zip(row_rho, row_mask, strict=True):
            if not m:
                row.append(None)
            elif method == "tis":
                row.append(min(rho, tis_cap))
            elif method in ("token_mask", "icepop"):
                row.append(rho if low <= rho <= high else 0.0)
            elif method == "sequence_mask":
                row.append(product if low <= product <= high else 0.0)
            else:
                row.append(1.0 if low <= geo <= high else 0.0)
        out.append(row)
    return out


# rows: a sequence whose third column is an environment token (loss_mask false) with a wild behaviour
# log-prob, and a padded sequence; the columns' ratios put tokens inside and outside each band
MASK = [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
ADVANTAGES = [1.0, -2.0]
CASES = {
    # method: (band, rhos)
    "token_mask": ((0.5, 2.0), [[0.45, 1.3, 1e4, 2.2], [0.7, 1.9, 0.55, 9.0]]),
    "icepop": ((0.5, 5.0), [[0.45, 1.3, 1e4, 4.5], [0.7, 5.5, 0.6, 9.0]]),
    # products over the policy tokens: 1.2 * 1.25 * 1.2 = 1.8 (kept), 1.5 * 1.5 * 1.0 = 2.25 (dropped)
    "sequence_mask": ((0.5, 2.0), [[1.2, 1.25, 1e4, 1.2], [1.5, 1.5, 1.0, 0.01]]),
    # geometric means: (1.0005 * 0.9999 * 1.0)^(1/3) ~ 1.00013 (kept), (1.01 * 1.0 * 1.0)^(1/3) ~ 1.0033 (dropped)
    "geo_mean_mask": ((0.999, 1.001), [[1.0005, 0.9999, 1e4, 1.0], [1.01, 1.0, 1.0, 1e-4]]),
    "tis": ((0.0, math.inf), [[0.45, 1.3, 1e4, 2.2], [0.7, 1.9, 3.0, 9.0]]),
}


@pytest.mark.parametrize("method", list(CASES))
def test_each_preset_weights_and_drops_tokens_as_its_formula(method: str) -> None:
    """On-policy ratio r = 1 and the clipped surrogate, token_mean over the 6 policy tokens, KL (k3) and
    entropy terms: the loss is sum_t [-w_t A_i + kl_coef * k3_t - entropy_coef * H_t] over the kept policy
    tokens / 6, every term 0 on a dropped token (and its gradient), an environment token in no term."""
    band, rhos = CASES[method]
    weights = expected_weights(method, rhos, MASK, band)
    inputs = hand_inputs(rhos, MASK, ADVANTAGES, ref_shift=0.3)
    cfg = config(off_policy=method, off_policy_band=band, kl_coef=0.1, entropy_coef=0.05)
    out = policy_loss(inputs, cfg)
    out.loss.backward()
    k3 = math.exp(0.3) - 1 - 0.3  # log r = ref - logprobs = 0.3 on every token
    d_k3 = 1 - math.exp(0.3)  # d k3 / d logprob
    loss, grad, entropy_grad = 0.0, [], []
    for w_row, adv in zip(weights, ADVANTAGES, strict=True):
        kept = [w is not None and (w > 0 or method == "tis") for w in w_row]
        loss += sum(-w * adv + 0.1 * k3 - 0.05 * 0.7 for w, k in zip(w_row, kept, strict=True) if k and w is not None)
        grad.append([(-w * adv + 0.1 * d_k3) / 6 if k and w is not None else 0.0 for w, k in zip(w_row, kept,
                                                                                                   strict=True)])
        entropy_grad.append([-0.05 / 6 if k else 0.0 for k in kept])
    assert out.loss.item() == pytest.approx(loss / 6, abs=1e-5)
    torch.testing.assert_close(inputs.logprobs.grad, torch.tensor(grad), atol=1e-5, rtol=1e-5)
    assert inputs.entropy is not None
    torch.testing.assert_close(inputs.entropy.grad, torch.tensor(entropy_grad), atol=1e-7, rtol=0)
    dropped = [[w == 0.0 and method != "tis" for w in row] for row in weights]
    assert any(map(any, dropped)) == (method != "tis")
    assert out.metrics["offpolicy_masked_frac"] == pytest.approx(sum(map(sum, dropped)) / 6)
    assert out.metrics["offpolicy_masked_seq_frac"] == pytest.approx(sum(map(any, dropped)) / 2)
    applied = [w for row in weights for w in row if w is not None]
    assert out.metrics["tis_weight_mean"] == pytest.approx(sum(applied) / 6, rel=1e-5)


def test_icepop_masks_the_clipped_surrogate_as_its_objective() -> None:
    """IcePop: J = 1/sum|y| sum_t M(k_t; alpha, beta) * min(r_t A, clip(r_t, 1 - eps, 1 + eps) A),
    k_t = pi_train(y_t; theta_old) / pi_infer(y_t; theta_old), M(k) = k on [alpha, beta], 0 outside.
    Here r != 1, so the clip acts too; the loss is -J and its gradient is -M(k) A r / N on unclipped tokens."""
    rhos = [[0.3, 0.6, 1.0, 3.0, 7.0]]
    ratios = [[1.1, 1.3, 0.9, 0.7, 1.05]]
    adv, alpha, beta, eps = 1.5, 0.5, 5.0, 0.2
    inputs = hand_inputs(rhos, [[1.0] * 5], [adv], ratios=ratios)
    out = policy_loss(inputs, config(off_policy="icepop", off_policy_band=(alpha, beta), clip_eps=eps,
                                     clip_eps_high=eps))
    out.loss.backward()
    m = [k if alpha <= k <= beta else 0.0 for k in rhos[0]]
    clip = [min(max(r, 1 - eps), 1 + eps) for r in ratios[0]]
    objective = sum(mk * min(r * adv, c * adv) for mk, r, c in zip(m, ratios[0], clip, strict=True)) / 5
    assert out.loss.item() == pytest.approx(-objective, abs=1e-6)
    grad = [-mk * adv * r / 5 if r * adv <= c * adv else 0.0 for mk, r, c in zip(m, ratios[0], clip, strict=True)]
    torch.testing.assert_close(inputs.logprobs.grad, torch.tensor([grad]), atol=1e-6, rtol=0)
    assert grad[0] == 0.0 and grad[4] == 0.0 and grad[1] == 0.0  # masked low, masked high, clipped high


@pytest.mark.parametrize("surrogate", ["clip", "importance_sampling", "cispo", "gspo"])
@pytest.mark.parametrize("method", ["token_mask", "sequence_mask", "geo_mean_mask", "icepop"])
def test_dropped_and_environment_tokens_get_no_gradient_under_every_surrogate(method: str, surrogate: str) -> None:
    """Random ratios old/behaviour and current/old, a mask with holes, KL and entropy terms: under every
    surrogate (token_sum, no normaliser), the gradient is exactly 0 on the dropped policy tokens (found
    in plain Python from the formulas) and off the policy tokens, and nonzero on some kept token."""
    inputs = random_inputs(3)
    rhos = torch.exp(inputs.old_logprobs - inputs.behaviour_logprobs).tolist()
    mask = inputs.mask.tolist()
    band = {"geo_mean_mask": (0.8, 1.25)}.get(method, (0.5, 2.0))
    weights = expected_weights(method, rhos, mask, band)
    out = policy_loss(inputs, config(off_policy=method, off_policy_band=band, surrogate=surrogate,
                                     loss_agg="token_sum", kl_coef=0.1, entropy_coef=0.01))
    out.loss.backward()
    assert inputs.logprobs.grad is not None and inputs.entropy is not None and inputs.entropy.grad is not None
    silent = torch.tensor([[w is None or w == 0.0 for w in row] for row in weights])
    assert any(w == 0.0 for row in weights for w in row) and bool((~silent).any())  # some dropped, some kept
    assert torch.equal(inputs.logprobs.grad[silent], torch.zeros(int(silent.sum())))
    assert torch.equal(inputs.entropy.grad[silent], torch.zeros(int(silent.sum())))
    assert bool((inputs.logprobs.grad[~silent] != 0).any())


# --------------------------------------------------------------------------- mismatch metrics


def test_mismatch_metrics_by_hand() -> None:
    """mean |old - behaviour| and k3 = exp(r) - 1 - r, r = old - behaviour (KL(actor || learner) from the
    actor's samples), over the policy tokens only: the environment token's wild behaviour log-prob is not seen."""
    rhos = [[0.5, 2.0, 1e4, 1.0], [1.5, 1.0, 0.8, 9.0]]
    out = policy_loss(hand_inputs(rhos, MASK, ADVANTAGES), config())
    logs = [math.log(rho) for row, m_row in zip(rhos, MASK, strict=True) for rho, m in zip(row, m_row, strict=True)
            if m]
    assert len(logs) == 6
    assert out.metrics["mismatch_logprob_abs_diff"] == pytest.approx(sum(map(abs, logs)) / 6, rel=1e-5)
    assert out.metrics["mismatch_k3_kl"] == pytest.approx(sum(math.exp(r) - 1 - r for r in logs) / 6, rel=1e-5)
    assert out.metrics["offpolicy_masked_frac"] == out.metrics["offpolicy_masked_seq_frac"] == 0.0
    assert out.metrics["sequences"] == 2.0
    on_policy = policy_loss(hand_inputs([[1.0] * 4] * 2, MASK, ADVANTAGES), config())
    assert on_policy.metrics["mismatch_logprob_abs_diff"] == on_policy.metrics["mismatch_k3_kl"] == 0.0


# --------------------------------------------------------------------------- through train_step


def spec_with(off_policy: dict[str, object], micro_batch_samples: int = 2, name: str = "grpo") -> JobSpec:
    return JobSpec.model_validate({
        "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}, "rollout": {"max_new_tokens": 16},
        "algorithm": {"name": name, "entropy_coef": 0.01, "off_policy": off_policy},
        "train": {"micro_batch_samples": micro_batch_samples}})


def run_step(groups: list[common_pb2.Group], spec: JobSpec) -> tuple[dict[str, float], Tensor]:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = build_scheduler(optimizer, OptimConfig(learning_rate=0.5), 10)
    metrics = train_step(model, optimizer, scheduler, groups, loss_config_for(spec), spec)
    return ({k: v for k, v in metrics.items() if not k.endswith("_s")},
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


METHODS = [{"method": "tis"}, {"method": "token_mask"}, {"method": "sequence_mask", "low": 0.1, "high": 4.0},
           {"method": "geo_mean_mask", "low": 0.5, "high": 1.5}, {"method": "icepop"}]
"""Bands wide enough that the tiny model (log-probs near log 1/16) against behaviour log-probs near -2
keeps some sequences and drops others."""


@pytest.mark.parametrize("off_policy", METHODS, ids=[m["method"] for m in METHODS])
def test_step_metrics_are_the_same_for_any_micro_batch_size(off_policy: dict[str, object]) -> None:
    """The step reports the mismatch metrics; the token and sequence means of 5 micro-batches of 2 equal
    those of one micro-batch of 9, and the masked fractions are those of the whole batch."""
    groups = random_groups(3, behaviour_noise=0.6)
    whole, whole_params = run_step(groups, spec_with(off_policy, micro_batch_samples=9))
    parts, parts_params = run_step(groups, spec_with(off_policy, micro_batch_samples=2))
    keys = ("mismatch_logprob_abs_diff", "mismatch_k3_kl", "offpolicy_masked_frac", "offpolicy_masked_seq_frac",
            "tis_weight_mean", "loss")
    for key in keys:
        assert parts[key] == pytest.approx(whole[key], abs=1e-6), key
    torch.testing.assert_close(parts_params, whole_params, atol=1e-6, rtol=1e-5)
    assert whole["mismatch_logprob_abs_diff"] > 0.1 and whole["mismatch_k3_kl"] > 0.0
    if off_policy["method"] == "tis":
        assert whole["offpolicy_masked_frac"] == whole["offpolicy_masked_seq_frac"] == 0.0
    else:
        assert 0.0 < whole["offpolicy_masked_seq_frac"] < 1.0 and 0.0 < whole["offpolicy_masked_frac"] < 1.0


@pytest.mark.parametrize("off_policy", METHODS[1:], ids=[m["method"] for m in METHODS[1:]])
def test_environment_tokens_change_no_mask(off_policy: dict[str, object]) -> None:
    """Multi-turn episodes: the environment tokens' behaviour log-probs (wild, -7.5) and the observation
    after the last action decide nothing, under every mask; a policy token's behaviour log-prob does."""
    base_metrics, base_params = run_step(episode_groups(6), spec_with(off_policy))
    other_metrics, other_params = run_step(episode_groups(6, garbage=-7.5, tail=5), spec_with(off_policy))
    assert base_metrics == other_metrics
    assert torch.equal(base_params, other_params)
    assert 0.0 < base_metrics["offpolicy_masked_frac"] < 1.0
    moved = episode_groups(6)
    moved[0].samples[0].behaviour_logprobs[0] -= 3.0
    moved_metrics, _ = run_step(moved, spec_with(off_policy))
    assert moved_metrics["mismatch_logprob_abs_diff"] != base_metrics["mismatch_logprob_abs_diff"]


# --------------------------------------------------------------------------- config


def test_the_default_config_is_todays_tis() -> None:
    cfg = loss_config_for(JobSpec.model_validate({"prompts": "p", "reward": {"builtin": "numeric_match"}}))
    assert (cfg.off_policy, cfg.off_policy_band, cfg.tis_cap) == ("tis", (0.0, math.inf), 2.0)


@pytest.mark.parametrize(("off_policy", "band"), [
    ({"method": "token_mask"}, (0.5, 2.0)),
    ({"method": "sequence_mask", "high": 3.0}, (0.5, 3.0)),
    ({"method": "geo_mean_mask"}, (0.999, 1.001)),
    ({"method": "icepop"}, (0.5, 5.0)),
    ({"method": "icepop", "low": 0.2}, (0.2, 5.0)),
])
def test_bands_take_the_methods_defaults(off_policy: dict[str, object], band: tuple[float, float]) -> None:
    cfg = loss_config_for(spec_with(off_policy))
    assert (cfg.off_policy, cfg.off_policy_band) == (off_policy["method"], band)
    spec = spec_with(off_policy)
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(("table", "field", "words"), [
    ("method = 'mis'", "algorithm.off_policy.method", "tis"),
    ("method = 'icepop'\nlow = 0", "algorithm.off_policy.low", "greater than 0"),
    ("method = 'icepop'\nlow = 1.5", "algorithm.off_policy.low", "less than or equal to 1"),
    ("method = 'token_mask'\nhigh = 0.9", "algorithm.off_policy.high", "greater than or equal to 1"),
    ("method = 'token_mask'\nlow = 1\nhigh = 1", "algorithm.off_policy", "algorithm.off_policy.low (1) must be below"),
    ("high = 3", "algorithm.off_policy", "method 'tis' truncates at algorithm.tis_cap"),
    ("method = 'icepop'\nalpha = 0.5", "algorithm.off_policy.alpha", "Extra inputs"),
])
def test_a_bad_off_policy_table_names_its_field(table: str, field: str, words: str) -> None:
    text = f"prompts = 'p.jsonl'\n[reward]\nbuiltin = 'numeric_match'\n[algorithm.off_policy]\n{table}\n"
    with pytest.raises(ConfigError) as info:
        parse_job_spec(text)
    assert [v.field for v in info.value.violations] == [field]
    assert words in info.value.violations[0].description
