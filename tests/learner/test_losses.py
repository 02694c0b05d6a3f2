"""Loss, advantage, KL, aggregation and schedule values worked out by hand; gradient identities on a tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec.config import JobSpec, OptimConfig
from fleetrl.train.batch import build_batch, completion_logprobs, group_advantages, has_signal, micro_batches
from fleetrl.train.losses import (
    LossConfig,
    LossInputs,
    compute_group_advantages,
    kl_penalty,
    loss_config_for,
    policy_loss,
)
from fleetrl.train.optim import build_optimizer, build_scheduler, lr_factor, train_step


def config(**overrides: object) -> LossConfig:
    base: dict[str, object] = dict(
        clip_eps=0.2, clip_eps_high=0.2, loss_agg="token_mean", kl_coef=0.0, kl_estimator="k3",
        entropy_coef=0.0, tis_cap=2.0, max_new_tokens=4, advantage="grpo", skip_zero_variance_groups=False,
    )
    base.update(overrides)
    return LossConfig(**base)  # type: ignore[arg-type]


def on_policy(
    logprobs: list[list[float]], advantages: list[float], mask: list[list[float]], **kw: object
) -> LossInputs:
    """Inputs whose ratio and TIS weight are exactly 1, so each token's loss is -A (+ KL/entropy terms)."""
    lp = torch.tensor(logprobs, requires_grad=True)
    return LossInputs(lp, lp.detach().clone(), lp.detach().clone(), torch.tensor(advantages), torch.tensor(mask),
                      **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- advantages


def test_advantage_kinds_by_hand() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, centred [-2, -1, 0, 3], unbiased var 14/3
    std = math.sqrt(14 / 3)  # 2.1602469
    expected = {
        "grpo": [-2 / std, -1 / std, 0.0, 3 / std],  # [-0.92582, -0.46291, 0, 1.38873]
        "dr_grpo": [-2.0, -1.0, 0.0, 3.0],
        "rloo": [1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0],  # r_i - mean of the other three
    }
    for kind, values in expected.items():
        torch.testing.assert_close(compute_group_advantages(rewards, kind), torch.tensor(values), atol=1e-5, rtol=0)
    assert compute_group_advantages(torch.tensor([0.5, 0.5, 0.5]), "grpo").abs().max() == 0
    for kind in expected:
        assert compute_group_advantages(torch.tensor([1.0]), kind).tolist() == [0.0]


def test_presets_fill_only_unset_fields() -> None:
    def spec(**algorithm: object) -> JobSpec:
        return JobSpec(prompts="p.jsonl", reward={"builtin": "numeric_match"}, algorithm=algorithm)

    dapo = loss_config_for(spec(name="dapo"))
    assert (dapo.clip_eps_high, dapo.loss_agg, dapo.advantage, dapo.skip_zero_variance_groups) == (
        0.28, "token_mean", "grpo", True)
    grpo = loss_config_for(spec(name="grpo", clip_eps=0.1))
    assert (grpo.clip_eps_high, grpo.loss_agg, grpo.advantage) == (0.1, "seq_mean_token_mean", "grpo")
    dr = loss_config_for(spec(name="dr_grpo"))
    assert (dr.loss_agg, dr.advantage, dr.max_new_tokens) == ("seq_mean_token_sum_norm", "dr_grpo", 128)
    ppo = loss_config_for(spec(name="ppo_rloo", loss_agg="seq_mean_token_mean", clip_eps_high=0.5))
    assert (ppo.advantage, ppo.loss_agg, ppo.clip_eps_high) == ("rloo", "seq_mean_token_mean", 0.5)
    assert (grpo.surrogate, dapo.surrogate, ppo.surrogate, ppo.clip_eps) == ("clip", "clip", "clip", 0.2)
    gspo = loss_config_for(spec(name="gspo"))
    assert (gspo.surrogate, gspo.clip_eps, gspo.clip_eps_high, gspo.loss_agg, gspo.advantage) == (
        "gspo", 3e-4, 4e-4, "seq_mean_token_mean", "grpo")
    cispo = loss_config_for(spec(name="cispo", clip_eps=0.5))
    assert (cispo.surrogate, cispo.clip_eps, cispo.clip_eps_high, cispo.loss_agg) == ("cispo", 0.5, 4.0, "token_mean")


# --------------------------------------------------------------------------- aggregations


AGG_2x3 = dict(logprobs=[[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], advantages=[1.0, 2.0],
               mask=[[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
# token losses -A on real tokens: row 0 [-1, -1, .], row 1 [-2, ., .]


@pytest.mark.parametrize(
    ("loss_agg", "counts", "loss", "grad"),
    [
        # sum -4 over 3 tokens; d/dlogprob = -A / 3
        ("token_mean", {}, -4 / 3, [[-1 / 3, -1 / 3, 0], [-2 / 3, 0, 0]]),
        # whole step batch has 6 tokens: sum -4 / 6
        ("token_mean", {"num_tokens": 6.0}, -4 / 6, [[-1 / 6, -1 / 6, 0], [-2 / 6, 0, 0]]),
        # row means -1 and -2, mean over 2 rows; row 0's tokens weigh 1/2 each
        ("seq_mean_token_mean", {}, -1.5, [[-1 / 4, -1 / 4, 0], [-1.0, 0, 0]]),
        ("seq_mean_token_mean", {"num_sequences": 4.0}, -0.75, [[-1 / 8, -1 / 8, 0], [-0.5, 0, 0]]),
        # row sums -2 and -2 over max_new_tokens 4, mean over 2 rows
        ("seq_mean_token_sum_norm", {}, -0.5, [[-1 / 8, -1 / 8, 0], [-2 / 8, 0, 0]]),
    ],
)
def test_aggregations_by_hand(loss_agg: str, counts: dict[str, float], loss: float, grad: list[list[float]]) -> None:
    inputs = on_policy(**AGG_2x3, **counts)  # type: ignore[arg-type]
    out = policy_loss(inputs, config(loss_agg=loss_agg))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    torch.testing.assert_close(inputs.logprobs.grad, torch.tensor(grad), atol=1e-6, rtol=0)


def test_per_token_advantages() -> None:
    inputs = on_policy([[0.0, 0.0]], [0.0], [[1.0, 1.0]])
    inputs.advantages = torch.tensor([[1.0, 3.0]])
    assert policy_loss(inputs, config()).loss.item() == pytest.approx(-2.0)


# --------------------------------------------------------------------------- clipping, TIS, KL, entropy


def clip_inputs(advantage: float) -> LossInputs:
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5]])
    old = torch.full((1, 4), -1.0)
    lp = (old + ratios.log()).requires_grad_(True)
    return LossInputs(lp, old, old.clone(), torch.tensor([advantage]), torch.ones(1, 4))


def test_clip_high_with_positive_advantage() -> None:
    inputs = clip_inputs(1.0)
    out = policy_loss(inputs, config(clip_eps=0.2, clip_eps_high=0.28))
    out.loss.backward()
    # -min(r, clip(r, 0.8, 1.28)) = -[0.5, 0.9, 1.1, 1.28]; mean -0.945; the clipped token has no gradient
    assert out.loss.item() == pytest.approx(-3.78 / 4, abs=1e-6)
    torch.testing.assert_close(inputs.logprobs.grad, torch.tensor([[-0.125, -0.225, -0.275, 0.0]]), atol=1e-6, rtol=0)
    assert (out.metrics["clip_high_frac"], out.metrics["clip_low_frac"], out.metrics["clip_frac"]) == (0.25, 0.0, 0.25)


def test_clip_low_with_negative_advantage() -> None:
    inputs = clip_inputs(-1.0)
    out = policy_loss(inputs, config(clip_eps=0.2, clip_eps_high=0.28))
    out.loss.backward()
    # -min(-r, -clip(r)) = max(r, clip(r)) = [0.8, 0.9, 1.1, 1.5]; mean 1.075; ratio 0.5 is clipped
    assert out.loss.item() == pytest.approx(4.3 / 4, abs=1e-6)
    torch.testing.assert_close(inputs.logprobs.grad, torch.tensor([[0.0, 0.225, 0.275, 0.375]]), atol=1e-6, rtol=0)
    assert (out.metrics["clip_low_frac"], out.metrics["clip_high_frac"]) == (0.25, 0.0)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_truncated_importance_weight() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    behaviour = old - torch.tensor([[0.5, 1.0, 3.0]]).log()  # old/behaviour ratios 0.5, 1, 3 -> capped 0.5, 1, 2
    lp = old.clone().requires_grad_(True)
    inputs = LossInputs(lp, old, behaviour, torch.tensor([1.0]), torch.ones(1, 3))
    out = policy_loss(inputs, config(tis_cap=2.0))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-3.5 / 3, abs=1e-6)  # -(0.5 + 1 + 2) / 3
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 / 3, -1 / 3, -2 / 3]]), atol=1e-6, rtol=0)
    assert out.metrics["tis_frac"] == pytest.approx(1 / 3)
    assert out.metrics["tis_weight_mean"] == pytest.approx(3.5 / 3)


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [
        ("k1", [0.5, -1.0]),  # -log r, log r = ref - logprobs = [-0.5, 1.0]
        ("k2", [0.125, 0.5]),  # (log r)^2 / 2
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),  # r - 1 - log r = [0.1065307, 0.7182818]
    ],
)
def test_kl_estimators(estimator: str, per_token: list[float]) -> None:
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_penalty(logprobs, ref, estimator), torch.tensor([per_token]), atol=1e-6, rtol=0)
    inputs = on_policy([[-1.0, -2.0]], [0.0], [[1.0, 1.0]], ref_logprobs=ref)
    out = policy_loss(inputs, config(kl_coef=0.5, kl_estimator=estimator))
    assert out.loss.item() == pytest.approx(0.5 * sum(per_token) / 2, abs=1e-6)
    assert out.metrics["kl"] == pytest.approx(sum(per_token) / 2, abs=1e-6)


