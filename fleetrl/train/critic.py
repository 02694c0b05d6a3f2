"""PPO's critic: a value head on the policy's trunk, GAE over completion tokens, the clipped value loss.

Design choice: the critic is one linear layer (hidden_size -> 1, zero-initialised so every value
starts at 0) on the policy's final hidden state, not a second model. It costs one extra no-grad
forward per step (the values the step's advantages are computed from) and hidden_size + 1 weights;
a separate critic model would double the learner's memory and compute. The value loss's gradient
reaches the shared trunk, weighted by `value_coef`. The head lives outside the policy model
(`ActorCritic` holds both), so everything that reads the policy model (weight publishing, export,
the checkpoint's model.safetensors) never sees it; the checkpoint stores it as critic.safetensors.

Per step (`gae_micro_batches`, before the policy passes): V_old = values of the step's batch under
the weights at the start of the step; the sequence's reward r comes at its last real completion
token; GAE over the real completion tokens of each row, in order (columns outside the mask are
skipped, so a multi-turn row whose mask has gaps is one trajectory):

    delta_t = r_t + gamma * V_old(t+1) - V_old(t)        (V_old after the last token = 0)
    A_t     = delta_t + gamma * lam * A_(t+1)
    R_t     = A_t + V_old(t)                               (the value target)

then, if `normalize_advantages`, A is whitened over the real tokens of the step's trainable groups
(under data parallelism the ranks add their sums in one all_reduce, so every rank whitens alike).
The loss of every pass (`actor_critic_loss`) is the policy loss on the token advantages plus

    value_coef * agg( 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -value_clip_eps, value_clip_eps) - R)^2) )

aggregated by the job's `loss_agg` over the step's token and sequence counts, like the policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from fleetrl.train.batch import TrainBatch, completion_forward
from fleetrl.train.losses import LOSS_AGGREGATIONS, LossConfig, LossInputs, LossOutputs, policy_loss

WHITEN_EPS = 1e-8
"""Added to the variance when whitening advantages, so a constant batch gives 0, not NaN."""

CRITIC_TOKEN_MEANS = ("value_mean", "return_mean", "value_loss", "value_clip_frac", "advantage_raw_mean")
"""Token-mean metrics a ppo step reports besides the policy loss's (before whitening for the advantage)."""


def value_head(hidden_size: int) -> nn.Linear:
    """The critic: hidden state (..., H) -> value (..., 1), zero-initialised (every value starts at 0)."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


@dataclass
class ValuedOutput(ModelOutput):  # type: ignore[misc]  # transformers' ModelOutput is untyped
    """ActorCritic's output: the policy's logits and the critic's values at the kept positions."""

    logits: Tensor | None = None  # (B, T, V)
    state_values: Tensor | None = None  # (B, T) float32 (not `values`: ModelOutput is a dict)


class ActorCritic(nn.Module):
    """The policy model and the value head on its final hidden state, one module (DDP wraps both)."""

    policy: PreTrainedModel
    head: nn.Linear

    def __init__(self, policy: PreTrainedModel, head: nn.Linear) -> None:
        super().__init__()
        self.policy = policy
        self.head = head

    def forward(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: Tensor,
                use_cache: bool = False, position_ids: Tensor | None = None) -> ValuedOutput:
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                          use_cache=use_cache, position_ids=position_ids, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, logits_to_keep]  # (B, T, H), after the final norm
        return ValuedOutput(logits=out.logits, state_values=self.head(hidden.float()).squeeze(-1))


def with_critic(model: PreTrainedModel, cfg: LossConfig) -> tuple[nn.Module, nn.Linear | None]:
    """(the module train_step drives, the value head): ActorCritic and its new head when cfg trains a
    critic, else the model itself and None."""
    if not cfg.uses_critic:
        return model, None
    head = value_head(model.config.hidden_size).to(model.device)
    return ActorCritic(model, head), head


# --------------------------------------------------------------------------- GAE


