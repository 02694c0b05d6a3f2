"""Write the two-digit addition prompt sets: train.jsonl and a disjoint held-out eval.jsonl.

`python examples/addition/make_prompts.py` regenerates both files byte for byte
(fixed seed). Every line is {"prompt": ..., "answer": "<a+b>", "a": a, "b": b}.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATE = "What is {a} + {b}? Answer with just the number."
HERE = Path(__file__).resolve().parent


def problems() -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(1234).shuffle(pairs)
    return pairs


def line(a: int, b: int) -> str:
    return json.dumps({"prompt": TEMPLATE.format(a=a, b=b), "answer": str(a + b), "a": a, "b": b})


def main() -> None:
    pairs = problems()
    held_out, train = pairs[:200], pairs[200:2200]
    (HERE / "eval.jsonl").write_text("".join(line(a, b) + "\n" for a, b in held_out))
    (HERE / "train.jsonl").write_text("".join(line(a, b) + "\n" for a, b in train))


if __name__ == "__main__":
    main()