def test_entropy_bonus() -> None:
    entropy = torch.tensor([[1.0, 2.0, 3.0]])
    inputs = on_policy([[-1.0, -1.0, -1.0]], [0.0], [[1.0, 1.0, 0.0]], entropy=entropy)
    out = policy_loss(inputs, config(entropy_coef=0.1))
    assert out.loss.item() == pytest.approx(-0.1 * 1.5, abs=1e-7)  # mean entropy over the 2 real tokens
    assert out.metrics["entropy"] == pytest.approx(1.5)
    assert policy_loss(inputs, config(entropy_coef=0.0)).loss.item() == 0.0


# --------------------------------------------------------------------------- tiny model identities


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def random_groups(seed: int, behaviour_noise: float = 0.0) -> list[common_pb2.Group]:
    """3 groups of 3 samples, prompts of 2-4 tokens, completions of 1-5 tokens, rewards in {0, 1}."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(3):
        prompt = torch.randint(2, 16, (2 + g,), generator=gen).tolist()
        group = common_pb2.Group(task_id=f"0/{g}")
        for _ in range(3):
            length = int(torch.randint(1, 6, (1,), generator=gen))
            group.samples.append(common_pb2.Sample(
                prompt_token_ids=prompt, completion_token_ids=torch.randint(0, 16, (length,), generator=gen).tolist(),
                behaviour_logprobs=(-2.0 + behaviour_noise * torch.randn(length, generator=gen)).tolist(),
                reward=float(torch.randint(0, 2, (1,), generator=gen))))
        groups.append(group)
    return groups


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_on_policy_grpo_gradient_is_reinforce_with_baseline() -> None:
    model, groups, cfg = tiny_model(), random_groups(1), config(loss_agg="seq_mean_token_mean")
    batch = build_batch(groups, group_advantages(groups, cfg), pad_id=0)
    with torch.no_grad():
        behaviour = completion_logprobs(model, batch)[0] * batch.completion_mask  # the actor = this policy
    logprobs, _ = completion_logprobs(model, batch)
    inputs = LossInputs(logprobs, logprobs.detach(), behaviour, batch.advantages, batch.completion_mask)
    policy_loss(inputs, cfg).loss.backward()
    ours = grads(model)
    model.zero_grad()
    logprobs, _ = completion_logprobs(model, batch)
    mask = batch.completion_mask
    reinforce = -(batch.advantages * (logprobs * mask).sum(-1) / mask.sum(-1)).mean()
    reinforce.backward()
    assert ours.abs().max() > 1e-4
    torch.testing.assert_close(ours, grads(model), atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize(("loss_agg", "surrogate"), [
    ("token_mean", "clip"), ("seq_mean_token_mean", "clip"), ("seq_mean_token_sum_norm", "clip"),
    ("seq_mean_token_mean", "gspo"), ("token_mean", "cispo"),
])
def test_micro_batch_accumulation_equals_full_batch(loss_agg: str, surrogate: str) -> None:
    model, groups = tiny_model(), random_groups(2, behaviour_noise=0.3)
    cfg = config(loss_agg=loss_agg, surrogate=surrogate)
    batch = build_batch(groups, group_advantages(groups, cfg), pad_id=0)
    per_micro = []
    for micro_size in (batch.num_sequences, 2):
        model.zero_grad()
        for micro in micro_batches(batch, micro_size):
            logprobs, _ = completion_logprobs(model, micro)
            old = (logprobs.detach() + 0.1).clamp(max=0.0)  # a ratio away from 1, so clipping acts
            inputs = LossInputs(logprobs, old, micro.behaviour_logprobs, micro.advantages, micro.completion_mask,
                                num_tokens=float(batch.num_tokens), num_sequences=float(batch.num_sequences))
            policy_loss(inputs, cfg).loss.backward()
        per_micro.append(grads(model).clone())
    assert len(micro_batches(batch, 2)) == 5
    torch.testing.assert_close(per_micro[1], per_micro[0], atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("tokens", [0, 1, 9, 14, 30])
def test_micro_batches_hold_at_most_their_samples_and_padded_tokens(tokens: int) -> None:
    batch = build_batch(random_groups(3), [torch.zeros(3)] * 3, pad_id=0)
    lengths = (batch.prompt_lens + batch.completion_lens).tolist()
    micros = micro_batches(batch, 4, tokens)
    assert torch.equal(torch.cat([m.input_ids[:, :2] for m in micros]), batch.input_ids[:, :2])  # every row, in order
    assert sum(m.num_sequences for m in micros) == batch.num_sequences
    for m in micros:
        rows, width = m.input_ids.shape
        assert rows <= 4 and width == max((m.prompt_lens + m.completion_lens).tolist())
        assert tokens == 0 or rows * width <= tokens or rows == 1  # a longer row goes alone
    if tokens:  # the greedy split: no slice could have taken the next row within both bounds
        ends = [sum(m.num_sequences for m in micros[: i + 1]) for i in range(len(micros) - 1)]
        for end, m in zip(ends, micros, strict=False):
            grown = max(*(m.prompt_lens + m.completion_lens).tolist(), lengths[end])
            assert m.num_sequences == 4 or (m.num_sequences + 1) * grown > tokens
    else:
        assert [m.num_sequences for m in micros] == [4, 4, 1]


@pytest.mark.parametrize("name", ["dapo", "gspo", "cispo"])
def test_train_step_same_update_for_any_micro_batch_size(name: str) -> None:
    groups = random_groups(3, behaviour_noise=0.3)
    spec_data = dict(prompts="p.jsonl", reward={"builtin": "numeric_match"}, algorithm={"name": name},
                     rollout={"max_new_tokens": 5})
    params, metrics = [], []
    for micro_size, micro_tokens in ((9, 0), (2, 0), (9, 12)):  # whole; 2 rows; 12 padded tokens (1 or 2 rows)
        spec = JobSpec(**spec_data, train={"epochs_per_step": 2, "micro_batch_samples": micro_size,  # type: ignore[arg-type]
                                           "micro_batch_tokens": micro_tokens})
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD: no Adam sign amplification of fp noise
        scheduler = build_scheduler(optimizer, OptimConfig(learning_rate=0.5), 10)
        metrics.append(train_step(model, optimizer, scheduler, groups, loss_config_for(spec), spec))
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    for other in (1, 2):
        torch.testing.assert_close(params[other], params[0], atol=1e-6, rtol=1e-5)
        assert metrics[0]["loss"] == pytest.approx(metrics[other]["loss"], abs=1e-6)
    kept = [g for g in groups if has_signal(g)] if name == "dapo" else groups  # dapo skips constant-reward groups
    assert len(kept) > 0 and metrics[0]["groups_skipped"] == len(groups) - len(kept)
    assert name != "dapo" or len(kept) < len(groups)
    tokens = sum(len(s.completion_token_ids) for g in kept for s in g.samples)
    assert metrics[0]["tokens"] == metrics[1]["tokens"] == metrics[2]["tokens"] == tokens
    assert params[0].sub(torch.cat([p.detach().reshape(-1) for p in tiny_model().parameters()])).abs().max() > 1e-4


def test_zero_variance_groups_are_skipped() -> None:
    groups = random_groups(4)
    for sample in groups[0].samples:
        sample.reward = 1.0
    spec = JobSpec(prompts="p.jsonl", reward={"builtin": "numeric_match"}, algorithm={"name": "dapo"})
    model = tiny_model()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = build_scheduler(optimizer, spec.optim, 10)
    idle = train_step(model, optimizer, scheduler, groups[:1], loss_config_for(spec), spec)
    assert idle["groups_skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out = train_step(model, optimizer, scheduler, groups, loss_config_for(spec), spec)
    assert out["groups_skipped"] == 1.0 and out["sequences"] == 6.0
    # a step that trained nothing writes the same metrics, 0 where nothing was trained
    assert idle.keys() == out.keys() and {"loss", "kl", "entropy", "clip_frac", "tokens", "grad_norm"} <= idle.keys()
    assert all(idle[k] == 0.0 for k in idle.keys() - {"reward_mean", "reward_std", "groups", "groups_skipped", "lr"})


# --------------------------------------------------------------------------- optimizer and clipping


def test_adamw_set_up_by_hand() -> None:
    """build_optimizer: AdamW over the trainable parameters only, with the config's learning rate,
    betas and decoupled weight decay; two steps on one scalar worked out by hand."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.tensor([2.0]))
    model.frozen = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=0.1, weight_decay=0.5, betas=(0.5, 0.5)))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [p for group in optimizer.param_groups for p in group["params"]] == [model.w]
    model.w.grad = torch.tensor([1.0])
    optimizer.step()
    # step 1: m_hat = g, v_hat = g^2, so the Adam step is g / |g| = 1; w = 2 * (1 - 0.1 * 0.5) - 0.1 * 1
    assert model.w.item() == pytest.approx(1.8, abs=1e-6)
    model.w.grad = torch.tensor([3.0])
    optimizer.step()
    # step 2: m = 0.5 * 0.5 + 0.5 * 3 = 1.75, v = 0.5 * 0.5 + 0.5 * 9 = 4.75, both / (1 - 0.5^2):
    # m_hat = 7/3, v_hat = 19/3, step = (7/3) / sqrt(19/3) = 0.927173; w = 1.8 * 0.95 - 0.0927173
    assert model.w.item() == pytest.approx(1.8 * 0.95 - 0.1 * (7 / 3) / math.sqrt(19 / 3), abs=1e-6)
    assert model.frozen.item() == 1.0


