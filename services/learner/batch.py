"""Groups from replay -> padded training tensors, micro-batches, and completion log-probs.

Layout choice: each row is `prompt ++ completion`, RIGHT-padded, so every real token sits at its
true position 0..len-1 and causal attention never sees padding. Only the positions that can
predict a completion token are kept: with `start = min(prompt_len) - 1` over the batch, column t
of every (B, T) tensor is the prediction made at position `start + t` of the token
`input_ids[:, start + t + 1]`, where T = L - 1 - start. `completion_mask` marks the columns whose
target is a policy token: every completion token of a single-turn sample, and the tokens a
multi-turn sample's `loss_mask` marks (its environment tokens are context only, so the losses, KL,
entropy and every aggregation count the policy's tokens alone). The model is asked for just those
T logits (`logits_to_keep` as positions), which keeps the (B, T, vocab) tensor as small as the
completions, and `logprobs.token_logprobs` reduces it to log-probs without full-vocabulary copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from services.learner.logprobs import token_logprobs
from services.learner.losses import LossConfig, compute_group_advantages
from services.proto.fleetrl.v1 import common_pb2


@dataclass
class TrainBatch:
    """A padded (micro-)batch of B sequences; see the module docstring for the column alignment."""

    input_ids: Tensor  # (B, L) long, prompt ++ completion, right-padded
    attention_mask: Tensor  # (B, L) long, 1 for real tokens
    start: int  # column t of (B, T) tensors predicts input_ids[:, start + t + 1]
    completion_mask: Tensor  # (B, T) float, 1 where the target is a real completion token
    behaviour_logprobs: Tensor  # (B, T) float, actor's log-probs at completion columns, 0 elsewhere
    advantages: Tensor  # (B,) float
    rewards: Tensor  # (B,) float
    prompt_lens: Tensor  # (B,) long
    completion_lens: Tensor  # (B,) long

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> TrainBatch:
        """The batch with its tensors on `device` (the model's: batches are built on the CPU)."""
        return TrainBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.start, self.completion_mask.to(device),
            self.behaviour_logprobs.to(device), self.advantages.to(device), self.rewards.to(device),
            self.prompt_lens.to(device), self.completion_lens.to(device),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


def group_rewards(group: common_pb2.Group) -> Tensor:
    """Rewards (G,) of a group's samples, in sample order."""
    return torch.tensor([sample.reward for sample in group.samples], dtype=torch.float32)


def group_advantages(groups: list[common_pb2.Group], cfg: LossConfig) -> list[Tensor]:
    """Per group, the advantages (G,) of its samples under cfg.advantage."""
    return [compute_group_advantages(group_rewards(group), cfg.advantage) for group in groups]


def component_means(groups: list[common_pb2.Group]) -> dict[str, float]:
    """`reward/<name>`: the mean of each named reward component (e.g. correct, format) over the
    samples that report it, so a step's metrics show what the scalar reward is made of."""
    values: dict[str, list[float]] = {}
    for sample in (s for group in groups for s in group.samples):
        for name, value in sample.reward_components.items():
            values.setdefault(name, []).append(value)
    return {f"reward/{name}": sum(v) / len(v) for name, v in sorted(values.items())}


def policy_tokens(sample: common_pb2.Sample) -> int:
    """Tokens of a sample the policy generated (what its losses count)."""
    return sum(sample.loss_mask) if len(sample.loss_mask) else len(sample.completion_token_ids)


def episode_metrics(groups: list[common_pb2.Group]) -> dict[str, float]:
    """`episode/*` of a step's multi-turn samples (none for single-turn ones): turns per episode, the
    fraction of episodes ending each way, and the mean environment step latency."""
    episodes = [s for group in groups for s in group.samples if s.episode_status]
    if not episodes:
        return {}
    turns = [t for s in episodes for t in s.turns]
    out = {"episode/turns_mean": len(turns) / len(episodes),
           "episode/env_step_s_mean": sum(t.env_latency_s for t in turns) / max(1, len(turns))}
    for status in ("done", "max_turns", "truncated", "env_error"):
        number = common_pb2.EpisodeStatus.Value(f"EPISODE_STATUS_{status.upper()}")
        out[f"episode/{status}_frac"] = sum(s.episode_status == number for s in episodes) / len(episodes)
    return out


def has_signal(group: common_pb2.Group) -> bool:
    """False when every sample of the group has the same reward (no GRPO signal)."""
    rewards = group_rewards(group)
    return bool((rewards != rewards[0]).any())


def build_batch(groups: list[common_pb2.Group], advantages_per_group: list[Tensor], pad_id: int) -> TrainBatch:
    """Every sample of every group as one padded batch, in group then sample order."""
    samples = [sample for group in groups for sample in group.samples]
    advantages = torch.cat([adv.to(torch.float32).reshape(-1) for adv in advantages_per_group])
    prompt_lens = torch.tensor([len(s.prompt_token_ids) for s in samples], dtype=torch.long)
    completion_lens = torch.tensor([len(s.completion_token_ids) for s in samples], dtype=torch.long)
    length = int((prompt_lens + completion_lens).max())
    start = int(prompt_lens.min()) - 1
    width = length - 1 - start
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    completion_mask = torch.zeros((len(samples), width), dtype=torch.float32)
    behaviour = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, sample in enumerate(samples):
        tokens = [*sample.prompt_token_ids, *sample.completion_token_ids]
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
        first = len(sample.prompt_token_ids) - 1 - start  # column predicting the first completion token
        count = len(sample.completion_token_ids)
        if len(sample.loss_mask):
            completion_mask[row, first : first + count] = torch.tensor(list(sample.loss_mask), dtype=torch.float32)
        else:
            completion_mask[row, first : first + count] = 1.0
        behaviour[row, first : first + count] = torch.tensor(list(sample.behaviour_logprobs), dtype=torch.float32)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return TrainBatch(
        input_ids, attention_mask, start, completion_mask, behaviour, advantages, rewards, prompt_lens, completion_lens
    )


def select_rows(batch: TrainBatch, rows: slice) -> TrainBatch:
    """Rows of a batch, with the padding columns that no selected row needs trimmed away."""
    prompt_lens, completion_lens = batch.prompt_lens[rows], batch.completion_lens[rows]
    length = int((prompt_lens + completion_lens).max())
    start = int(prompt_lens.min()) - 1
    offset, width = start - batch.start, length - 1 - start
    columns = slice(offset, offset + width)
    return TrainBatch(
        input_ids=batch.input_ids[rows, :length],
        attention_mask=batch.attention_mask[rows, :length],
        start=start,
        completion_mask=batch.completion_mask[rows, columns],
        behaviour_logprobs=batch.behaviour_logprobs[rows, columns],
        advantages=batch.advantages[rows],
        rewards=batch.rewards[rows],
        prompt_lens=prompt_lens,
        completion_lens=completion_lens,
    )


def micro_batches(batch: TrainBatch, micro_batch_samples: int) -> list[TrainBatch]:
    """Consecutive slices of at most micro_batch_samples rows, each trimmed to its own padding."""
    size, step = batch.num_sequences, micro_batch_samples
    return [select_rows(batch, slice(i, min(i + step, size))) for i in range(0, size, step)]


def completion_forward(model: torch.nn.Module, batch: TrainBatch) -> Any:
    """The model's output at the batch's T predicting positions: `logits` (B, T, V), and
    `state_values` (B, T) when the model is a `critic.ActorCritic`."""
    width = batch.input_ids.shape[1]
    positions = torch.arange(batch.start, width - 1, device=batch.input_ids.device)  # (T,)
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=positions,
                 use_cache=False)


def completion_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0, *, entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(log-probs (B, T), entropy (B, T) or None) of the batch's target tokens under softmax(logits / temperature).

    The actor samples at `temperature`, so these are the log-probs of the same distribution as its
    behaviour log-probs. Columns outside completion_mask hold values of prompt or padding tokens;
    callers mask them. The model computes logits only at the T predicting positions, and
    `logprobs.token_logprobs` reduces them in chunks; the entropy is computed when `entropy` is
    set and is differentiable only with `entropy_grad`.
    """
    out = completion_forward(model, batch)
    return target_logprobs(out.logits, batch, temperature, entropy=entropy, entropy_grad=entropy_grad)


def target_logprobs(
    logits: Tensor, batch: TrainBatch, temperature: float, *, entropy: bool, entropy_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of the batch's targets (B, T) under the logits (B, T, V) of `completion_forward`."""
    targets = batch.input_ids[:, batch.start + 1 :]  # (B, T)
    return token_logprobs(logits, targets, temperature, entropy=entropy, entropy_grad=entropy_grad)
