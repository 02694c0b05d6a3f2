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

Shared prompts (`share_prompts`, on unless `train.share_prompts` is off): a group's samples share
their prompt, and the padded layout computes it once per sample. When it is cheaper, a micro-batch
is computed as `PackedRows` instead: the consecutive rows that share a prompt become one row, the
prompt once and then each completion, every completion at its true positions (prompt_len ..) and
seeing only the prompt and itself (a 4D attention mask), so each token's hidden state is what the
padded layout computes, up to float rounding. The logits kept are gathered back into the (B, T)
layout above, so everything downstream is unchanged. On the demo's batch (4 prompts of ~46 tokens,
8 completions of 12 each) the forward computes 568 tokens instead of 1856. Cost model (per micro-
batch, the cheaper layout wins): rows x width x (1 + r x width), r = 2 x hidden x layers / body
parameters (attention's score and value products per query-key pair against the linear layers per
token, both as computed: padding and masked pairs included). Long completions make the packed row
long and its attention quadratic, which is where the padded layout wins. Attention kernels that
take no arbitrary mask (flash-attention) keep the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from fleetrl.policy.logprobs import token_logprobs
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.train.losses import LossConfig, compute_group_advantages


@dataclass
class PackedRows:
    """A micro-batch with each shared prompt once (module docstring): R packed rows of width W."""

    input_ids: Tensor  # (R, W) long, prompt ++ completion ++ completion ..., right-padded
    position_ids: Tensor  # (R, W) long, every token's position in its own sequence
    attention_mask: Tensor  # (R, 1, W, W) bool, True where a query may attend a key
    keep: Tensor  # (K,) long, the packed positions whose logits are computed
    index: Tensor  # (B, T) long, where column t of sample b is in the (R * K) kept positions

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(self.input_ids.to(device), self.position_ids.to(device), self.attention_mask.to(device),
                          self.keep.to(device), self.index.to(device))


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
    packed: PackedRows | None = None  # the shared-prompt layout the forward uses, when it is cheaper

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> TrainBatch:
        """The batch with its tensors on `device` (the model's: batches are built on the CPU)."""
        return TrainBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.start, self.completion_mask.to(device),
            self.behaviour_logprobs.to(device), self.advantages.to(device), self.rewards.to(device),
            self.prompt_lens.to(device), self.completion_lens.to(device),
            None if self.packed is None else self.packed.to(device),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


def group_rewards(group: common_pb2.Group) -> Tensor:
    """Rewards (G,) of a group's samples, in sample order."""
    return torch.tensor([sample.reward for sample in group.samples], dtype=torch.float32)


def episode_ends(group: common_pb2.Group) -> list[int]:
    """The index of each episode's last sample: consecutive samples linked by `continues` are the
    segments of one agent episode (the group's last sample ends one whatever it says); every other
    sample is an episode of its own."""
    last = len(group.samples) - 1
    return [i for i, sample in enumerate(group.samples) if not sample.continues or i == last]


def group_advantages(groups: list[common_pb2.Group], cfg: LossConfig) -> list[Tensor]:
    """Per group, the advantages (G,) of its samples under cfg.advantage. The baseline counts each
    episode once: an episode's segments share its reward and get its advantage."""
    advantages = []
    for group in groups:
        rewards, ends = group_rewards(group), episode_ends(group)
        per_episode = compute_group_advantages(rewards[ends], cfg.advantage)
        segments = torch.tensor([end - start for start, end in zip([-1, *ends], ends, strict=False)])
        advantages.append(per_episode.repeat_interleave(segments))
    return advantages


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


