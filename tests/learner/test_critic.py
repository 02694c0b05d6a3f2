"""PPO's critic: GAE against hand-worked values and a plain reverse loop, the clipped value loss, the
critic's checkpoint round trip, published weights without the critic, and a tiny PPO job that learns."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from learner_fleet import first_word_is_seven, make_group, spec_for, tiny_policy
from nats.aio.client import Client as NATS

from fleetrl.errors import FailedPrecondition
from fleetrl.policy import models
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus
from fleetrl.train import checkpoint as ckpt
from fleetrl.train.batch import build_batch, group_rewards, micro_batches
from fleetrl.train.critic import (
    ActorCritic,
    gae,
    gae_micro_batches,
    terminal_rewards,
    value_head,
    value_loss_per_token,
    whiten,
    with_critic,
)
from fleetrl.train.losses import loss_config_for
from fleetrl.train.reference import run
from fleetrl.train.trained_policy import Policy
from fleetrl.weights.publish import WeightPublisher
from fleetrl.weights.store import WeightStore, decode_safetensors

PPO = {"name": "ppo", "gamma": 1.0, "lam": 1.0}


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny matrices: one thread is faster than a team of them fighting over 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- GAE


def test_gae_hand_worked() -> None:
    # row 0: tokens at columns 1..3, values .5 .2 .4, reward 1 at the last; gamma .9, lam .8
    #   t=3: delta = 1 - .4 = .6                       A = .6
    #   t=2: delta = .9 * .4 - .2 = .16                A = .16 + .72 * .6 = .592
    #   t=1: delta = .9 * .2 - .5 = -.32               A = -.32 + .72 * .592 = .10624
    # row 1: tokens at columns 0 and 2 (column 1 is not the policy's), values .3 . .6, reward -1
    #   t=2: delta = -1 - .6 = -1.6                    A = -1.6
    #   t=0: delta = .9 * .6 - .3 = .24                A = .24 + .72 * -1.6 = -.912
    mask = torch.tensor([[0.0, 1, 1, 1], [1, 0, 1, 0]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.4], [0.3, 9.0, 0.6, 9.0]])
    rewards = terminal_rewards(torch.tensor([1.0, -1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 1], [0, 0, -1, 0]]
    advantages, returns = gae(rewards, values * mask, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0, 0.10624, 0.592, 0.6], [-0.912, 0, -1.6, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[0, 0.60624, 0.792, 1.0], [-0.612, 0, -1.0, 0]]))


def reverse_loop_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE of one trajectory of real tokens, written as the textbook loop."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


def test_gae_matches_a_reverse_loop_over_each_rows_real_tokens() -> None:
    gen = torch.Generator().manual_seed(5)
    mask = (torch.rand(6, 9, generator=gen) > 0.35).float()
    mask[0] = 0.0  # a row with no tokens
    values = torch.randn(6, 9, generator=gen)
    rewards = torch.randn(6, 9, generator=gen) * mask
    advantages, returns = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    for row in range(6):
        real = mask[row].nonzero().flatten().tolist()
        expected = reverse_loop_gae(rewards[row, real].tolist(), values[row, real].tolist(), 0.97, 0.9)
        torch.testing.assert_close(advantages[row, real], torch.tensor(expected))
        torch.testing.assert_close(returns[row, real], torch.tensor(expected) + values[row, real])
    assert not advantages[mask == 0].any() and not returns[mask == 0].any()


def test_gamma_lam_one_and_zero_values_give_the_sequence_reward_on_every_token() -> None:
    groups = [make_group("j", f"0/{i}", 0, 3, seed=i) for i in range(2)]
    for group in groups:
        for k, sample in enumerate(group.samples):
            sample.reward = float(k) - 0.5
    cfg = loss_config_for(spec_for(algorithm={**PPO, "normalize_advantages": False}))
    model, _ = models.load("tiny-llama")
    module, _ = with_critic(model, cfg)  # a fresh head: every value is 0
    batch = build_batch(groups, [group_rewards(g) for g in groups], pad_id=0)
    micros, targets = gae_micro_batches(module, micro_batches(batch, 4), cfg)
    for micro, target in zip(micros, targets, strict=True):
        expected = micro.rewards[:, None] * micro.completion_mask  # (B, T)
        torch.testing.assert_close(micro.advantages, expected)
        torch.testing.assert_close(target.returns, expected)
        assert not target.old_values.any()


def test_whiten_uses_only_real_tokens_of_every_micro_batch() -> None:
    a, b = torch.tensor([[1.0, 100.0], [3.0, 5.0]]), torch.tensor([[7.0, -50.0]])
    ma, mb = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    out = whiten([a, b], [ma, mb])
    real = torch.tensor([1.0, 3.0, 5.0, 7.0])  # mean 4, population std sqrt(5)
    torch.testing.assert_close(torch.cat([out[0][ma > 0], out[1][mb > 0]]), (real - 4) / 5 ** 0.5)
    assert out[0][0, 1] == 0 and out[1][0, 1] == 0


# --------------------------------------------------------------------------- value loss


def test_value_loss_clipping_hand_worked() -> None:
    # old .0, return 1, clip .2: V = .5 is clipped to .2 -> .5 * (.2 - 1)^2 = .32, no gradient;
    # V = .1 stays -> .5 * .81 = .405, gradient V - R = -.9;
    # old 1, return 1, V = 1.5: clipped 1.2 errs less than 1.5, so the unclipped .125 counts, gradient .5
    values = torch.tensor([0.5, 0.1, 1.5], requires_grad=True)
    old, returns = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])
    loss, clipped = value_loss_per_token(values, old, returns, 0.2)
    torch.testing.assert_close(loss, torch.tensor([0.32, 0.405, 0.125]))
    assert clipped.tolist() == [True, False, False]
    loss.sum().backward()
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([0.0, -0.9, 0.5]))
    unclipped, none = value_loss_per_token(values.detach(), old, returns, None)
    torch.testing.assert_close(unclipped, torch.tensor([0.125, 0.405, 0.125]))
    assert not none.any()


# --------------------------------------------------------------------------- the module and the config


def test_value_head_reads_the_final_normed_hidden_state() -> None:
    model, _ = tiny_policy()
    head = value_head(32)
    torch.nn.init.normal_(head.weight)
    ids = torch.tensor([[2, 3, 4, 5, 6]])
    positions = torch.arange(1, 4)
    out = ActorCritic(model, head)(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=positions)
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, 1:4]
    assert out.state_values is not None and out.logits is not None
    torch.testing.assert_close(out.state_values, head(hidden).squeeze(-1))
    torch.testing.assert_close(out.logits, model(input_ids=ids, logits_to_keep=positions).logits)


def test_ppo_refuses_a_group_advantage_and_ppo_rloo_keeps_the_old_variant() -> None:
    with pytest.raises(ValueError, match=r"algorithm\.advantage='rloo' does not apply to ppo"):
        spec_for(algorithm={"name": "ppo", "advantage": "rloo"})
    rloo = loss_config_for(spec_for(algorithm={"name": "ppo_rloo"}))
    assert (rloo.advantage, rloo.uses_critic, rloo.surrogate, rloo.loss_agg) == ("rloo", False, "clip", "token_mean")
    ppo = loss_config_for(spec_for(algorithm={"name": "ppo"}))
    assert (ppo.advantage, ppo.uses_critic, ppo.gamma, ppo.lam, ppo.value_coef, ppo.value_clip_eps) == (
        "gae", True, 1.0, 0.95, 0.1, 0.2)


# --------------------------------------------------------------------------- checkpoint and publishing


def trained_ppo_policy() -> Policy:
    policy = Policy(spec_for(max_steps=4, algorithm={"name": "ppo"}))
    metrics = policy.step([make_group("j", f"0/{i}", 0, 3) for i in range(2)])
    assert {"value_mean", "return_mean", "value_loss", "value_clip_frac"} <= metrics.keys()
    return policy


def test_critic_round_trips_through_the_checkpoint(tmp_path: Path) -> None:
    policy = trained_ppo_policy()
    assert policy.critic is not None and policy.critic.weight.abs().sum() > 0  # the step trained it
    ckpt.save(tmp_path, policy.state(1, {}))
    assert (tmp_path / "step-00000001" / ckpt.CRITIC_FILE).is_file()
    fresh = Policy(spec_for(max_steps=4, algorithm={"name": "ppo"}))
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None
    fresh.restore(loaded)
    assert fresh.critic is not None
    for name, tensor in policy.critic.state_dict().items():
        assert torch.equal(tensor, fresh.critic.state_dict()[name]), name
    for a, b in zip(policy.optimizer.state.values(), fresh.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    group = [make_group("j", f"0/{i}", 0, 3) for i in range(2, 4)]
    before, after = policy.step(group), fresh.step(group)
    assert {k: v for k, v in before.items() if not k.endswith("_s")} == {
        k: v for k, v in after.items() if not k.endswith("_s")}  # the next step is the same step
    assert torch.equal(policy.critic.weight, fresh.critic.weight)


def test_a_checkpoint_without_a_critic_names_ppo_rloo(tmp_path: Path) -> None:
    old = Policy(spec_for(max_steps=4, algorithm={"name": "ppo_rloo"}))
    ckpt.save(tmp_path, old.state(1, {}))
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded.critic is None
    with pytest.raises(FailedPrecondition, match="ppo_rloo"):
        Policy(spec_for(max_steps=4, algorithm={"name": "ppo"})).restore(loaded)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await bus.connect(nats_url, "test-critic")
    yield client
    await client.close()


async def test_published_weights_are_exactly_the_policys_tensors(nc: NATS) -> None:
    policy = trained_ppo_policy()
    store = WeightStore(nc, bus.jetstream(nc))
    publisher = WeightPublisher(store, "job-ppo", "float32", interval=1, keep=2, lease_epoch=1)
    pointer = await publisher.publish(policy.model, 1)
    assert pointer is not None
    published = decode_safetensors(await store.pull("job-ppo", pointer))
    expected = models.state_dict_for_publish(policy.model, torch.float32)
    plain, _ = models.load("tiny-llama")
    assert published.keys() == expected.keys() == models.state_dict_for_publish(plain, torch.float32).keys()
    assert all(torch.equal(published[name], expected[name]) for name in expected)
    assert policy.critic is not None
    critic_weight = policy.critic.weight.detach().reshape(-1)
    assert not any(t.numel() == critic_weight.numel() and torch.equal(t.reshape(-1), critic_weight)
                   for t in published.values())


# --------------------------------------------------------------------------- learning


def test_a_tiny_ppo_job_learns_and_its_critic_follows_the_reward(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n"
                               for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 3), (4, 4)]))
    spec = JobSpec(
        name="ppo", prompts=str(prompts), reward={"builtin": "numeric_match"}, seed=3,
        algorithm={"name": "ppo", "value_coef": 0.5, "value_learning_rate": 0.02}, optim={"learning_rate": 0.03},
        rollout={"prompts_per_step": 4, "samples_per_prompt": 8, "max_new_tokens": 2, "chat_template": False},
        train={"max_steps": 10, "micro_batch_samples": 16},
    )
    model, tokenizer = tiny_policy()
    history = run(spec, model, tokenizer, first_word_is_seven, steps=10)
    rewards, values = [m["reward_mean"] for m in history], [m["value_mean"] for m in history]
    print("ppo reward_mean:", " ".join(f"{r:.2f}" for r in rewards))
    print("ppo value_mean: ", " ".join(f"{v:.2f}" for v in values))
    assert sum(rewards[:2]) / 2 < 0.3, rewards  # about 1/15 for a near-uniform policy
    assert sum(rewards[-3:]) / 3 > 0.8, rewards
    assert values[0] == 0.0  # the head starts at 0
    assert abs(values[-1] - rewards[-1]) < 0.2, (values, rewards)  # the critic has learned the return
