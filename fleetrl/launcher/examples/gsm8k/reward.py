"""Reward of the GSM8K-style job: 1 for the right final answer, plus a small bonus for the format.

The final answer is the number after the last `#### ` (the GSM8K layout the prompt asks for), or,
when there is none, the last number in the completion. Commas and a leading `$` are ignored.
The reward service runs this file in a sandboxed worker: it must be self-contained (stdlib only)
and may not open files or sockets.
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
HASH_ANSWER = re.compile(r"####\s*(-?\$?\d[\d,]*(?:\.\d+)?)")
FORMAT_BONUS = 0.1


def final_answer(completion: str) -> tuple[float | None, bool]:
    """(the completion's final number or None, whether it used `#### n`)."""
    marked = HASH_ANSWER.findall(completion)
    found = marked or NUMBER.findall(completion)
    if not found:
        return None, False
    try:
        return float(found[-1].replace(",", "").replace("$", "")), bool(marked)
    except ValueError:
        return None, bool(marked)


def reward(completion: str, prompt: str, **metadata: Any) -> float:
    """1.0 when the final answer equals metadata["answer"], + FORMAT_BONUS when it is marked `####`."""
    got, marked = final_answer(completion)
    correct = got is not None and abs(got - float(metadata["answer"])) < 1e-6
    return float(correct) + (FORMAT_BONUS if marked else 0.0)