def micro_batches(batch: TrainBatch, micro_batch_samples: int, micro_batch_tokens: int = 0) -> list[TrainBatch]:
    """Consecutive slices of at most micro_batch_samples rows, each trimmed to its own padding. With
    micro_batch_tokens, a slice also holds at most that many padded tokens (its rows times its longest
    row), which is what bounds a forward's activations and logits; a row longer than the budget is a
    slice of its own. Slices keep the batch's order, so a group's rows stay together (share_prompts)."""
    lengths = (batch.prompt_lens + batch.completion_lens).tolist()
    slices, first, longest = [], 0, 0
    for row, length in enumerate(lengths):
        rows, widest = row - first + 1, max(longest, length)
        if row > first and (rows > micro_batch_samples or 0 < micro_batch_tokens < rows * widest):
            slices.append(slice(first, row))
            first, widest = row, length
        longest = widest
    slices.append(slice(first, len(lengths)))
    return [select_rows(batch, rows) for rows in slices]


ATTENTION_MASK_DTYPES = {"sdpa": torch.bool, "eager": torch.float32}
"""The attention kernels a packed row's 4D mask can be given to, and the mask type each takes
(eager adds the mask to the scores: 0 where allowed, the dtype's minimum elsewhere)."""


def attention_cost_ratio(config: Any, body_params: int) -> float | None:
    """r of the cost model (module docstring): attention's FLOPs per query-key pair over the linear
    layers' per token, for a model's config and its parameters without the token embedding and
    output projection; None when its attention kernel takes no 4D mask (never pack)."""
    if getattr(config, "_attn_implementation", None) not in ATTENTION_MASK_DTYPES or body_params <= 0:
        return None
    return 2.0 * config.hidden_size * config.num_hidden_layers / body_params


def share_prompts(batch: TrainBatch, ratio: float | None) -> TrainBatch:
    """The micro-batch with its `packed` layout set when that layout is cheaper by the cost model
    (`ratio` from `attention_cost_ratio`; None keeps the padded layout)."""
    if ratio is None:
        return batch
    runs = _prompt_runs(batch)
    if len(runs) == batch.num_sequences:  # no prompt is shared
        return batch
    lengths = [int(batch.prompt_lens[a]) + int(batch.completion_lens[a:b].sum()) for a, b in runs]
    padded = batch.input_ids.shape
    packed = (len(runs), max(lengths))
    if not packing_pays((padded[0], padded[1]), packed, ratio):
        return batch
    return replace(batch, packed=_pack(batch, runs, packed[1]))


def _prompt_runs(batch: TrainBatch) -> list[tuple[int, int]]:
    """[start, end) row ranges of consecutive rows with the same prompt tokens."""
    runs: list[tuple[int, int]] = []
    for row in range(batch.num_sequences):
        if runs and _same_prompt(batch, runs[-1][0], row):
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def _same_prompt(batch: TrainBatch, a: int, b: int) -> bool:
    length = int(batch.prompt_lens[a])
    return length == int(batch.prompt_lens[b]) and bool(
        torch.equal(batch.input_ids[a, :length], batch.input_ids[b, :length]))


def _pack(batch: TrainBatch, runs: list[tuple[int, int]], width: int) -> PackedRows:
    input_ids = torch.zeros((len(runs), width), dtype=torch.long)
    position_ids = torch.zeros((len(runs), width), dtype=torch.long)
    segment = torch.full((len(runs), width), -1, dtype=torch.long)  # 0 the prompt, s + 1 the s-th completion
    where = torch.zeros(batch.input_ids.shape, dtype=torch.long)  # (B, L): a sample's position -> kept index
    first_kept = min(int(batch.prompt_lens[a]) - 1 for a, _ in runs)
    for packed_row, (a, b) in enumerate(runs):
        prompt = int(batch.prompt_lens[a])
        input_ids[packed_row, :prompt] = batch.input_ids[a, :prompt]
        position_ids[packed_row, :prompt] = torch.arange(prompt)
        segment[packed_row, :prompt] = 0
        offset = prompt
        for s, row in enumerate(range(a, b)):
            count = int(batch.completion_lens[row])
            input_ids[packed_row, offset : offset + count] = batch.input_ids[row, prompt : prompt + count]
            position_ids[packed_row, offset : offset + count] = torch.arange(prompt, prompt + count)
            segment[packed_row, offset : offset + count] = s + 1
            # the last prompt position predicts the first completion token; the columns of earlier
            # prompt positions and of padding are masked, any valid position serves them
            packed_position = torch.full((where.shape[1],), prompt - 1)
            packed_position[prompt : prompt + count] = torch.arange(offset, offset + count)
            where[row] = packed_row * (width - first_kept) + packed_position - first_kept
            offset += count
    columns = torch.arange(batch.start, batch.input_ids.shape[1] - 1)  # the positions predicting targets
    return PackedRows(input_ids, position_ids, segment_mask(segment), torch.arange(first_kept, width),
                      where[:, columns])


