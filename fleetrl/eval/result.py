"""`EvalResult`: the one result type of every evaluation of a model on held-out problems.

Who returns it, and what each fills:

- held-out pass@k with the reward service (`passk.summarise`, behind `fleetrl eval` and the
  learner's `eval.interval`): every core figure; `fleetrl eval` adds `model` and `wall_s`.
- the demo's addition check (`addition.evaluate`, greedy): `greedy_pass_at_1` (the accuracy), with
  `number_only_rate` and `examples` (a few prompts, answers and completions) in `extras`;
  `addition.sampled`: `samples`, `sampled_pass_at_1` and `sampled_pass_at_k`, with `temperature` and
  `correct_per_problem` in `extras`.
- episodes on a job's environment (`fleetrl.launcher.episode_eval`): `samples` is episodes per
  problem, `sampled_reward_mean` the mean episode reward and `sampled_pass_at_1` the success rate
  (an episode passes with a reward above 0); `episodes` (in all), `turns_mean`, `status` (the
  fraction of episodes ending each way) and `temperature` in `extras`.

Design choice: one frozen dataclass, keyword-only, whose core figures are those the paths share and
are None where a path does not measure them (no greedy pass among episodes, no reward in the addition
check), plus `extras` for the figures only one path has, so a new evaluation adds keys, not a type.
Each report (`fleetrl eval`'s JSON, the demo's eval.json, `bench.episode_eval`) lays the result out
in its own shape; `as_dict` is the flat form, `metrics` the learner's `eval_*` step metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    model: str = ""
    """The model evaluated (a name or a directory), where the caller knows it."""
    problems: int
    samples: int = 0
    """Sampled completions (or episodes) a problem; 0: greedy only."""
    threshold: float | None = None
    """Reward at or above which a completion passes; None where a pass is not a reward threshold."""
    greedy_pass_at_1: float | None = None
    greedy_reward_mean: float | None = None
    sampled_pass_at_1: float | None = None
    """The unbiased estimator of Chen et al. (2021), averaged over problems."""
    sampled_pass_at_k: float | None = None
    """pass@`samples`, the same estimator."""
    sampled_reward_mean: float | None = None
    errors: int = 0
    """Completions the reward service did not score OK (error, timeout, ...): they do not pass."""
    wall_s: float | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    """Figures of one kind of evaluation only (see the module docstring)."""

    def metrics(self, prefix: str = "eval_") -> dict[str, float]:
        """Step-metric values: pass@1 is the sampled estimator when there are samples, else greedy."""
        pass_at_1 = self.sampled_pass_at_1 if self.sampled_pass_at_1 is not None else self.greedy_pass_at_1
        out = {"greedy_pass_at_1": self.greedy_pass_at_1, "reward_mean": self.greedy_reward_mean,
               "errors": float(self.errors), "pass_at_1": pass_at_1, "pass_at_k": self.sampled_pass_at_k}
        return {prefix + key: value for key, value in out.items() if value is not None}

    def as_dict(self) -> dict[str, Any]:
        """The fields in order, then the extras in place of `extras` (JSON-ready when the extras are)."""
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "extras"}, **self.extras}
