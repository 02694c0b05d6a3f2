"""The addition task as a conversation: a wrong answer gets "Not quite, try again." and another turn.

Runs in the reward service's sandbox. Up to `tries` turns (the job's max_turns should allow them);
the right answer on turn k scores 1 / 2**(k-1) (1, 0.5, 0.25), a wrong last try 0.
"""

import re
from typing import Any

from fleetrl.env import Env, Observation, StepResult

NUMBER = re.compile(r"-?\d+")


class RetryFeedback(Env):
    def __init__(self, task: dict[str, Any], tries: int = 3) -> None:
        super().__init__(task, tries=tries)
        self.tries, self.turn = tries, 0

    def reset(self) -> Observation:
        return self.task["prompt"]

    def step(self, action: str) -> StepResult:
        self.turn += 1
        numbers = NUMBER.findall(action)
        if numbers and numbers[-1] == self.task["answer"]:
            return None, 1.0 / 2 ** (self.turn - 1), True
        if self.turn >= self.tries:
            return None, 0.0, True
        return "Not quite, try again. Answer with just the number.", 0.0, False
