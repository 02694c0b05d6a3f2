"""Losses of multi-turn samples: only the policy's tokens (loss_mask) count.

- A single-turn sample (no loss_mask) trains exactly as one whose mask marks every completion token,
  under each kind of aggregation and ratio: the mask path reduces to the single-turn path bit for bit.
- Environment tokens change nothing in a step: their behaviour log-probs and the environment tokens
  after the last action can be anything, the update and every metric stay identical; a policy
  token's behaviour log-prob does change them (the check can fail).
- The token normaliser and the `tokens` metric count the policy's tokens only.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec.config import JobSpec, OptimConfig
from fleetrl.train.batch import build_batch, episode_metrics, group_advantages, policy_tokens
from fleetrl.train.losses import loss_config_for
from fleetrl.train.optim import build_scheduler, train_step
from tests.learner.test_losses import random_groups, tiny_model

ALGORITHMS = ["grpo", "dapo", "gspo"]
"""Token ratios with per-sequence means (grpo, with KL and entropy), token means (dapo), sequence ratios (gspo)."""


def step(groups: list[common_pb2.Group], name: str, kl_coef: float = 0.0) -> tuple[dict[str, float], torch.Tensor]:
    """One train_step (micro-batches of 2) from the same tiny model; (metrics, parameters)."""
    spec = JobSpec(prompts="p.jsonl", reward={"builtin": "numeric_match"},  # type: ignore[arg-type]
                   algorithm={"name": name, "kl_coef": kl_coef, "entropy_coef": 0.01},  # type: ignore[arg-type]
                   rollout={"max_new_tokens": 16},  # type: ignore[arg-type]
                   train={"micro_batch_samples": 2})  # type: ignore[arg-type]
    model = tiny_model()
    ref = tiny_model() if kl_coef else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = build_scheduler(optimizer, OptimConfig(learning_rate=0.5), 10)
    metrics = train_step(model, optimizer, scheduler, groups, loss_config_for(spec), spec, ref)
    timings = ("forward_backward_s", "optimizer_s")
    return ({k: v for k, v in metrics.items() if k not in timings and not k.endswith("_s")},
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_single_turn_trains_exactly_as_an_all_true_mask(name: str) -> None:
    groups = random_groups(5, behaviour_noise=0.3)
    masked = copy.deepcopy(groups)
    for sample in (s for g in masked for s in g.samples):
        sample.loss_mask.extend([True] * len(sample.completion_token_ids))
    plain_metrics, plain_params = step(groups, name, kl_coef=0.05)
    mask_metrics, mask_params = step(masked, name, kl_coef=0.05)
    assert plain_metrics == mask_metrics
    assert torch.equal(plain_params, mask_params)


def episode_groups(seed: int, garbage: float = 0.0, tail: int = 0) -> list[common_pb2.Group]:
    """3 groups of 3 two-turn episodes on the 16-token vocabulary: action, observation, action, observation.

    garbage: behaviour log-prob written at every environment position; tail: added to the ids of
    the observation after the last action (never context of a policy token)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(3):
        prompt = torch.randint(2, 16, (2 + g,), generator=gen).tolist()
        group = common_pb2.Group(task_id=f"0/{g}")
        for _ in range(3):
            parts = [(int(torch.randint(1, 4, (1,), generator=gen)), True), (3, False),
                     (int(torch.randint(1, 4, (1,), generator=gen)), True), (2, False)]
            sample = common_pb2.Sample(prompt_token_ids=prompt, reward=float(torch.randint(0, 2, (1,), generator=gen)),
                                       episode_status=common_pb2.EPISODE_STATUS_MAX_TURNS)
            for index, (length, policy) in enumerate(parts):
                ids = torch.randint(0, 16, (length,), generator=gen).tolist()
                logprobs = (-2.0 + 0.3 * torch.randn(length, generator=gen)).tolist()
                if policy:
                    start = len(sample.completion_token_ids)
                    sample.turns.append(common_pb2.Turn(start=start, end=start + length, env_latency_s=0.5))
                else:
                    logprobs = [garbage] * length
                    if index == len(parts) - 1:
                        ids = [(i + tail) % 16 for i in ids]
                sample.completion_token_ids.extend(ids)
                sample.behaviour_logprobs.extend(logprobs)
                sample.loss_mask.extend([policy] * length)
            group.samples.append(sample)
        groups.append(group)
    return groups


@pytest.mark.parametrize("name", ALGORITHMS)
def test_environment_tokens_change_nothing(name: str) -> None:
    base_metrics, base_params = step(episode_groups(6), name)
    other_metrics, other_params = step(episode_groups(6, garbage=-7.5, tail=5), name)
    assert base_metrics == other_metrics
    assert torch.equal(base_params, other_params)
    moved = episode_groups(6)
    moved[0].samples[0].behaviour_logprobs[0] -= 1.0  # a policy token's behaviour log-prob does count
    moved_metrics, moved_params = step(moved, name)
    assert moved_metrics["tis_weight_mean"] != base_metrics["tis_weight_mean"] or not torch.equal(moved_params,
                                                                                                  base_params)


def test_policy_tokens_are_the_normaliser_and_the_metric() -> None:
    groups = episode_groups(7)
    samples = [s for g in groups for s in g.samples]
    policy = sum(policy_tokens(s) for s in samples)
    assert policy == sum(t.end - t.start for s in samples for t in s.turns) < sum(len(s.completion_token_ids)
                                                                                  for s in samples)
    cfg = loss_config_for(JobSpec(prompts="p", reward={"builtin": "numeric_match"}))  # type: ignore[arg-type]
    batch = build_batch(groups, group_advantages(groups, cfg), pad_id=0)
    assert batch.num_tokens == policy
    metrics, _ = step(groups, "grpo")
    assert metrics["tokens"] == policy
    assert episode_metrics(groups) == {"episode/turns_mean": 2.0, "episode/env_step_s_mean": 0.5,
                                       "episode/done_frac": 0.0, "episode/max_turns_frac": 1.0,
                                       "episode/truncated_frac": 0.0, "episode/env_error_frac": 0.0}
    assert episode_metrics(random_groups(1)) == {}


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_agent_segments_share_their_episode_advantage(advantage: str) -> None:
    """An agent episode split into segments (`continues`) counts once in its group's baseline, and each of
    its segments gets the episode's advantage: the same advantages as the group without the extra segments."""

    class Config:
        pass

    cfg = Config()
    cfg.advantage = advantage  # type: ignore[attr-defined]
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 0.5]
    continues = [False, True, True, False, False, False]  # episodes: [0], [1, 2, 3], [4], [5]
    group = common_pb2.Group(samples=[common_pb2.Sample(reward=r, continues=c) for r, c in zip(rewards, continues,
                                                                                               strict=True)])
    plain = common_pb2.Group(samples=[common_pb2.Sample(reward=r) for r in (1.0, 0.0, 2.0, 0.5)])
    (segmented,), (episodes,) = group_advantages([group], cfg), group_advantages([plain], cfg)  # type: ignore[arg-type]
    assert segmented.tolist() == [episodes[0], episodes[1], episodes[1], episodes[1], episodes[2], episodes[3]]
    assert len(set(segmented.tolist())) > 1  # the check can fail: not every advantage is the same