def test_train_step_clips_the_gradient_norm() -> None:
    """With SGD (step = -lr * g) the update is the gradient itself: unclipped, its norm is lr times the
    reported grad_norm; with max_grad_norm below that norm, the same direction scaled to max_grad_norm."""
    groups, lr, clip = random_groups(1), 1.0, 0.05
    steps, norms = [], []
    for max_grad_norm in (1e6, clip):
        spec = JobSpec.model_validate({"prompts": "p.jsonl", "reward": {"builtin": "numeric_match"},
                                       "optim": {"max_grad_norm": max_grad_norm}, "rollout": {"max_new_tokens": 5}})
        model = tiny_model()
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        out = train_step(model, optimizer, build_scheduler(optimizer, spec.optim, 10), groups,
                         loss_config_for(spec), spec)
        steps.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before)
        norms.append(out["grad_norm"])
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 4 * clip  # the pre-clip norm, both times
    assert float(steps[0].norm()) == pytest.approx(lr * norms[0], rel=1e-4)
    assert float(steps[1].norm()) == pytest.approx(lr * clip, rel=1e-4)
    torch.testing.assert_close(steps[1], steps[0] * (clip / norms[0]), atol=1e-7, rtol=1e-3)


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        ("linear", 2, [0.5, 1.0, 1.0, 0.7, 0.4, 0.1]),  # decay over steps 2..5: 1 - 0.9 * k/3
        ("cosine", 2, [0.5, 1.0, 1.0, 0.775, 0.325, 0.1]),  # 0.1 + 0.9 * (1 + cos(pi k/3)) / 2
        ("constant", 4, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]),
    ],
)
def test_scheduler_warmup_and_decay(schedule: str, warmup: int, expected: list[float]) -> None:
    optim_cfg = OptimConfig(learning_rate=0.5, warmup_steps=warmup, lr_schedule=schedule, min_lr_ratio=0.1)  # type: ignore[arg-type]
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.5)
    scheduler = build_scheduler(optimizer, optim_cfg, max_steps=6)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * f for f in expected])
    assert lr_factor(100, optim_cfg, 6) == pytest.approx(expected[-1])


