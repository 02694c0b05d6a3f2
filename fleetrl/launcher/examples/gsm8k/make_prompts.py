"""Write GSM8K-style word problems: train.jsonl and a disjoint held-out eval.jsonl.

No download: each problem comes from one of a few templates (shopping, change, rates, sharing,
seating, savings) with random names and numbers from a fixed seed, so
`python examples/gsm8k/make_prompts.py` regenerates both files byte for byte. Every line is
{"prompt": ..., "answer": "<integer>", "solution": "<worked steps>\\n#### <integer>"}, the GSM8K
answer layout, so `reward.py` can be checked against the solutions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 8
TRAIN_PROBLEMS, EVAL_PROBLEMS = 800, 200
INSTRUCTION = "Solve the problem step by step, then give the final answer on its own line as '#### <number>'."
NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Kemi", "Liam",
         "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq")
Problem = tuple[str, str, int]  # question, worked steps, answer


def shopping(rng: random.Random, name: str) -> Problem:
    have, bags, per_bag = rng.randint(3, 40), rng.randint(2, 9), rng.randint(3, 12)
    bought = bags * per_bag
    question = (f"{name} has {have} apples. {name} buys {bags} bags of apples with {per_bag} apples in each "
                f"bag. How many apples does {name} have now?")
    return question, f"{bags} * {per_bag} = {bought} apples bought. {have} + {bought} = {have + bought}.", \
        have + bought


def change(rng: random.Random, name: str) -> Problem:
    price, count = rng.randint(2, 9), rng.randint(2, 8)
    cost = price * count
    bill = rng.choice([b for b in (20, 50, 100) if b > cost])
    question = (f"Pencils cost ${price} each. {name} buys {count} pencils and pays with a ${bill} bill. "
                f"How many dollars of change does {name} get?")
    return question, f"{count} * {price} = {cost} dollars. {bill} - {cost} = {bill - cost}.", bill - cost


def reading(rng: random.Random, name: str) -> Problem:
    per_day, days, last = rng.randint(5, 30), rng.randint(2, 7), rng.randint(1, 20)
    first = per_day * days
    question = (f"{name} reads {per_day} pages a day for {days} days and then {last} pages on the next day. "
                f"How many pages does {name} read in total?")
    return question, f"{per_day} * {days} = {first} pages. {first} + {last} = {first + last}.", first + last


def sharing(rng: random.Random, name: str) -> Problem:
    friends, each = rng.randint(2, 6), rng.randint(2, 9)
    given = friends * each
    start = given + rng.randint(0, 25)
    question = (f"{name} had {start} stickers and gave {each} stickers to each of {friends} friends. "
                f"How many stickers does {name} have left?")
    return question, f"{friends} * {each} = {given} stickers given. {start} - {given} = {start - given}.", \
        start - given


def seating(rng: random.Random, name: str) -> Problem:
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    total = rows * per_row
    taken = rng.randint(1, total - 1)
    question = (f"A hall has {rows} rows of chairs with {per_row} chairs in each row. {taken} chairs are taken "
                f"when {name} arrives. How many chairs are free?")
    return question, f"{rows} * {per_row} = {total} chairs. {total} - {taken} = {total - taken}.", total - taken


def savings(rng: random.Random, name: str) -> Problem:
    weekly, weeks = rng.randint(3, 20), rng.randint(3, 10)
    saved = weekly * weeks
    spent = rng.randint(1, min(15, saved - 1))
    question = (f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a book. "
                f"How many dollars does {name} have left?")
    return question, f"{weekly} * {weeks} = {saved} dollars. {saved} - {spent} = {saved - spent}.", saved - spent


TEMPLATES: tuple[Callable[[random.Random, str], Problem], ...] = (shopping, change, reading, sharing, seating,
                                                                   savings)


def problems(count: int, rng: random.Random) -> list[Problem]:
    """`count` distinct problems, templates and names drawn from rng."""
    out: dict[str, Problem] = {}
    while len(out) < count:
        question, steps, answer = rng.choice(TEMPLATES)(rng, rng.choice(NAMES))
        out.setdefault(question, (question, steps, answer))
    return list(out.values())


def line(problem: Problem) -> str:
    question, steps, answer = problem
    return json.dumps({"prompt": f"{question}\n{INSTRUCTION}", "answer": str(answer),
                       "solution": f"{steps}\n#### {answer}"})


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
