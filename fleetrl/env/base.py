"""The typed base an environment file subclasses: `Env`, with the types of what its methods return.

An environment file defines a subclass of `Env` (or, as before, any class named `Env` with the same
methods). The reward service builds it as `cls(task, **params)` in a sandboxed worker, calls `reset()`
once, then `step(action)` with each assistant turn until it returns done or the episode runs out of
turns (`environment.max_turns`). Stdlib only: it is imported inside the sandbox.

Errors: anything `__init__`, `reset` or `step` raises ends that episode as an environment error whose
reason is the exception's last frames; a return value of the wrong shape (see `Observation` and
`StepResult`), a reward that is not a finite number, or a thread or process left running after the
call does too. The other episodes of the group go on.
"""

from __future__ import annotations

import abc
from typing import Any, Literal, TypedDict


class Message(TypedDict):
    """One chat message an observation adds to the conversation."""

    role: Literal["user", "tool", "system"]
    content: str


Observation = str | list[Message] | None
"""What the model sees next: a str (one user message), a list of messages, or None (nothing)."""

StepResult = tuple[Observation, float, bool]
"""`step`'s answer: the observation, this turn's reward (a finite number) and whether the episode ended."""


class Env(abc.ABC):
    """One episode of an environment. Subclasses define `reset` and `step`."""

    task: dict[str, Any]
    """The task: the prompt line's fields (its "prompt" and every other key of the JSONL line)."""
    params: dict[str, Any]
    """The job's `environment.params`."""

    def __init__(self, task: dict[str, Any], **params: Any) -> None:
        self.task, self.params = task, params

    @abc.abstractmethod
    def reset(self) -> Observation:
        """The episode's first observation (the conversation's opening messages)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """The environment's answer to the assistant's turn `action` (its text)."""
