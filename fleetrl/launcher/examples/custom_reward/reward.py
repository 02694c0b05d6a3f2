"""A reward file with named components: sorting a list of numbers.

`reward` returns a dict. Every entry but "reward" is a named component that the fleet reports on
its own (the learner's step metrics show `reward/sorted`, `reward/same_numbers`,
`reward/concise`); "reward" is the scalar that is trained on. The weights come from the job's
`[reward.params]`, which the reward service passes as the `params` keyword argument.

Runs in the reward service's sandbox: stdlib only, no files, no sockets, no subprocesses.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

INTEGER = re.compile(r"-?\d+")
LIST_ONLY = re.compile(r"\s*-?\d+(?:\s*,\s*-?\d+)*\s*\.?\s*")
DEFAULT_WEIGHTS = {"sorted": 1.0, "same_numbers": 0.3, "concise": 0.2}


def components(completion: str, numbers: list[int]) -> dict[str, float]:
    """sorted: the reply is exactly the sorted list; same_numbers: it holds the same numbers (any
    order); concise: it is nothing but a comma-separated list."""
    given = [int(n) for n in INTEGER.findall(completion)]
    return {
        "sorted": float(given == sorted(numbers)),
        "same_numbers": float(Counter(given) == Counter(numbers)),
        "concise": float(LIST_ONLY.fullmatch(completion) is not None),
    }


def reward(completion: str, prompt: str, params: dict[str, Any] | None = None, **metadata: Any) -> dict[str, float]:
    """The components and their weighted sum under "reward" (weights from params["weights"])."""
    weights = {**DEFAULT_WEIGHTS, **(params or {}).get("weights", {})}
    parts = components(completion, [int(n) for n in metadata["numbers"]])
    return {**parts, "reward": sum(weights[name] * value for name, value in parts.items())}
