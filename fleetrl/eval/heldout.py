"""`eval.interval`: held-out pass@k of the policy being trained, between steps.

After every `eval.interval` steps (and after the last), the learner generates greedy and sampled
completions of the job's eval set with its current weights and has the reward service score them
with the job's own reward spec (fleetrl/eval/passk.py, the same code `fleetrl eval` runs).
The figures join that step's metrics as `eval_pass_at_1`, `eval_pass_at_k`, `eval_greedy_pass_at_1`,
`eval_reward_mean`, `eval_errors` and `eval_s`, so they reach the job's step history, `fleetrl
watch`, the demo's plot and `fleetrl sweep`'s table. The learner does this itself, between steps:
training waits for it (`eval_s` says how long), and no actor has to hold a model of another version.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fleetrl.eval import passk as evaluation
from fleetrl.reward.client import RewardClient, spec_to_proto
from fleetrl.spec.config import JobSpec
from fleetrl.spec.prompts import read_prompts
from fleetrl.train.trained_policy import Policy


def parse_eval_prompts(data: bytes, limit: int) -> list[dict[str, Any]]:
    """The first `limit` lines of the eval JSONL (checked at submission: objects with a string `prompt`)."""
    return read_prompts(data, "eval.prompts")[:limit]


class HeldOutEval:
    """Evaluates one job's policy on its eval set when a step is due."""

    def __init__(self, job_id: str, spec: JobSpec, problems: list[dict[str, Any]], reward_file: bytes | None,
                 reward: RewardClient) -> None:
        self.job_id, self.spec, self.problems, self.reward = job_id, spec, problems, reward
        assert spec.reward is not None, "JobSpec refuses eval.interval without a [reward]"
        self.reward_spec = spec_to_proto(spec.reward, reward_file or b"")

    def due(self, step: int) -> bool:
        interval = self.spec.eval.interval
        return interval > 0 and (step % interval == 0 or step == self.spec.train.max_steps)

    async def run(self, policy: Policy) -> dict[str, float]:
        """The eval_* metrics of the policy's current weights."""
        started = time.monotonic()
        cfg = self.spec.eval
        completions = await asyncio.to_thread(
            evaluation.complete, policy.model, policy.tokenizer, self.problems, rollout=self.spec.rollout,
            samples=cfg.samples, max_new_tokens=cfg.max_new_tokens or self.spec.rollout.max_new_tokens,
            seed=self.spec.seed)
        results = await evaluation.score(self.reward, self.job_id, self.reward_spec, self.problems, completions)
        figures = evaluation.summarise(results, len(self.problems), cfg.samples, cfg.threshold)
        return {**figures.metrics(), "eval_s": time.monotonic() - started}
