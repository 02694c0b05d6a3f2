"""Generation batched across a round's tasks (fleetrl.rollout.batching): who waits for whom, which
version a group records, how a failure spreads, and how many tasks a round takes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fleetrl.policy.backends import Completion, GroupRequest
from fleetrl.rollout.batching import RoundBatch, tasks_per_round
from fleetrl.spec.config import JobSpec


class Counting:
    """A backend that answers each request with n one-token completions naming its seed, and records
    each batched call; `fail` makes the next call raise."""

    def __init__(self) -> None:
        self.calls: list[list[GroupRequest]] = []
        self.fail: Exception | None = None
        self.release = threading.Event()
        self.release.set()

    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Completion]]:
        self.release.wait(10)
        self.calls.append(requests)
        if self.fail is not None:
            raise self.fail
        return [[Completion([r.seed], [0.0], str(r.seed), "length")] * r.n for r in requests]


def request(seed: int, n: int = 2) -> GroupRequest:
    return GroupRequest([1, 2, 3], n, 4, 1.0, 1.0, seed)


async def test_the_batch_waits_for_every_task_to_ask_or_leave_then_runs_once() -> None:
    backend, version = Counting(), [3]
    batch = RoundBatch("j", 3)
    first, second, third = (batch.seat(backend, lambda: version[0]) for _ in range(3))  # type: ignore[arg-type]
    one = asyncio.create_task(first.generate(request(1)))
    two = asyncio.create_task(second.generate(request(2, n=3)))
    await asyncio.sleep(0.05)
    assert not one.done() and backend.calls == []  # the third task is still on its way
    third.leave()  # it failed before its generate step
    (group_one, v1), (group_two, v2) = await asyncio.gather(one, two)
    assert [[r.seed for r in call] for call in backend.calls] == [[1, 2]]
    assert [c.token_ids for c in group_one] == [[1]] * 2 and [c.token_ids for c in group_two] == [[2]] * 3
    assert v1 == v2 == 3
    first.leave()  # a seat that asked leaves as a no-op: nothing runs again
    await asyncio.sleep(0.05)
    assert len(backend.calls) == 1
    with pytest.raises(RuntimeError, match="once"):
        await first.generate(request(9))


async def test_a_failed_batch_fails_each_of_its_tasks() -> None:
    backend = Counting()
    backend.fail = ValueError("engine died")
    batch = RoundBatch("j", 2)
    seats = [batch.seat(backend, lambda: 0) for _ in range(2)]  # type: ignore[arg-type]
    results = await asyncio.gather(seats[0].generate(request(1)), seats[1].generate(request(2)),
                                   return_exceptions=True)
    assert [type(r) for r in results] == [ValueError, ValueError] and len(backend.calls) == 1


async def test_a_task_cancelled_while_it_waits_leaves_the_others_their_groups() -> None:
    backend = Counting()
    backend.release.clear()  # the batch is held inside the backend call
    batch = RoundBatch("j", 2)
    kept = asyncio.create_task(batch.seat(backend, lambda: 1).generate(request(1)))  # type: ignore[arg-type]
    cancelled = asyncio.create_task(batch.seat(backend, lambda: 1).generate(request(2)))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    cancelled.cancel()
    backend.release.set()
    group, version = await kept
    assert [c.token_ids for c in group] == [[1]] * 2 and version == 1
    assert cancelled.cancelled()


def test_a_round_takes_what_its_token_budget_holds_up_to_one_step() -> None:
    spec = JobSpec.model_validate({"model": "tiny-llama", "prompts": "p.jsonl", "reward": {"builtin": "numeric_match"},
                                   "rollout": {"samples_per_prompt": 8, "max_new_tokens": 12, "prompts_per_step": 4}})
    assert tasks_per_round(spec, 4096) == 4  # the demo's shape: one step's groups in one batch
    assert tasks_per_round(spec, 200) == 2  # 96 new tokens a group
    assert tasks_per_round(spec, 10) == tasks_per_round(spec, 0) == 1
    episodes = spec.model_copy(update={"environment": object()})
    assert tasks_per_round(episodes, 4096) == 1  # turn by turn: one task a round
