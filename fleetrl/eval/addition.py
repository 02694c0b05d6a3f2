"""Held-out evaluation of the addition task: greedy accuracy, format rate, and sampled pass@k.

A completion is *correct* when the last integer in it equals a + b, and
*number-only* when, stripped, it is nothing but that integer. Greedy generation is
batched with left padding; prompts go through the same chat formatting the actors use,
so base and trained models see what training saw. Sampled generation uses the actor's own
sampler (`HFBackend.generate`, the job's temperature and top-p), k completions a problem,
and pass@k is the unbiased estimator of Chen et al. (2021) over those k samples
(`fleetrl.eval.passk.pass_at_k`, which `fleetrl eval` and the learner's eval use too). Both return an
`EvalResult` (fleetrl/eval/result.py).
"""

from __future__ import annotations

import re
from typing import Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.eval.passk import greedy_completions, pass_at_k
from fleetrl.eval.result import EvalResult
from fleetrl.policy.backends import Completion

_LAST_INT = re.compile(r"-?\d+")
_ONLY_INT = re.compile(r"^\s*-?\d+\s*$")


class Sampler(Protocol):
    """What sampled evaluation needs of an inference backend (`fleetrl.policy.backends.HFBackend`)."""

    def generate(
        self, prompt_token_ids: list[int], n: int, *, max_new_tokens: int, temperature: float, top_p: float,
        seed: int, ignore_eos: bool = False,
    ) -> list[Completion]: ...


def score(completion: str, answer: str) -> tuple[bool, bool]:
    """(correct, number-only) of one completion."""
    numbers = _LAST_INT.findall(completion)
    correct = bool(numbers) and numbers[-1] == answer
    return correct, bool(_ONLY_INT.match(completion)) and correct


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[dict[str, str]],
    prompt_ids: list[list[int]], max_new_tokens: int = 16,
) -> EvalResult:
    """Greedy accuracy (`greedy_pass_at_1`), with the number-only rate and the first 5 examples in `extras`."""
    completions = greedy_completions(model, tokenizer, prompt_ids, max_new_tokens)
    scores = [score(c, str(p["answer"])) for c, p in zip(completions, problems, strict=True)]
    examples = [{"prompt": p["prompt"], "answer": str(p["answer"]), "completion": c}
                for p, c in list(zip(problems, completions, strict=True))[:5]]
    n = len(problems)
    return EvalResult(problems=n, greedy_pass_at_1=sum(c for c, _ in scores) / n,
                      extras={"number_only_rate": sum(f for _, f in scores) / n, "examples": examples})


def sampled(
    backend: Sampler, problems: list[dict[str, str]], prompt_ids: list[list[int]], samples: int, *,
    max_new_tokens: int, temperature: float, top_p: float = 1.0, seed: int = 0,
) -> EvalResult:
    """pass@1 and pass@`samples` of `samples` completions a problem, problem i drawn with seed + i, with the
    temperature and the correct completions of each problem in `extras`."""
    correct = []
    for index, (problem, ids) in enumerate(zip(problems, prompt_ids, strict=True)):
        completions = backend.generate(ids, samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, seed=seed + index)
        correct.append(sum(score(c.text, str(problem["answer"]))[0] for c in completions))
    n = len(problems)
    return EvalResult(problems=n, samples=samples,
                      sampled_pass_at_1=sum(pass_at_k(samples, c, 1) for c in correct) / n,
                      sampled_pass_at_k=sum(pass_at_k(samples, c, samples) for c in correct) / n,
                      extras={"temperature": temperature, "correct_per_problem": correct})