def segment_mask(segment: Tensor) -> Tensor:
    """The attention mask (R, 1, W, W) bool of packed rows from each position's segment (R, W): 0 the shared
    prefix, s + 1 the s-th sequence's own tokens, -1 padding. A query sees, causally, the prefix and its own
    segment; padding sees itself only (no row of the mask is empty)."""
    width = segment.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    visible = (segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None])  # (R, W query, W key)
    pad_self = torch.eye(width, dtype=torch.bool) & (segment[:, :, None] < 0)
    return ((visible & causal & (segment[:, None, :] >= 0)) | pad_self)[:, None]


def kernel_mask(model: torch.nn.Module, mask: Tensor) -> Tensor:
    """A packed rows' bool mask as the model's attention kernel takes it (eager adds it to the scores)."""
    if _attention_kernel(model) == "eager":
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return mask


@dataclass
class SharedPrefixRows:
    """Sequences packed with each run's shared prefix once: R rows of width W, every position of every sequence
    computed (the prefix's for all of its run), unlike `PackedRows`, which keeps the predicting columns only."""

    input_ids: Tensor  # (R, W) long
    position_ids: Tensor  # (R, W) long
    attention_mask: Tensor  # (R, 1, W, W) bool
    index: Tensor  # (B, L) long: where position t of sequence b is among the R * W (0 past its end)


def prefix_runs(sequences: list[list[int]], min_shared: int) -> list[tuple[int, int, int]]:
    """[start, end) ranges of consecutive sequences sharing a prefix of at least `min_shared` tokens with the
    range's first, each with the prefix's length (the shortest such common prefix); a sequence sharing none
    is a range of its own with prefix 0."""
    runs: list[tuple[int, int, int]] = []
    for i, tokens in enumerate(sequences):
        if runs:
            start, _, shared = runs[-1]
            common = _common_prefix(sequences[start], tokens)
            if common >= min_shared:  # a range of one holds 0 until its second sequence sets the prefix
                runs[-1] = (start, i + 1, common if i == start + 1 else min(shared, common))
                continue
        runs.append((i, i + 1, 0))
    return runs


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def packed_width(sequences: list[list[int]], runs: list[tuple[int, int, int]]) -> int:
    """The width of `pack_prefix_runs`' rows: the longest run's prefix and its sequences' own tokens."""
    return max(shared + sum(len(sequences[i]) - shared for i in range(start, end)) for start, end, shared in runs)


