"""The actor's memory budget (`fleetrl.rollout.memory`): which jobs it holds at once.

The estimate of a job's memory against the model it loads; the budget's choices alone (fits, drop
the least recently served job held long enough, wait, never); then a real actor process whose budget
holds one tiny model serving two jobs: it holds at most one at a time (its committed bytes, sampled
from its metrics all along, never pass the budget), the two take turns, and both jobs' tasks are
stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from test_episodes import scrape

from fleetrl.launcher.embedded import free_port
from fleetrl.policy import models
from fleetrl.rollout.memory import Cost, MemoryBudget, job_cost, preloadable, preloaded_base
from fleetrl.rollout.settings import ActorSettings
from tests.actor.actor_fleet import MODEL, Fleet, job_spec, wait_until

MIB = 1 << 20


@pytest.mark.parametrize("lora", [False, True])
def test_the_estimate_is_what_the_backend_holds(lora: bool) -> None:
    spec = job_spec(train={"lora": {"rank": 4}} if lora else {})
    model, _ = models.load(MODEL)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    targets = [m for name, m in model.named_modules() if name.endswith("_proj")] if lora else []
    kept_aside = sum(t.weight.numel() * t.weight.element_size() for t in targets)  # MergedAdapter's bases
    merged = job_cost(spec, ActorSettings(actor_id="a", share_lora_base=False))
    assert merged == Cost(weights + kept_aside)
    shared = job_cost(spec, ActorSettings(actor_id="a"))
    if lora:
        adapter = sum(4 * (t.in_features + t.out_features) * 4 for t in targets)  # rank 4, float32
        assert shared == Cost(adapter, ((MODEL, "float32", "cpu"), weights))
    else:
        assert shared == merged
    assert job_cost(spec, ActorSettings(actor_id="a", backend="fixed")) == Cost(0)
    engine = weights + (2 << 30)  # the weights and a 2 GiB KV cache
    on_vllm = job_cost(spec, ActorSettings(actor_id="a", backend="vllm", vllm_kv_cache_gib=2))
    if lora:  # LoRA jobs share one engine per base and rank bucket (rank 4 and 8: bucket 8), counted once
        assert on_vllm == Cost(adapter, ((MODEL, "float32", "cpu vllm rank 8"), engine))
        rank_8 = job_cost(job_spec(train={"lora": {"rank": 8}}), ActorSettings(actor_id="a", backend="vllm",
                                                                                vllm_kv_cache_gib=2))
        assert rank_8.base == on_vllm.base and rank_8.own == 2 * adapter
        rank_16 = job_cost(job_spec(train={"lora": {"rank": 16}}), ActorSettings(actor_id="a", backend="vllm",
                                                                                  vllm_kv_cache_gib=2))
        assert rank_16.base is not None and rank_16.base[0] != on_vllm.base[0]  # type: ignore[index]
    else:  # full weights: an engine of the job's own
        assert on_vllm == Cost(engine)


def test_the_budget_takes_drops_waits_or_refuses() -> None:
    budget = MemoryBudget(limit=100, min_residency_s=10)
    assert budget.make_room(Cost(60), now=0) == []
    budget.hold("a", Cost(60), now=0)
    assert budget.make_room(Cost(30), now=1) == []  # fits beside a
    budget.hold("b", Cost(30), now=1)
    assert budget.make_room(Cost(50), now=5) is None  # a and b are held too recently to drop
    budget.mark_served("a", now=12)
    assert budget.make_room(Cost(40), now=12) == ["b"]  # fits after dropping b, served least recently
    assert budget.make_room(Cost(90), now=12) == ["b", "a"]
    assert budget.make_room(Cost(101), now=100) is None  # larger than the whole budget: never
    budget.release("a")
    assert budget.used == 30 and budget.make_room(Cost(70), now=12) == []


def test_jobs_on_a_shared_base_count_it_once() -> None:
    base = (("m", "float32", "cpu"), 50)
    budget = MemoryBudget(limit=100, min_residency_s=0)
    for job in ("a", "b", "c", "d"):  # four adapters of 10 on one base of 50
        assert budget.make_room(Cost(10, base), now=0) == []
        budget.hold(job, Cost(10, base), now=0)
    assert budget.used == 90
    assert budget.make_room(Cost(20, base), now=1) == ["a"]  # dropping one adapter makes room
    assert budget.make_room(Cost(60), now=1) == ["a", "b", "c", "d"]  # only dropping them all frees the base
    for job in ("a", "b", "c", "d"):
        budget.release(job)
    assert budget.used == 0


def test_a_preloaded_base_is_committed_held_or_not() -> None:
    settings = ActorSettings(actor_id="a", backend="hf", preload_models=[MODEL])
    pinned = preloaded_base(MODEL, settings)
    lora_job = job_cost(job_spec(train={"lora": {"rank": 4}}), settings)
    assert lora_job.base == pinned  # a LoRA job's shared base is the preloaded one
    budget = MemoryBudget(limit=pinned[1] + lora_job.own, min_residency_s=0, pinned={pinned})
    assert budget.used == pinned[1]  # no job held yet
    assert budget.make_room(lora_job, now=0) == []  # it fits beside its base, counted once
    budget.hold("lora", lora_job, now=0)
    assert budget.used == pinned[1] + lora_job.own
    assert budget.make_room(job_cost(job_spec(), settings), now=1) is None  # a full copy does not fit beside it
    budget.release("lora")
    assert budget.used == pinned[1]
    assert preloadable(MODEL, settings)
    assert not preloadable(MODEL, settings.model_copy(update={"share_lora_base": False}))


async def test_an_actor_holds_what_its_budget_allows_and_jobs_take_turns(fleet: Fleet) -> None:
    spec = job_spec(rollout={"samples_per_prompt": 2, "max_new_tokens": 4}, train={"task_ack_wait_s": 30.0})
    cost = job_cost(spec, ActorSettings(actor_id="a")).own
    budget_mb = (cost * 3 // 2) // MIB + 1  # room for one job, not two
    jobs = [await fleet.create_job(spec, [], tenant=f"t{i}") for i in range(2)]
    for job in jobs:
        await fleet.publish_weights(job, 0)
        for index in range(40):
            await fleet.publish_task(job, index, f"What is {index} + 1?", str(index + 1))
    port = free_port()
    fleet.start_actor("budget", f"memory_budget_mb={budget_mb}", "job_min_residency_s=3", f"metrics_port={port}")
    committed: list[float] = []

    async def both_served() -> bool:
        with contextlib.suppress(OSError):  # until the actor's metrics server is up
            committed.append(scrape(port, "fleetrl_actor_memory_committed_bytes"))
        counts = [(await fleet.replay.stats(job)).inserted for job in jobs]
        return min(counts) >= 3

    started = time.monotonic()
    await wait_until(both_served, 180, "tasks of both jobs stored")
    await asyncio.sleep(0)
    dropped = sum(scrape(port, "fleetrl_actor_jobs_dropped_total", job=job) for job in jobs)
    fleet.stop_all()
    assert scrape_budget_ok(committed, budget_mb * MIB, cost), committed
    assert dropped >= 1  # the jobs took turns: one was dropped to make room for the other
    print(f"two jobs on a budget of one: both served within {time.monotonic() - started:.1f}s, {dropped:g} drops")


def scrape_budget_ok(samples: list[float], budget: int, cost: int) -> bool:
    """Every sample of the committed bytes is within the budget, and some held a job."""
    return all(sample <= budget for sample in samples) and max(samples) == cost
