"""Shared prompts: a micro-batch computed with each shared prompt once (batch.PackedRows) scores every
completion token as the padded layout does, gradients included, and the cost model picks the cheaper layout."""

from __future__ import annotations

import copy

import pytest
import torch
from test_losses import random_groups, tiny_model
from transformers import LlamaConfig

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec.config import JobSpec
from fleetrl.train import optim
from fleetrl.train.batch import (
    TrainBatch,
    attention_cost_ratio,
    build_batch,
    completion_forward,
    completion_logprobs,
    group_advantages,
    micro_batches,
    share_prompts,
)
from fleetrl.train.critic import ActorCritic, value_head
from fleetrl.train.losses import loss_config_for

ALWAYS = 0.0
"""A cost ratio that makes packing cheaper whenever a prompt is shared (attention counted free)."""


def spec(**train: object) -> JobSpec:
    return JobSpec(prompts="p.jsonl", reward={"builtin": "numeric_match"},  # type: ignore[arg-type]
                   algorithm={"name": "grpo", "kl_coef": 0.1}, train=train)  # type: ignore[arg-type]


def multi_turn(groups: list[common_pb2.Group]) -> list[common_pb2.Group]:
    """The groups with a loss mask that hides every third completion token (environment tokens)."""
    for group in groups:
        for sample in group.samples:
            sample.loss_mask[:] = [int(i % 3 != 1) for i in range(len(sample.completion_token_ids))]
    return groups


def batch_of(groups: list[common_pb2.Group]) -> TrainBatch:
    return build_batch(groups, group_advantages(groups, loss_config_for(spec())), pad_id=0)


def weighted_loss(model: torch.nn.Module, batch: TrainBatch, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    logprobs, entropy = completion_logprobs(model, batch, 0.8, entropy=True, entropy_grad=True)
    assert entropy is not None
    mask = batch.completion_mask
    ((logprobs * weights + entropy * weights.flip(1)) * mask).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return logprobs.detach() * mask, entropy.detach() * mask, grads


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("turns", ["single", "multi"])
def test_packed_rows_score_and_differentiate_like_the_padded_layout(kernel: str, turns: str) -> None:
    model = tiny_model()
    model.set_attn_implementation(kernel)
    groups = random_groups(11)
    batch = batch_of(multi_turn(groups) if turns == "multi" else groups)
    packed = share_prompts(batch, ALWAYS)
    assert packed.packed is not None and packed.packed.input_ids.shape[0] == 3  # one row per group
    assert packed.packed.input_ids.numel() < batch.input_ids.numel()
    weights = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(0))
    want = weighted_loss(model, batch, weights)
    got = weighted_loss(model, packed, weights)
    assert batch.completion_mask.sum() > 10 and want[2].abs().max() > 1e-3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


def test_a_micro_batch_that_splits_groups_packs_its_own_runs() -> None:
    model, groups = tiny_model(), random_groups(4)
    batch = batch_of(groups)
    micros = [share_prompts(m, ALWAYS) for m in micro_batches(batch, 2)]  # 3 groups of 3 rows: 01 23 45 67 8
    assert [m.packed is not None for m in micros] == [True, False, True, True, False]
    assert micros[0].packed is not None and micros[0].packed.input_ids.shape[0] == 1
    for micro, plain in zip(micros, micro_batches(batch, 2), strict=True):
        mask = plain.completion_mask
        with torch.no_grad():
            torch.testing.assert_close(completion_logprobs(model, micro)[0] * mask,
                                       completion_logprobs(model, plain)[0] * mask, atol=2e-5, rtol=1e-4)


def test_the_critics_values_are_the_same_in_both_layouts() -> None:
    model = tiny_model()
    critic = ActorCritic(model, value_head(model.config.hidden_size))
    torch.nn.init.normal_(critic.head.weight)
    batch = batch_of(random_groups(5))
    with torch.no_grad():
        want, got = completion_forward(critic, batch), completion_forward(critic, share_prompts(batch, ALWAYS))
    assert want.state_values is not None and got.state_values is not None
    mask = batch.completion_mask
    torch.testing.assert_close(got.state_values * mask, want.state_values * mask, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.column_logits()[mask.bool()], want.column_logits()[mask.bool()], atol=2e-5,
                               rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_train_step_gives_the_same_metrics_and_weights_with_and_without_sharing(algorithm: str) -> None:
    groups = random_groups(8, behaviour_noise=0.3)
    results = []
    for share in (True, False):
        job = spec(share_prompts=share, micro_batch_samples=4, epochs_per_step=2).model_copy(
            update={"algorithm": spec().algorithm.model_copy(update={"name": algorithm, "kl_coef": 0.1})})
        cfg = loss_config_for(job)
        model = tiny_model()
        reference = copy.deepcopy(model).requires_grad_(False)
        module = model if not cfg.uses_critic else ActorCritic(model, value_head(model.config.hidden_size))
        ratio = optim.packing_cost_ratio(module)
        assert ratio is not None and share_prompts(batch_of(groups), ratio).packed is not None  # packs when on
        optimizer = optim.build_optimizer(module, job.optim)
        scheduler = optim.build_scheduler(optimizer, job.optim, 10)
        metrics = optim.train_step(module, optimizer, scheduler, groups, cfg, job, reference)
        results.append((metrics, torch.cat([p.detach().reshape(-1) for p in module.parameters()])))
    (shared, shared_weights), (plain, plain_weights) = results
    for key in shared.keys() - {"forward_backward_s", "optimizer_s"}:
        assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-5), key
    torch.testing.assert_close(shared_weights, plain_weights, atol=1e-6, rtol=1e-5)


def test_the_cost_model_packs_long_shared_prompts_and_not_long_completions() -> None:
    def group(prompt_len: int, completion_len: int, samples: int = 8) -> common_pb2.Group:
        out = common_pb2.Group(task_id="0/0")
        for _ in range(samples):
            out.samples.append(common_pb2.Sample(prompt_token_ids=[1] * prompt_len,
                                                 completion_token_ids=[2] * completion_len,
                                                 behaviour_logprobs=[-1.0] * completion_len))
        return out

    smollm2 = LlamaConfig(hidden_size=576, num_hidden_layers=30)
    smollm2._attn_implementation = "sdpa"
    ratio = attention_cost_ratio(smollm2, 106_000_000)
    assert ratio == pytest.approx(2 * 576 * 30 / 106e6)
    assert share_prompts(batch_of([group(46, 12), group(40, 12)]), ratio).packed is not None  # the demo's shape
    assert share_prompts(batch_of([group(40, 2000)]), ratio).packed is None  # one 16 k row: attention dominates
    assert share_prompts(batch_of([group(46, 12, samples=1), group(40, 12, 1)]), ratio).packed is None  # none shared
    smollm2._attn_implementation = "flash_attention_2"  # takes no 4D mask
    assert attention_cost_ratio(smollm2, 106_000_000) is None
    assert share_prompts(batch_of([group(46, 12)]), None).packed is None
