"""Held-out evaluation of the addition task: greedy accuracy and format rate.

A completion is *correct* when the last integer in it equals a + b, and
*number-only* when, stripped, it is nothing but that integer. Generation is
greedy and batched with left padding; prompts go through the same chat
formatting the actors use, so base and trained models see what training saw.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

_LAST_INT = re.compile(r"-?\d+")
_ONLY_INT = re.compile(r"^\s*-?\d+\s*$")


@dataclass(frozen=True)
class EvalResult:
    problems: int
    accuracy: float
    number_only_rate: float
    examples: list[dict[str, str]]


def score(completion: str, answer: str) -> tuple[bool, bool]:
    """(correct, number-only) of one completion."""
    numbers = _LAST_INT.findall(completion)
    correct = bool(numbers) and numbers[-1] == answer
    return correct, bool(_ONLY_INT.match(completion)) and correct


def read_problems(path: Path, limit: int) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit]


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], max_new_tokens: int,
    batch_size: int = 32,
) -> list[str]:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[str] = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        generated = cast(GenerationMixin, model).generate(  # causal LMs mix generation in
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
        )
        out.extend(tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True))
    return out


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[dict[str, str]],
    prompt_ids: list[list[int]], max_new_tokens: int = 16,
) -> EvalResult:
    completions = greedy_completions(model, tokenizer, prompt_ids, max_new_tokens)
    scores = [score(c, str(p["answer"])) for c, p in zip(completions, problems, strict=True)]
    examples = [{"prompt": p["prompt"], "answer": str(p["answer"]), "completion": c}
                for p, c in list(zip(problems, completions, strict=True))[:5]]
    n = len(problems)
    return EvalResult(n, sum(c for c, _ in scores) / n, sum(f for _, f in scores) / n, examples)


def as_dict(result: EvalResult) -> dict[str, object]:
    return asdict(result)
