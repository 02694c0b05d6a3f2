"""Write the multi-step arithmetic prompt sets: train.jsonl and a disjoint held-out eval.jsonl.

`python examples/calculator_agent/make_prompts.py` regenerates both files byte for byte (fixed seed).
Every line is {"prompt": ..., "expression": ..., "answer": "<the integer value>"}.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 13
TRAIN_PROBLEMS, EVAL_PROBLEMS = 1000, 200
TEMPLATE = "What is {expression}? Use the calc tool, then reply with just the number."


def expression(rng: random.Random) -> str:
    """Three operations on two-digit numbers, at least one multiplication: beyond mental arithmetic
    for a 135M model."""
    a, b, c, d = (rng.randint(11, 99) for _ in range(4))
    first, second = rng.choice(["+", "-"]), rng.choice(["+", "-", "*"])
    return f"{a} * {b} {first} {c} {second} {d}"


def problems(count: int, rng: random.Random) -> list[str]:
    out: dict[str, None] = {}
    while len(out) < count:
        out.setdefault(expression(rng), None)
    return list(out)


def line(text: str) -> str:
    return json.dumps({"prompt": TEMPLATE.format(expression=text), "expression": text,
                       "answer": str(eval(text))})  # our own generated arithmetic, not user input


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
