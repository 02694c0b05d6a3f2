"""The feeder: the staleness bound as pure functions of counters, and real publishing to JetStream."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from learner_fleet import prompts_jsonl, spec_for

from fleetrl.errors import ConfigError
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.spec import seeding
from fleetrl.tasks import bus, ledger
from fleetrl.tasks.feeder import (
    Feeder,
    FeederCursor,
    in_flight_limit,
    parse_prompts,
    sample_min_version,
    tasks_to_publish,
)
from fleetrl.tasks.jobbus import JobBus
from fleetrl.tasks.ledger import Ledger


def test_in_flight_is_bounded() -> None:
    assert in_flight_limit(8, 0) == 8 and in_flight_limit(8, 2) == 24
    assert tasks_to_publish(FeederCursor(published=0, settled=0), 8, 1) == 16
    assert tasks_to_publish(FeederCursor(published=16, settled=0), 8, 1) == 0
    assert tasks_to_publish(FeederCursor(published=16, settled=8), 8, 1) == 8
    assert tasks_to_publish(FeederCursor(published=3, settled=5), 8, 0) == 8  # over-settled never exceeds


@given(st.integers(0, 500), st.integers(0, 20), st.integers(1, 16), st.integers(0, 40))
def test_sampled_groups_respect_the_bound(version: int, max_staleness: int, pps: int, group_version: int) -> None:
    """Whatever replay returns at or above sample_min_version is fresh (at most max_staleness
    versions behind); anything below is not."""
    minimum = sample_min_version(version, max_staleness)
    assert minimum >= 0
    if group_version >= minimum:
        assert version - group_version <= max_staleness
    elif version >= max_staleness:
        assert not version - group_version <= max_staleness


@given(st.integers(0, 20), st.integers(1, 8), st.integers(1, 60))
def test_simulated_pipeline_never_trains_stale(max_staleness: int, pps: int, steps: int) -> None:
    """Simulate the loop: tasks tagged at publish, generated at the newest weights >= tag, trained
    fifo at sample_min_version; staleness of every trained group stays within max_staleness."""
    cursor, queue = FeederCursor(), []  # queue: generation versions of the groups in replay
    for version in range(steps):
        for _ in range(tasks_to_publish(cursor, pps, max_staleness)):
            queue.append(version)  # the task's tag is the newest version; worst case: generated at it
            cursor.published += 1
        assert cursor.published - cursor.settled <= in_flight_limit(pps, max_staleness)
        trained = 0
        while trained < pps and queue:
            g = queue.pop(0)
            cursor.settled += 1
            if g >= sample_min_version(version, max_staleness):
                assert version - g <= max_staleness
                trained += 1
        assert trained == pps  # with prompt generation keeping up, nothing is ever dropped


async def test_strictly_on_policy_tags_current_version(nats_url: str, redis_url: str) -> None:
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    await bus.ensure_streams(js)
    redis = aioredis.Redis.from_url(redis_url)
    feeder = Feeder(JobBus(nc, "jt"), Ledger(redis), 0, spec_for(max_staleness=0), parse_prompts(prompts_jsonl(3)))
    assert await feeder.top_up(5) == 2  # prompts_per_step 2, max_staleness 0
    sub = await js.pull_subscribe(bus.task_subject("jt"), durable="check")
    tags = [common_pb2.Task.FromString(m.data).min_policy_version for m in await sub.fetch(2, timeout=2)]
    await nc.close()
    await redis.aclose()
    assert tags == [5, 5] and sample_min_version(5, 0) == 5 and not 5 - 4 <= 0


def test_parse_prompts_keeps_metadata() -> None:
    prompts = parse_prompts(b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n')
    assert [p.text for p in prompts] == ["a", "b"] and prompts[0].metadata_json == '{"answer": "1"}'
    with pytest.raises(ConfigError, match="line 1"):
        parse_prompts(b'{"text": "x"}\n')


async def test_feeder_publishes_shuffled_dedups_and_crosses_epochs(nats_url: str, redis_url: str) -> None:
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    await bus.ensure_streams(js)
    spec = spec_for(max_staleness=1)  # prompts_per_step 2 -> 4 in flight
    prompts = parse_prompts(prompts_jsonl(3))
    redis = aioredis.Redis.from_url(redis_url)
    feeder = Feeder(JobBus(nc, "jf"), Ledger(redis), 0, spec, prompts)
    assert await feeder.top_up(0) == 4 and await feeder.top_up(0) == 0
    assert feeder.cursor == FeederCursor(epoch=1, position=1, published=4, settled=0)
    feeder.settle(2)
    cursor = FeederCursor(epoch=1, position=0, published=3, settled=2)
    again = Feeder(JobBus(nc, "jf"), Ledger(redis), 0, spec, prompts, cursor)
    assert await again.top_up(7) == 3  # re-publishes (1, order[0]): dropped by Nats-Msg-Id dedup
    sub = await js.pull_subscribe(bus.task_subject("jf"), durable="check")
    msgs = await sub.fetch(10, timeout=2)
    tasks = [common_pb2.Task.FromString(m.data) for m in msgs]
    await nc.close()
    order0, order1 = seeding.prompt_order(3, spec.seed, 0), seeding.prompt_order(3, spec.seed, 1)
    expected = [seeding.task_id(0, i) for i in order0] + [seeding.task_id(1, i) for i in order1]
    assert [t.task_id for t in tasks] == expected  # 6 distinct tasks, the duplicate dropped
    assert {t.decode() for t in await redis.smembers(ledger.key("jf", "pub"))} == set(expected)  # recorded once
    await redis.aclose()
    assert [t.min_policy_version for t in tasks] == [0, 0, 0, 0, 7, 7]
    assert tasks[0].metadata_json and tasks[0].prompt.startswith("What is")