def terminal_rewards(rewards_B: Tensor, mask: Tensor) -> Tensor:
    """(B, T): each row's reward at its last real token (mask (B, T)), 0 elsewhere."""
    T = mask.shape[1]
    last = T - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)  # (B,) column of the last real token
    out = torch.zeros_like(mask, dtype=torch.float32)
    has_tokens = mask.sum(1) > 0
    out[has_tokens, last[has_tokens]] = rewards_B[has_tokens].float()
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages (B, T), returns (B, T)) by GAE over the masked columns of each row, 0 elsewhere.

    rewards, values, mask: (B, T). A column outside the mask is not a step of the trajectory: the
    recursion carries the next real token's value and advantage across it.
    """
    B, T = mask.shape
    next_value = torch.zeros(B, dtype=torch.float32, device=mask.device)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros((B, T), dtype=torch.float32, device=mask.device)
    for t in reversed(range(T)):
        real = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(real, adv, 0.0)
        next_value = torch.where(real, values[:, t], next_value)
        next_adv = torch.where(real, adv, next_adv)
    returns = (advantages + values) * (mask > 0)
    return advantages, returns


def whiten(advantages: list[Tensor], masks: list[Tensor], *, counted: bool = True) -> list[Tensor]:
    """Each (B_i, T_i) tensor minus the mean, over the (population) std, of the masked entries of all
    of them; under data parallelism, of every rank's (one all_reduce). A rank with `counted` False
    (an empty share training a stand-in at loss scale 0) adds nothing to the statistics."""
    values = torch.cat([a[m > 0] for a, m in zip(advantages, masks, strict=True)]).double()
    count = torch.tensor(float(values.numel()), dtype=values.dtype, device=values.device)
    stats = torch.stack([values.sum(), values.square().sum(), count])
    stats = stats * float(counted)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    total, squares, count = stats.tolist()
    mean = total / max(count, 1.0)
    var = max(squares / max(count, 1.0) - mean * mean, 0.0)
    scale = (var + WHITEN_EPS) ** -0.5
    return [(a - mean) * scale * (m > 0) for a, m in zip(advantages, masks, strict=True)]


@dataclass
class ValueTargets:
    """What the value loss of one micro-batch compares against, from the step's no-grad pass."""

    old_values: Tensor  # (B, T) values at the start of the step
    returns: Tensor  # (B, T) GAE returns
    raw_advantages: Tensor  # (B, T) before whitening, for the metrics


def gae_micro_batches(
    module: nn.Module, micros: list[TrainBatch], cfg: LossConfig, *, counted: bool = True
) -> tuple[list[TrainBatch], list[ValueTargets]]:
    """The micro-batches with token advantages (B, T) in place of their rewards, and their value targets.

    The rows' `advantages` on entry are ignored; their `rewards` are placed at the last real token.
    The values come from the module itself, not its DDP wrapper (a no-grad pass needs no collective);
    `counted`: see `whiten`."""
    module = module.module if isinstance(module, DistributedDataParallel) else module
    old_values, raw, returns = [], [], []
    with torch.no_grad():
        for micro in micros:
            state_values = completion_forward(module, micro).state_values
            assert state_values is not None  # an ActorCritic's forward has them
            values = state_values * micro.completion_mask  # (B, T)
            adv, ret = gae(terminal_rewards(micro.rewards, micro.completion_mask), values, micro.completion_mask,
                           cfg.gamma, cfg.lam)
            old_values.append(values)
            raw.append(adv)
            returns.append(ret)
    masks = [micro.completion_mask for micro in micros]
    advantages = whiten(raw, masks, counted=counted) if cfg.normalize_advantages else raw
    trained = [replace(micro, advantages=adv) for micro, adv in zip(micros, advantages, strict=True)]
    return trained, [ValueTargets(v, r, a) for v, r, a in zip(old_values, returns, raw, strict=True)]


# --------------------------------------------------------------------------- loss


def value_loss_per_token(values: Tensor, old_values: Tensor, returns: Tensor,
                         clip_eps: float | None) -> tuple[Tensor, Tensor]:
    """(loss (B, T), clipped (B, T) bool): 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old +
    clip(V - V_old, -clip_eps, clip_eps); clip_eps None gives 0.5 * (V - R)^2."""
    unclipped = (values - returns).square()
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(values, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def actor_critic_loss(inputs: LossInputs, values: Tensor, targets: ValueTargets, cfg: LossConfig) -> LossOutputs:
    """policy_loss on the token advantages + value_coef * the clipped value loss, aggregated alike."""
    out = policy_loss(inputs, cfg)
    mask = inputs.mask.to(values.dtype)
    vf_BT, clipped = value_loss_per_token(values, targets.old_values, targets.returns, cfg.value_clip_eps)
    vf = LOSS_AGGREGATIONS[cfg.loss_agg](vf_BT, replace(inputs, mask=mask), cfg)
    loss = out.loss + cfg.value_coef * vf
    tokens = mask.sum().clamp(min=1)

    def mean(x: Tensor) -> float:
        return float((x.detach().float() * mask).sum() / tokens)

    out.metrics.update(loss=float(loss.detach()), value_mean=mean(values), return_mean=mean(targets.returns),
                       value_loss=mean(vf_BT), value_clip_frac=mean(clipped), advantage_raw_mean=mean(
                           targets.raw_advantages))
    return LossOutputs(loss=loss, metrics=out.metrics)
