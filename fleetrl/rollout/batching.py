"""Generation batched across tasks: the groups of one round's tasks in one backend call.

An actor takes a round of deliveries at once: up to `tasks_per_round` of the job the fair share picks
(`fleetrl.tasks.queue.JobQueue.fetch`) and, while the round's token budget has room, tasks already
queued for the other jobs it holds on the same shared LoRA base or vLLM engine (riders: their
adapters are mixed in one batch, `fleetrl.policy.shared_base.generate_mixed`,
`fleetrl.policy.vllm_backend.generate_mixed`). Each delivery still runs its own rollout (its span,
its keep-alive, its score and insert, its ack) concurrently with the others. Only the generate step
meets here: a `RoundBatch` holds each task's `GroupRequest` until every task of the round has either
asked or left (failed before generating: weights not in time, a fault), then runs all of them as one
call (`generate_together`) and hands each task its group. So a round costs one batched decode instead
of one per task (python -m bench.generate --groups 4, python -m bench.tenants: the figures are in
README.md), and the batch is bounded by the round: `ActorSettings.round_tokens` of new tokens.

A redelivered task (its delivery attempt past the first) is generated on its own, beside the round's
batch: a task whose generation killed its actor (out of memory, a poison prompt) then costs each of
its round-mates at most one more delivery, not all of their `max_retries_per_episode`.

The version a group records is the one its job's backend held during the call: tasks' weight
refreshes happen before they ask, the round's batch starts only once none is still refreshing, and
the actor runs one round at a time, so no load overlaps the batched generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fleetrl.policy import vllm_backend
from fleetrl.policy.backends import Backend, Completion, GroupRequest
from fleetrl.policy.shared_base import SharedBaseBackend, generate_mixed
from fleetrl.rollout import metrics
from fleetrl.spec.config import JobSpec


def group_tokens(spec: JobSpec) -> int:
    """The most new tokens one task's group generates."""
    return spec.rollout.samples_per_prompt * spec.rollout.max_new_tokens


def tasks_per_round(spec: JobSpec, round_tokens: int) -> int:
    """How many tasks of a job a round takes: as many groups as round_tokens of new tokens hold, at least
    1 and at most one step's worth (prompts_per_step); one for a job with an environment, whose
    episodes run turn by turn."""
    if spec.environment is not None:
        return 1
    return max(1, min(spec.rollout.prompts_per_step, round_tokens // group_tokens(spec)))


def can_ride(lead: Backend, other: Backend, spec: JobSpec) -> bool:
    """Whether a single-turn job on `other` can share a round's batch with the job on `lead`: both are
    LoRA adapters of one shared base (hf) or engine (vllm)."""
    mixes = getattr(lead, "mixes_with", None)
    return spec.environment is None and mixes is not None and bool(mixes(other))


def generate_together(work: list[tuple[Backend, GroupRequest]]) -> list[list[Completion]]:
    """The groups of one round: one backend's `generate_groups`, or one mixed batch of several LoRA jobs'
    adapters on their shared base (`shared_base.generate_mixed`) or engine (`vllm_backend.generate_mixed`)."""
    lead = work[0][0]
    if all(backend is lead for backend, _ in work):
        return lead.generate_groups([request for _, request in work])
    if isinstance(lead, SharedBaseBackend):
        return generate_mixed(work)  # type: ignore[arg-type]
    if isinstance(lead, vllm_backend.VLLMBackend):
        return vllm_backend.generate_mixed(work)  # type: ignore[arg-type]
    raise ValueError("a round's batch mixes backends that share no base")


class RoundBatch:
    """One round's generate step: each task's `Seat` asks once or leaves; the last to do so starts the batch."""

    job_id: str
    expected: int

    def __init__(self, job_id: str, expected: int) -> None:
        """job_id: the round's lead job (its metrics); expected: the round's task count."""
        self.job_id, self.expected = job_id, expected
        self._asked: list[tuple[Seat, GroupRequest, asyncio.Future[tuple[list[Completion], int]]]] = []
        self._left = 0
        self._running: asyncio.Task[None] | None = None

    def seat(self, backend: Backend, version: Callable[[], int]) -> Seat:
        """The place of one task of the round, on its job's backend (version(): the version it holds now)."""
        return Seat(self, backend, version)

    def absent(self) -> None:
        """One of the round's tasks will take no seat (it failed before it knew its backend)."""
        self._leave()

    def _ask(self, seat: Seat, request: GroupRequest) -> asyncio.Future[tuple[list[Completion], int]]:
        answer: asyncio.Future[tuple[list[Completion], int]] = asyncio.get_running_loop().create_future()
        self._asked.append((seat, request, answer))
        self._start_if_complete()
        return answer

    def _leave(self) -> None:
        self._left += 1
        self._start_if_complete()

    def _start_if_complete(self) -> None:
        if self._asked and self._running is None and len(self._asked) + self._left == self.expected:
            self._running = asyncio.create_task(self._run(list(self._asked)))

    async def _run(self, asked: list[tuple[Seat, GroupRequest, asyncio.Future[tuple[list[Completion], int]]]]
                   ) -> None:
        versions = [seat.version() for seat, _, _ in asked]
        metrics.BATCH_GROUPS.labels(self.job_id).observe(len(asked))
        try:
            groups = await asyncio.to_thread(generate_together, [(seat.backend, request) for seat, request, _ in asked])
        except Exception as error:  # every task of the batch fails with it (each is released for redelivery)
            for _, _, answer in asked:
                if not answer.done():
                    answer.set_exception(error)
            return
        for (_, _, answer), group, version in zip(asked, groups, versions, strict=True):
            if not answer.done():  # a task cancelled while it waited wants nothing
                answer.set_result((group, version))


class Seat:
    """One task's place in its round: it asks for its group once, or leaves."""

    def __init__(self, batch: RoundBatch, backend: Backend, version: Callable[[], int]) -> None:
        self._batch, self.backend, self.version = batch, backend, version
        self._done = False

    async def generate(self, request: GroupRequest) -> tuple[list[Completion], int]:
        """This task's group and the version that generated it, once the whole round's batch has run."""
        if self._done:
            raise RuntimeError("a task asks for its group once")
        self._done = True
        return await self._batch._ask(self, request)

    def leave(self) -> None:
        """The task will not ask (it failed or was cancelled before its generate step); no-op once it asked."""
        if not self._done:
            self._done = True
            self._batch._leave()