# --------------------------------------------------------------------------- GSPO and CISPO


def sequence_inputs(token_ratios: list[list[float]], advantages: list[float], mask: list[list[float]]) -> LossInputs:
    old = torch.full((len(token_ratios), len(token_ratios[0])), -1.0)
    lp = (old + torch.tensor(token_ratios).log()).requires_grad_(True)
    return LossInputs(lp, old, old.clone(), torch.tensor(advantages), torch.tensor(mask))


def test_gspo_uses_the_geometric_mean_ratio_of_each_sequence() -> None:
    # row 0: token ratios 1.21 and 1 -> s = sqrt(1.21) = 1.1; row 1: one real token, ratio 0.5 (the pad's 4 is masked)
    inputs = sequence_inputs([[1.21, 1.0], [0.5, 4.0]], [1.0, -1.0], [[1.0, 1.0], [1.0, 0.0]])
    out = policy_loss(inputs, config(surrogate="gspo", clip_eps=0.2, clip_eps_high=0.2, loss_agg="seq_mean_token_mean"))
    out.loss.backward()
    # row 0: -min(1.1, 1.1) = -1.1, unclipped; row 1: -min(-0.5, -0.8) = 0.8, clipped low; mean over 2 rows
    assert out.loss.item() == pytest.approx((-1.1 + 0.8) / 2, abs=1e-6)
    # d(-s A)/d logp_t = -s A / |y| for each token of row 0, halved by the mean over rows; row 1 is clipped: 0
    torch.testing.assert_close(inputs.logprobs.grad, torch.tensor([[-0.275, -0.275], [0.0, 0.0]]), atol=1e-6, rtol=0)
    assert (out.metrics["clip_low_frac"], out.metrics["clip_high_frac"]) == (pytest.approx(1 / 3), 0.0)
    assert out.metrics["ratio_mean"] == pytest.approx((1.1 + 1.1 + 0.5) / 3)