def pack_prefix_runs(sequences: list[list[int]], runs: list[tuple[int, int, int]]) -> SharedPrefixRows:
    """Each run as one row: its prefix, then each sequence's own tokens at their true positions."""
    width, longest = packed_width(sequences, runs), max(len(t) for t in sequences)
    input_ids = torch.zeros((len(runs), width), dtype=torch.long)
    position_ids = torch.zeros((len(runs), width), dtype=torch.long)
    segment = torch.full((len(runs), width), -1, dtype=torch.long)
    index = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, (start, end, shared) in enumerate(runs):
        input_ids[row, :shared] = torch.tensor(sequences[start][:shared], dtype=torch.long)
        position_ids[row, :shared] = torch.arange(shared)
        segment[row, :shared] = 0
        offset = shared
        for s, b in enumerate(range(start, end)):
            own = sequences[b][shared:]
            input_ids[row, offset:offset + len(own)] = torch.tensor(own, dtype=torch.long)
            position_ids[row, offset:offset + len(own)] = torch.arange(shared, shared + len(own))
            segment[row, offset:offset + len(own)] = s + 1
            index[b, :shared] = row * width + torch.arange(shared)
            index[b, shared:len(sequences[b])] = row * width + torch.arange(offset, offset + len(own))
            offset += len(own)
    return SharedPrefixRows(input_ids, position_ids, segment_mask(segment), index)


def packing_pays(padded: tuple[int, int], packed: tuple[int, int], ratio: float | None) -> bool:
    """Whether `packed` (rows, width) costs less than `padded` by the cost model (module docstring)."""
    if ratio is None:
        return False
    return packed[0] * packed[1] * (1 + ratio * packed[1]) < padded[0] * padded[1] * (1 + ratio * padded[1])


@dataclass
class Scores:
    """`completion_forward`'s output for the (B, T) predicting columns."""

    logits: Tensor  # (B, T, V); with packed rows (N, V), the kept positions of every packed row
    rows: Tensor | None  # (B, T) long: the row of `logits` of each column (packed rows), else None
    state_values: Tensor | None  # (B, T) from a `critic.ActorCritic`'s value head, else None

    def column_logits(self) -> Tensor:
        """The logits (B, T, V) of every column (a copy when packed)."""
        return self.logits if self.rows is None else self.logits[self.rows]


def completion_forward(model: torch.nn.Module, batch: TrainBatch) -> Scores:
    """The model's output for the batch's T predicting columns: the logits, and `state_values`
    (B, T) when the model is a `critic.ActorCritic`; through the packed rows when the batch has
    them (module docstring), whose logits stay one row per kept position (`Scores.rows` says which
    column reads which: a shared prompt's last position serves every completion after it)."""
    packed = batch.packed
    if packed is None:
        width = batch.input_ids.shape[1]
        positions = torch.arange(batch.start, width - 1, device=batch.input_ids.device)  # (T,)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=positions,
                    use_cache=False)
        return Scores(out.logits, None, getattr(out, "state_values", None))
    out = model(input_ids=packed.input_ids, attention_mask=kernel_mask(model, packed.attention_mask),
                position_ids=packed.position_ids, logits_to_keep=packed.keep, use_cache=False)
    values = getattr(out, "state_values", None)
    return Scores(out.logits.reshape(-1, out.logits.shape[-1]), packed.index,
                  None if values is None else values.reshape(-1)[packed.index])


def policy_of(model: torch.nn.Module) -> torch.nn.Module:
    """The policy model (the one with a transformers config) inside the wrappers a forward may be given."""
    for part in ("module", "policy", "_wrapped"):  # DDP, critic.ActorCritic, lora.FrozenBase
        inner = getattr(model, part, None)
        if inner is not None:
            return policy_of(inner[0] if isinstance(inner, tuple) else inner)
    return model


def _attention_kernel(model: torch.nn.Module) -> str | None:
    return getattr(getattr(policy_of(model), "config", None), "_attn_implementation", None)


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
    scores = completion_forward(model, batch)
    return target_logprobs(scores, batch, temperature, entropy=entropy, entropy_grad=entropy_grad)


def target_logprobs(
    scores: Scores, batch: TrainBatch, temperature: float, *, entropy: bool, entropy_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` of the batch's targets (B, T) under the logits of `completion_forward`."""
    targets = batch.input_ids[:, batch.start + 1 :]  # (B, T)
    return token_logprobs(scores.logits, targets, temperature, entropy=entropy, entropy_grad=entropy_grad,
                          rows=scores.rows)
