"""Write the number-sorting prompt sets: train.jsonl and a disjoint held-out eval.jsonl.

`python examples/custom_reward/make_prompts.py` regenerates both files byte for byte (fixed
seed). Every line is {"prompt": ..., "numbers": [...], "answer": "<the sorted list>"}; the
reward file reads `numbers` from the metadata.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 11
TRAIN_PROBLEMS, EVAL_PROBLEMS = 1000, 200
TEMPLATE = ("Sort these numbers from smallest to largest: {numbers}. "
            "Reply with only the sorted numbers, comma-separated.")


def problems(count: int, rng: random.Random) -> list[list[int]]:
    """`count` distinct lists of 3 to 6 distinct numbers below 100."""
    out: dict[tuple[int, ...], list[int]] = {}
    while len(out) < count:
        numbers = rng.sample(range(1, 100), rng.randint(3, 6))
        out.setdefault(tuple(numbers), numbers)
    return list(out.values())


def line(numbers: list[int]) -> str:
    listed = ", ".join(map(str, numbers))
    return json.dumps({"prompt": TEMPLATE.format(numbers=listed), "numbers": numbers,
                       "answer": ", ".join(map(str, sorted(numbers)))})


def files() -> dict[str, str]:
    """{file name: contents} of the two prompt sets; eval problems never appear in train."""
    pool = problems(TRAIN_PROBLEMS + EVAL_PROBLEMS, random.Random(SEED))
    held_out, train = pool[:EVAL_PROBLEMS], pool[EVAL_PROBLEMS:]
    return {"train.jsonl": "".join(line(p) + "\n" for p in train),
            "eval.jsonl": "".join(line(p) + "\n" for p in held_out)}


def main() -> None:
    for name, text in files().items():
        (HERE / name).write_text(text)


if __name__ == "__main__":
    main()
