"""The end-to-end ledger: every fate, from real records in Valkey (replay's own scripts) and NATS."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from fleetrl.errors import Fenced
from fleetrl.jobs import store as jobs
from fleetrl.replay.table import GroupRecord, ReplayTables, TableConfig
from fleetrl.tasks import bus
from fleetrl.tasks.ledger import Fate, Ledger

JOB = "jl"


def record(task_id: str, policy_version: int) -> GroupRecord:
    return GroupRecord(JOB, task_id, policy_version, 0.0, 1.0, b"group " + task_id.encode())


async def test_every_fate_and_duplicates(nats_url: str, redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    await bus.ensure_streams(js)
    ledger, tables = Ledger(redis), ReplayTables(redis)
    await tables.configure(JOB, TableConfig.queue(capacity_groups=2))
    await ledger.published(JOB, [f"0/{i}" for i in range(7)], lease_epoch=0)
    await tables.insert([record("0/0", 1), record("0/1", 0)])
    sampled = await tables.sample(JOB, 1, min_policy_version=1)  # 0/1 dropped stale, 0/0 leased
    assert sampled.stale_dropped == 1
    await ledger.trained(JOB, 1, ["0/0"], lease_epoch=0)
    await tables.commit(JOB, sampled.lease_id)
    await tables.insert([record("0/2", 1), record("0/5", 1), record("0/6", 1)])  # capacity 2: 0/2 evicted
    await js.publish(bus.task_subject(JOB), b"task", headers={"Nats-Msg-Id": bus.task_msg_id(JOB, 0, 3)})
    await js.publish(bus.dlq_subject(JOB), b"task", headers={
        "Fleet-Original-Msg-Id": bus.task_msg_id(JOB, 0, 4), "Fleet-Reason": "RuntimeError: boom",
        "Fleet-Deliveries": "3"})
    await redis.hdel("fleetrl:ledger:jl:fate", "0/6")  # as if replay had lost 0/6 without a trace

    accounting = await ledger.account(js, JOB)
    fates = {t.task_id: t for t in accounting.tasks}
    assert {t: a.fate for t, a in fates.items()} == {
        "0/0": Fate.TRAINED, "0/1": Fate.STALE, "0/2": Fate.EVICTED, "0/3": Fate.IN_FLIGHT,
        "0/4": Fate.DEAD_LETTERED, "0/5": Fate.PENDING, "0/6": Fate.LOST}
    assert fates["0/0"].steps == (1,) and fates["0/4"].reason == "RuntimeError: boom"
    assert (fates["0/6"].epoch, fates["0/6"].prompt_index) == (0, 6)
    assert accounting.counts["lost"] == 1 and accounting.counts["published"] == 7 and not accounting.balanced

    await ledger.trained(JOB, 2, ["0/0", "7/0"], lease_epoch=0)  # 0/0 trained twice; 7/0 never published
    again = await ledger.account(js, JOB)
    assert (again.duplicated, again.unpublished) == (1, 1)
    await ledger.forget_steps_after(JOB, 1, lease_epoch=0)  # a learner resumed from step 1 trains step 2 again
    assert (await ledger.account(js, JOB)).duplicated == 0
    await redis.hset(jobs.job_key(JOB), "lease_epoch", 2)  # the job was claimed twice: epoch 1 is stale
    for stale_write in (ledger.published(JOB, ["0/9"], lease_epoch=1), ledger.trained(JOB, 2, ["0/5"], lease_epoch=1),
                        ledger.forget_steps_after(JOB, 0, lease_epoch=1)):
        with pytest.raises(Fenced, match="lease epoch 1"):
            await stale_write
    after = await ledger.account(js, JOB)
    assert after.counts == again.counts | {"duplicated": 0, "unpublished": 0}  # nothing of epoch 1 landed
    await nc.close()
    await redis.aclose()
