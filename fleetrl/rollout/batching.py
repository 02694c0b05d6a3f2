"""Generation batched across tasks: the groups of one round's tasks in one backend call.

An actor takes a round of up to `tasks_per_round` deliveries of one job at once
(`fleetrl.tasks.queue.JobQueue.take_many`); each delivery still runs its own rollout (its span, its
keep-alive, its score and insert, its ack) concurrently with the others. Only the generate step meets
here: a `RoundBatch` holds each task's `GroupRequest` until every task of the round has either asked
or left (failed before generating: weights not in time, a fault), then runs all of them as one
`Backend.generate_groups` call and hands each task its group. So a round costs one batched decode
instead of one per task (python -m bench.generate --groups 4: the figure is in docs/benchmarks.md),
and the batch is bounded by the round: `ActorSettings.round_tokens` sets how many tasks a round
takes (`tasks_per_round`).

A redelivered task (its delivery attempt past the first) is generated on its own, beside the round's
batch: a task whose generation killed its actor (out of memory, a poison prompt) then costs each of
its round-mates at most one more delivery, not all of their `max_retries_per_episode`.

The version a group records is the one the backend held during the call: tasks' weight refreshes
happen before they ask, the round's batch starts only once none is still refreshing, and the actor
runs one round at a time, so no load overlaps the batched generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fleetrl.policy.backends import Backend, Completion, GroupRequest
from fleetrl.rollout import metrics
from fleetrl.spec.config import JobSpec


def tasks_per_round(spec: JobSpec, round_tokens: int) -> int:
    """How many tasks of a job a round takes: as many groups as round_tokens of new tokens hold
    (samples_per_prompt x max_new_tokens each), at least 1 and at most one step's worth
    (prompts_per_step); one for a job with an environment, whose episodes run turn by turn."""
    if spec.environment is not None:
        return 1
    rollout = spec.rollout
    return max(1, min(rollout.prompts_per_step, round_tokens // (rollout.samples_per_prompt * rollout.max_new_tokens)))


class RoundBatch:
    """One round's generate step: each task's `Seat` asks once or leaves; the last to do so starts the batch."""

    job_id: str
    backend: Backend
    expected: int

    def __init__(self, job_id: str, backend: Backend, expected: int, version: Callable[[], int]) -> None:
        """expected: the round's task count; version(): the weights version the backend holds now."""
        self.job_id, self.backend, self.expected = job_id, backend, expected
        self._version = version
        self._asked: list[tuple[GroupRequest, asyncio.Future[tuple[list[Completion], int]]]] = []
        self._left = 0
        self._running: asyncio.Task[None] | None = None

    def seat(self) -> Seat:
        """The place of one task of the round."""
        return Seat(self)

    def _ask(self, request: GroupRequest) -> asyncio.Future[tuple[list[Completion], int]]:
        answer: asyncio.Future[tuple[list[Completion], int]] = asyncio.get_running_loop().create_future()
        self._asked.append((request, answer))
        self._start_if_complete()
        return answer

    def _leave(self) -> None:
        self._left += 1
        self._start_if_complete()

    def _start_if_complete(self) -> None:
        if self._asked and self._running is None and len(self._asked) + self._left == self.expected:
            self._running = asyncio.create_task(self._run(list(self._asked)))

    async def _run(self, asked: list[tuple[GroupRequest, asyncio.Future[tuple[list[Completion], int]]]]) -> None:
        version = self._version()
        metrics.BATCH_GROUPS.labels(self.job_id).observe(len(asked))
        try:
            groups = await asyncio.to_thread(self.backend.generate_groups, [request for request, _ in asked])
        except Exception as error:  # every task of the batch fails with it (each is released for redelivery)
            for _, answer in asked:
                if not answer.done():
                    answer.set_exception(error)
            return
        for (_, answer), group in zip(asked, groups, strict=True):
            if not answer.done():  # a task cancelled while it waited wants nothing
                answer.set_result((group, version))


class Seat:
    """One task's place in its round: it asks for its group once, or leaves."""

    def __init__(self, batch: RoundBatch) -> None:
        self._batch = batch
        self._done = False

    async def generate(self, request: GroupRequest) -> tuple[list[Completion], int]:
        """This task's group and the version that generated it, once the whole round's batch has run."""
        if self._done:
            raise RuntimeError("a task asks for its group once")
        self._done = True
        return await self._batch._ask(request)

    def leave(self) -> None:
        """The task will not ask (it failed or was cancelled before its generate step); no-op once it asked."""
        if not self._done:
            self._done = True
            self._batch._leave()
