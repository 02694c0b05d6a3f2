"""Job store: create, idempotency, state machine, one-learner leases, step metrics."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fleetrl.errors import FailedPrecondition, Fenced, NotFound, Unavailable
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


@pytest.mark.parametrize("locked", [True, False])
async def test_the_submission_lock_serializes_a_tenants_count_and_create(redis_url: str, locked: bool) -> None:
    """Eight concurrent submissions that count the tenant's active jobs, wait 50 ms (a slow moment between
    the count and the create), then create when fewer than 2 are active: under the tenant's submission
    lock exactly 2 jobs exist; without it every one of them counted 0 and created (the race the gateway's
    lock closes, shown here so this test can fail)."""
    store = JobStore.from_url(redis_url)
    tenant = f"lock-{locked}"

    async def submit() -> None:
        async with store.submission_lock(tenant) if locked else contextlib.nullcontext():
            active = sum(1 for r in await store.active_jobs() if r.tenant == tenant)
            await asyncio.sleep(0.05)
            if active < 2:
                await store.create(tenant, SPEC, b"", None)

    await asyncio.gather(*(submit() for _ in range(8)))
    created = await store.list(tenant)
    assert len(created) == (2 if locked else 8)
    async with store.submission_lock(tenant):  # released: taken again at once
        pass
    await store.close()


async def test_a_held_submission_lock_is_waited_for_then_refused(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    async with store.submission_lock("waiter"):
        with pytest.raises(Unavailable, match="held its submission lock"):
            async with store.submission_lock("waiter", wait_s=0.2):
                pass
        async with store.submission_lock("someone-else", wait_s=0.2):  # one tenant's lock only
            pass
    await store.close()


async def test_a_job_deleted_while_the_index_is_read_is_skipped(redis_url: str) -> None:
    """Retention or DeleteJob removes a job's hash while another call walks the index: the walk skips it
    (a submission's quota count failed NOT_FOUND naming the deleted job)."""
    store = JobStore.from_url(redis_url)
    kept = await store.create("t-skip", SPEC, b'{"prompt": "x"}\n', None)
    gone = await store.create("t-skip", SPEC, b'{"prompt": "x"}\n', None)
    await store.redis.delete(f"fleetrl:job:{gone.job_id}")  # the hash first, the index entry not yet
    assert gone.job_id not in {r.job_id for r in await store.active_jobs()}
    assert kept.job_id in {r.job_id for r in await store.active_jobs()}
    assert [r.job_id for r in await store.list("t-skip")] == [kept.job_id]
    await store.close()