def test_gspo_clips_the_whole_sequence_not_its_tokens() -> None:
    # token ratios 1.5 and 1/1.5: each token alone would be clipped at eps 0.2, their geometric mean 1 is not
    inputs = sequence_inputs([[1.5, 1 / 1.5]], [1.0], [[1.0, 1.0]])
    out = policy_loss(inputs, config(surrogate="gspo", loss_agg="seq_mean_token_mean"))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0, abs=1e-6)
    torch.testing.assert_close(inputs.logprobs.grad, torch.tensor([[-0.5, -0.5]]), atol=1e-6, rtol=0)
    assert out.metrics["clip_frac"] == 0.0
    token_level = sequence_inputs([[1.5, 1 / 1.5]], [1.0], [[1.0, 1.0]])
    policy_loss(token_level, config(loss_agg="seq_mean_token_mean")).loss.backward()
    assert token_level.logprobs.grad[0, 0].item() == 0.0  # PPO's token clip drops the first token's gradient


def test_gspo_on_policy_equals_grpo() -> None:
    grpo, gspo = on_policy(**AGG_2x3), on_policy(**AGG_2x3)  # type: ignore[arg-type]
    a = policy_loss(grpo, config(loss_agg="seq_mean_token_mean"))
    b = policy_loss(gspo, config(surrogate="gspo", loss_agg="seq_mean_token_mean"))
    a.loss.backward()
    b.loss.backward()
    assert a.loss.item() == pytest.approx(b.loss.item(), abs=1e-6)
    torch.testing.assert_close(grpo.logprobs.grad, gspo.logprobs.grad, atol=1e-6, rtol=0)


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    inputs = clip_inputs(1.0)  # ratios 0.5, 0.9, 1.1, 1.5 at logprob log(r) - 1
    out = policy_loss(inputs, config(surrogate="cispo", clip_eps=0.2, clip_eps_high=0.28))
    out.loss.backward()
    weights = torch.tensor([[0.8, 0.9, 1.1, 1.28]])  # clip(r, 0.8, 1.28), detached
    # d(-w A logp)/d logp = -w A, over 4 tokens (token_mean); PPO gives the 1.5 token no gradient, CISPO -1.28 / 4
    torch.testing.assert_close(inputs.logprobs.grad, -weights / 4, atol=1e-6, rtol=0)
    expected = -(weights * inputs.logprobs.detach()).sum().item() / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert (out.metrics["clip_low_frac"], out.metrics["clip_high_frac"]) == (0.25, 0.25)


