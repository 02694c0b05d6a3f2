"""Held-out pass@k: completions from a model, scored by the reward service, summed up.

The one home of evaluation with a job's reward, used by `fleetrl eval` (fleetrl/launcher/evaljob.py)
and by the learner's periodic evaluation (`eval.interval`). Per problem: one greedy completion
(batched `model.generate`, temperature 0) and `samples` sampled ones (the actor's own sampler,
`HFBackend.generate`, with the rollout's temperature and top-p, problem i drawn with seed + i).
Every completion is scored through `RewardClient.score`, so the reward runs in the reward
service's sandbox exactly as in training. A completion passes when it was scored OK with a reward
at least `threshold`. Sampled pass@1 and pass@k use the unbiased estimator of Chen et al. (2021),
averaged over problems. The figures are an `EvalResult` (fleetrl/eval/result.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.eval.result import EvalResult
from fleetrl.policy.backends import HFBackend, prompt_tokens
from fleetrl.proto.fleetrl.v1 import common_pb2, reward_pb2
from fleetrl.reward.client import RewardClient
from fleetrl.spec.config import RolloutConfig

SCORE_BATCH = 64


@dataclass(frozen=True)
class Completions:
    """Per problem: the greedy completion and `samples` sampled ones."""

    greedy: list[str]
    sampled: list[list[str]]
    samples: int


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k).

    The chance that k samples drawn without replacement from the n include a correct one, written
    as a product (1 - k / i for i in n - c + 1 .. n) so large n needs no big binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], max_new_tokens: int,
    batch_size: int = 32,
) -> list[str]:
    """Temperature-0 completions, batched with left padding (the model is left in eval mode)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[str] = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        generated = cast(GenerationMixin, model).generate(  # causal LMs mix generation in
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
        )
        out.extend(tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True))
    return out


def complete(model: Any, tokenizer: Any, problems: Sequence[dict[str, Any]], *, rollout: RolloutConfig,
             samples: int, max_new_tokens: int, seed: int) -> Completions:
    """Greedy and sampled completions of every problem; the model's train/eval mode is restored after."""
    training = bool(getattr(model, "training", False))
    try:
        prompt_ids = [prompt_tokens(tokenizer, p["prompt"], rollout) for p in problems]
        greedy = greedy_completions(model, tokenizer, prompt_ids, max_new_tokens)
        backend = HFBackend(model, tokenizer)
        sampled = [[c.text for c in backend.generate(ids, samples, max_new_tokens=max_new_tokens,
                                                      temperature=rollout.temperature, top_p=rollout.top_p,
                                                      seed=seed + index)]
                   for index, ids in enumerate(prompt_ids)] if samples > 0 else [[] for _ in problems]
    finally:
        model.train(training)
    return Completions(greedy, sampled, samples)


async def score(reward: RewardClient, job_id: str, spec: reward_pb2.RewardSpec, problems: Sequence[dict[str, Any]],
                completions: Completions) -> list[reward_pb2.ScoreResult]:
    """Results of the greedy completions (one per problem), then of the samples (problem by problem)."""
    rows = [*problems, *(p for p in problems for _ in range(completions.samples))]
    texts = [*completions.greedy, *(text for group in completions.sampled for text in group)]
    results: list[reward_pb2.ScoreResult] = []
    for start in range(0, len(texts), SCORE_BATCH):
        items = [reward_pb2.ScoreItem(completion=text, prompt=row["prompt"], metadata_json=json.dumps(
            {k: v for k, v in row.items() if k != "prompt"})) for row, text in
            zip(rows[start:start + SCORE_BATCH], texts[start:start + SCORE_BATCH], strict=True)]
        results += await reward.score(job_id, spec, items)
    return results


def summarise(results: Sequence[reward_pb2.ScoreResult], problems: int, samples: int, threshold: float) -> EvalResult:
    """The figures of `score`'s results."""
    n = problems
    passed = [r.status == common_pb2.REWARD_STATUS_OK and r.reward >= threshold for r in results]
    errors = sum(r.status != common_pb2.REWARD_STATUS_OK for r in results)
    greedy = EvalResult(problems=n, threshold=threshold, greedy_pass_at_1=sum(passed[:n]) / n,
                        greedy_reward_mean=sum(r.reward for r in results[:n]) / n, errors=errors)
    if samples == 0:
        return greedy
    correct = [sum(passed[n + i * samples:n + (i + 1) * samples]) for i in range(n)]
    return replace(greedy, samples=samples,
                   sampled_pass_at_1=sum(pass_at_k(samples, c, 1) for c in correct) / n,
                   sampled_pass_at_k=sum(pass_at_k(samples, c, samples) for c in correct) / n,
                   sampled_reward_mean=sum(r.reward for r in results[n:]) / (n * samples))
