"""Job store: create, idempotency, state machine, one-learner leases, step metrics."""

from __future__ import annotations

import asyncio

import pytest

from fleetrl.errors import FailedPrecondition, Fenced, NotFound
from fleetrl.jobs.store import JobState, JobStore
from fleetrl.spec.config import JobSpec

SPEC = JobSpec.model_validate({"prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}})


async def test_create_get_list_and_idempotency(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    a = await store.create("t1", SPEC, b'{"prompt": "x"}\n', None, idempotency_key="k")
    again = await store.create("t1", SPEC, b"", None, idempotency_key="k")
    b = await store.create("t2", SPEC, b"", b"def reward(c, p): return 1\n")
    assert again.job_id == a.job_id
    assert a.state is JobState.QUEUED and a.spec == SPEC
    assert [r.job_id for r in await store.list()] == [b.job_id, a.job_id]
    assert [r.job_id for r in await store.list("t1")] == [a.job_id]
    assert await store.files(b.job_id) == (b"", b"def reward(c, p): return 1\n")
    with pytest.raises(NotFound):
        await store.get("j-nope")
    await store.close()


async def test_terminal_states_are_final(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    job = await store.create("t", SPEC, b"", None)
    await store.set_state(job.job_id, JobState.CANCELLED, "user asked")
    with pytest.raises(FailedPrecondition, match="cancelled"):
        await store.set_state(job.job_id, JobState.SUCCEEDED)
    assert (await store.get(job.job_id)).reason == "user asked"
    await store.close()


async def test_one_learner_per_job_and_orphans_are_reclaimed(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    job = await store.create("t", SPEC, b"", None)
    claims = await asyncio.gather(*(store.claim(f"L{i}", lease_s=0.3) for i in range(5)))
    assert [c.job_id for c in claims if c] == [job.job_id]
    assert await store.claim("L9", lease_s=0.3) is None
    await asyncio.sleep(0.4)  # the owner died without renewing
    resumed = await store.claim("L9", lease_s=5)
    assert resumed is not None and resumed.state is JobState.RUNNING
    assert not await store.renew(job.job_id, "L0", 5)
    assert await store.renew(job.job_id, "L9", 5)
    # fencing: the first claim's epoch is stale now; its writes are refused, the new claim's are not
    [first] = [c for c in claims if c]
    assert (first.lease_epoch, resumed.lease_epoch) == (1, 2)
    with pytest.raises(Fenced, match="lease epoch 1"):
        await store.append_step(job.job_id, {"step": 1, "loss": 1.0}, lease_epoch=1)
    with pytest.raises(Fenced):
        await store.check_fence(job.job_id, 1, "a checkpoint")
    await store.check_fence(job.job_id, 2, "a checkpoint")
    await store.append_step(job.job_id, {"step": 1, "loss": 2.0}, lease_epoch=2)
    assert [m["loss"] for m in await store.steps(job.job_id)] == [2.0]
    await store.close()


async def test_steps_are_recorded_once(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    job = await store.create("t", SPEC, b"", None)
    for step in (1, 2, 2, 3):
        await store.append_step(job.job_id, {"step": step, "loss": float(step)}, lease_epoch=0)
    assert [m["step"] for m in await store.steps(job.job_id)] == [1, 2, 3]
    assert [m["step"] for m in await store.steps(job.job_id, from_step=2)] == [2, 3]
    assert (await store.get(job.job_id)).last_step == {"step": 3, "loss": 3.0}
    await store.close()