def test_cispo_applies_the_truncated_importance_weight() -> None:
    old = torch.tensor([[-1.0, -1.0]])
    behaviour = old - torch.tensor([[0.5, 3.0]]).log()  # old/behaviour 0.5 and 3 -> capped at 2
    lp = old.clone().requires_grad_(True)
    out = policy_loss(LossInputs(lp, old, behaviour, torch.tensor([2.0]), torch.ones(1, 2)),
                      config(surrogate="cispo", tis_cap=2.0))
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 * 2 / 2, -2.0 * 2 / 2]]), atol=1e-6, rtol=0)


def _straightforward(surrogate: str, lp: Tensor, old: Tensor, beh: Tensor, adv: Tensor, mask: Tensor,
                     cfg: LossConfig) -> Tensor:
    """The papers' formulas written as loops over sequences and tokens, with the same aggregation."""
    per_sequence = []
    for i in range(lp.shape[0]):
        tokens = [t for t in range(lp.shape[1]) if mask[i, t] > 0]
        w = [min(math.exp(old[i, t] - beh[i, t]), cfg.tis_cap) for t in tokens]
        if surrogate == "gspo":
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in tokens) / len(tokens))
            w_seq = math.exp(sum(math.log(x) for x in w) / len(tokens))
            clipped = s.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
            per_sequence.append(-w_seq * torch.minimum(s * adv[i], clipped * adv[i]) * len(tokens))
        else:  # cispo: token terms, summed here and divided by the token count below
            ratios = [float(torch.exp(lp[i, t].detach() - old[i, t])) for t in tokens]
            weights = [min(max(r, 1 - cfg.clip_eps), 1 + cfg.clip_eps_high) for r in ratios]
            terms = [-w[k] * weights[k] * adv[i] * lp[i, t] for k, t in enumerate(tokens)]
            per_sequence.append(sum(terms))
    if surrogate == "gspo":  # seq_mean_token_mean: each sequence's mean, then the mean over sequences
        return sum(p / mask[i].sum() for i, p in enumerate(per_sequence)) / lp.shape[0]
    return sum(per_sequence) / mask.sum()  # token_mean


