"""pass@k against brute-force enumeration; sampled evaluation with the actor's real sampler on a tiny model."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from fleetrl.eval import addition as evaluate
from fleetrl.policy.backends import Completion, HFBackend, prompt_tokens
from fleetrl.spec.config import RolloutConfig
from tests.conftest import TinyModel


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_correct_fraction_and_bad_counts_are_refused() -> None:
    assert evaluate.pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert evaluate.pass_at_k(200, 1, 100) == pytest.approx(0.5)
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            evaluate.pass_at_k(n, c, k)


@dataclass
class Scripted:
    """A sampler that answers each problem with the texts scripted for it (the counting, not the model)."""

    texts: list[list[str]]
    calls: int = 0

    def generate(self, prompt_token_ids: list[int], n: int, *, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, ignore_eos: bool = False) -> list[Completion]:
        texts = self.texts[self.calls]
        self.calls += 1
        assert len(texts) == n
        return [Completion([], [], text, "stop") for text in texts]


def test_sampled_counts_correct_completions_per_problem() -> None:
    problems = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": "4"}, {"prompt": "3+3", "answer": "6"}]
    sampler = Scripted([["2", "3", "1 + 1 = 2", "x"], ["5", "5", "5", "5"], ["6", "6", "6", "6"]])
    result = evaluate.sampled(sampler, problems, [[1], [2], [3]], 4, max_new_tokens=8, temperature=1.0)
    assert result.extras["correct_per_problem"] == [2, 0, 4]
    assert result.sampled_pass_at_1 == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert result.sampled_pass_at_k == pytest.approx((1 + 0 + 1) / 3)


def test_sampled_runs_the_actor_sampler_reproducibly(tiny_model: TinyModel) -> None:
    model, tokenizer = tiny_model("tiny-llama")
    backend = HFBackend(model, tokenizer)
    problems = [{"prompt": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(3)]
    ids = [prompt_tokens(tokenizer, p["prompt"], RolloutConfig()) for p in problems]
    runs = [evaluate.sampled(backend, problems, ids, 4, max_new_tokens=4, temperature=1.0, seed=5) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0].problems == 3 and runs[0].samples == 4 and len(runs[0].extras["correct_per_problem"]) == 3
    assert 0.0 <= runs[0].sampled_pass_at_1 <= runs[0].sampled_pass_at_k <= 1.0
