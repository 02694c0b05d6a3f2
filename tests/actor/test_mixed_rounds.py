"""Two LoRA jobs on one actor's shared base share its rounds: a round led by one job takes the other's
queued tasks too, and both jobs' groups come out of one mixed-adapter batch (fleetrl.rollout.batching,
fleetrl.policy.shared_base.generate_mixed). Each group is its own job's: its behaviour log-probs are
those of its job's adapter, far from the other's; every task is stored once. An actor SIGKILLed holding
both jobs' tasks in one round: each is redelivered and stored once by the next actor."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter

import torch
from test_episodes import scrape
from test_shared_base import LORA, version

from fleetrl.launcher.embedded import free_port
from fleetrl.policy.backends import LOGPROB_TOL, make_backend
from fleetrl.weights.store import encode_safetensors
from tests.actor.actor_fleet import MODEL, Fleet, job_spec, wait_until

ACK_WAIT_S = 3.0
"""job_spec's `task_ack_wait_s`: how long after the kill its tasks are redelivered."""

TASKS = 12
KILL_TASKS = 4
"""Each job's tasks in the kill test: k1's first round holds some of both, k2 stores them all."""


def logprobs_under(backend: object, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """A completion's log-probs under a backend's model (temperature 1), from one full forward."""
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]  # type: ignore[attr-defined]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


async def test_jobs_on_one_base_share_rounds_each_through_its_own_adapter(fleet: Fleet) -> None:
    spec = job_spec(rollout={"samples_per_prompt": 2, "max_new_tokens": 6, "prompts_per_step": 2},
                    train={"task_ack_wait_s": 30.0, "lora": LORA.model_dump()})
    adapters = {}
    for name, seed in (("a", 1), ("b", 2)):
        job = await fleet.create_job(spec, [], tenant=f"tenant-{name}")
        adapters[job] = version(seed)
        await fleet.weights.publish(job, 0, encode_safetensors({k: v.contiguous() for k, v in adapters[job].items()}),
                                    "float32", adapter_of=MODEL)
    for job in adapters:
        for index in range(TASKS):
            await fleet.publish_task(job, index, f"What is {index} + 1?", str(index + 1))
    port = free_port()
    fleet.start_actor("mixed", "backend=hf", "dtype=float32", f"metrics_port={port}")

    async def all_stored() -> bool:
        return [(await fleet.replay.stats(job)).inserted for job in adapters] == [TASKS] * len(adapters)

    await wait_until(all_stored, 180, "every task of both jobs stored")
    batches = {job: (scrape(port, "fleetrl_actor_batch_groups_sum", job=job),
                     scrape(port, "fleetrl_actor_batch_groups_count", job=job)) for job in adapters}
    fleet.stop_all()
    groups, count = sum(g for g, _ in batches.values()), sum(c for _, c in batches.values())
    print(f"mixed rounds: {count:g} batches of {groups / count:.2f} groups on average ({batches})")
    assert groups == 2 * TASKS and groups / count > spec.rollout.prompts_per_step  # riders joined the rounds

    merged = {job: make_backend("hf", MODEL, dtype="float32", device="cpu", lora=LORA) for job in adapters}
    with contextlib.ExitStack() as stack:
        for job, backend in merged.items():
            backend.load_adapter(adapters[job])
            stack.callback(backend.close)
        for job, other in zip(adapters, reversed(list(adapters)), strict=True):
            _, groups, _ = await fleet.replay.sample(job, 4)  # leased, never committed: the ledger keeps them
            assert len(groups) == 4
            for group in groups:
                assert group.lineage.actor_id == "mixed"
                for sample in group.samples[:1]:
                    prompt, tokens = list(sample.prompt_token_ids), list(sample.completion_token_ids)
                    behaviour = torch.tensor(list(sample.behaviour_logprobs))
                    own = (logprobs_under(merged[job], prompt, tokens) - behaviour).abs().max()
                    assert own <= LOGPROB_TOL[torch.float32], (job, float(own))
                    assert (logprobs_under(merged[other], prompt, tokens) - behaviour).abs().max() > 100 * own
    for job in adapters:
        counts = (await fleet.ledger.account(fleet.js, job)).counts
        assert counts["lost"] == counts["duplicated"] == 0 and counts["published"] == TASKS, counts


async def test_an_actor_killed_holding_two_jobs_tasks_loses_and_duplicates_nothing(fleet: Fleet) -> None:
    """An actor SIGKILLed mid-round while it holds tasks of both LoRA jobs (a mixed round): each of those
    tasks is redelivered to the next actor, and each job's ledger shows every task stored once."""
    spec = job_spec(rollout={"samples_per_prompt": 4, "max_new_tokens": 32, "prompts_per_step": 2},
                    train={"lora": LORA.model_dump(), "max_retries_per_episode": 10})
    jobs = []
    for name, seed in (("a", 1), ("b", 2)):
        job = await fleet.create_job(spec, [], tenant=f"tenant-{name}")
        adapter = {k: v.contiguous() for k, v in version(seed).items()}
        await fleet.weights.publish(job, 0, encode_safetensors(adapter), "float32", adapter_of=MODEL)
        jobs.append(job)
    for job in jobs:
        for index in range(KILL_TASKS):
            await fleet.publish_task(job, index, f"What is {index} + 1?", str(index + 1))
    fleet.start_actor("k1", "backend=hf", "dtype=float32")

    async def held_of_both() -> dict[str, set[str]] | None:
        """The tasks k1 received and has not stored, per job, once it holds some of each job's."""
        text = fleet.log_text("k1")
        held = {}
        for job in jobs:
            received = set(re.findall(rf"job {job} task (\S+) delivery 1 received", text))
            held[job] = received - {r.task_id for r in await fleet.replay.query(job, limit=1000)}
        return held if all(held.values()) else None

    held = await wait_until(held_of_both, 180, "k1 holding tasks of both jobs")
    fleet.kill("k1")
    fleet.start_actor("k2", "backend=hf", "dtype=float32")

    async def all_stored() -> bool:
        return [(await fleet.replay.stats(job)).inserted for job in jobs] == [KILL_TASKS] * len(jobs)

    await wait_until(all_stored, 240, "every task of both jobs stored")
    await asyncio.sleep(ACK_WAIT_S + 1)  # a late redelivery would show up as a duplicate insert
    fleet.stop_all()
    for job in jobs:
        stats, records = await fleet.replay.stats(job), await fleet.replay.query(job, limit=1000)
        by_task = {r.task_id: r.lineage for r in records}
        print(f"job {job}: k1 held {sorted(held[job])} when killed; stored by "
              f"{Counter(lineage.actor_id for lineage in by_task.values())}")
        assert stats.inserted == stats.size_groups == KILL_TASKS and len(records) == KILL_TASKS
        assert sorted(by_task) == sorted(f"0/{i}" for i in range(KILL_TASKS))
        for task in held[job]:  # each task k1 held went to k2 on a later delivery
            assert by_task[task].actor_id == "k2" and by_task[task].delivery_attempt > 1, (task, by_task[task])
        counts = (await fleet.ledger.account(fleet.js, job)).counts
        assert counts["lost"] == counts["duplicated"] == 0 and counts["published"] == KILL_TASKS, counts