@pytest.mark.parametrize(("surrogate", "loss_agg"), [("gspo", "seq_mean_token_mean"), ("cispo", "token_mean")])
def test_surrogates_match_a_straightforward_implementation(surrogate: str, loss_agg: str) -> None:
    gen = torch.Generator().manual_seed(7)
    B, T = 5, 6
    old = -torch.rand(B, T, generator=gen) * 3
    lp = (old + torch.randn(B, T, generator=gen) * 0.6).requires_grad_(True)
    beh = old + torch.randn(B, T, generator=gen) * 0.5
    adv = torch.randn(B, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    cfg = config(surrogate=surrogate, loss_agg=loss_agg, clip_eps=0.05, clip_eps_high=0.08, tis_cap=1.5)
    out = policy_loss(LossInputs(lp, old, beh, adv, mask), cfg)
    (grad,) = torch.autograd.grad(out.loss, lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    reference = _straightforward(surrogate, lp2, old, beh, adv, mask, cfg)
    reference.backward()
    assert out.loss.item() == pytest.approx(float(reference.detach()), abs=1e-5)
    torch.testing.assert_close(grad, lp2.grad, atol=1e-5, rtol=1e-4)
    assert out.metrics["clip_frac"] > 0  # the random ratios reach the clip bounds, so both paths are exercised
