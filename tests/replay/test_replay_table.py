"""ReplayService semantics over a real Valkey and a real gRPC server: dedup, leases, samplers."""

from __future__ import annotations

import asyncio
import collections
import typing

import grpc
import pytest
import redis.asyncio as aioredis
from replay_helpers import configure, make_group

from fleetrl.errors import FailedPrecondition, InvalidArgument, NotFound
from fleetrl.proto.fleetrl.v1 import common_pb2, replay_pb2
from fleetrl.replay.client import DUPLICATE, INSERTED, ReplayClient
from fleetrl.replay.samplers import SAMPLERS, SAMPLERS_BY_KIND
from fleetrl.replay.table import ReplayTables, TableConfig
from fleetrl.runtime.grpcutil import field_violations
from fleetrl.services.replay import convert
from fleetrl.services.replay.server import Running
from fleetrl.spec.config import ReplayConfig, SamplerName


async def test_concurrent_duplicate_inserts_store_one_copy(replay_service: Running) -> None:
    addr = f"127.0.0.1:{replay_service.port}"
    clients = [ReplayClient(addr) for _ in range(4)]
    await configure(clients[0], "j", capacity_groups=1000)
    groups = [make_group("j", f"0/{i}") for i in range(50)]

    async def insert_all(client: ReplayClient) -> list[int]:
        outcomes = []
        for start in range(0, 50, 5):
            outcomes += await client.insert(groups[start:start + 5])
        return outcomes

    results = await asyncio.gather(*(insert_all(c) for c in clients))
    per_task = collections.Counter(i for outcomes in results for i, o in enumerate(outcomes) if o == INSERTED)
    assert per_task == {i: 1 for i in range(50)}
    assert sum(o == DUPLICATE for outcomes in results for o in outcomes) == 150
    stats = await clients[0].stats("j")
    assert (stats.size_groups, stats.inserted, stats.duplicates) == (50, 50, 150)
    for c in clients:
        await c.close()


async def test_fifo_lease_commit_and_late_duplicate(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=100)
    await replay.insert([make_group("j", f"0/{i}") for i in range(5)])
    lease, groups, _ = await replay.sample("j", 3)
    assert [g.task_id for g in groups] == ["0/0", "0/1", "0/2"]
    assert await replay.commit("j", lease) == 3
    assert await replay.commit("j", lease) == 0  # twice: a no-op
    assert await replay.insert([make_group("j", "0/1")]) == [DUPLICATE]  # dedup outlives consumption
    lease2, rest, _ = await replay.sample("j", 10)
    assert [g.task_id for g in rest] == ["0/3", "0/4"]
    stats = await replay.stats("j")
    assert (stats.size_groups, stats.leased_groups, stats.committed, stats.sampled) == (2, 2, 3, 5)
    assert await replay.release("j", lease2) == 2
    assert (await replay.stats("j")).leased_groups == 0


async def test_a_stale_learners_commit_is_fenced(replay: ReplayClient) -> None:
    """ConfigureTable under epoch 2 raises the fence: epoch 1 can neither commit nor configure."""
    spec = ReplayConfig.model_validate({"capacity_groups": 10})
    await replay.configure("jfence", spec, lease_epoch=1)
    await replay.insert([make_group("jfence", "0/0")])
    stale_lease, _, _ = await replay.sample("jfence", 1)
    await replay.configure("jfence", spec, lease_epoch=2)
    with pytest.raises(FailedPrecondition, match="lease epoch 1"):
        await replay.commit("jfence", stale_lease, lease_epoch=1)
    with pytest.raises(FailedPrecondition, match="lease epoch 1"):
        await replay.configure("jfence", spec, lease_epoch=1)
    assert (await replay.stats("jfence")).committed == 0
    assert await replay.commit("jfence", stale_lease, lease_epoch=2) == 1


async def test_lease_expiry_after_learner_crash_returns_groups(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=100, lease_timeout_s=0.3)
    await replay.insert([make_group("j", f"0/{i}") for i in range(4)])
    crashed_lease, groups, _ = await replay.sample("j", 4)
    assert len(groups) == 4
    assert (await replay.sample("j", 4))[1] == []  # all leased
    await asyncio.sleep(0.8)  # the learner "crashed": it never commits
    with pytest.raises(NotFound, match="expired"):
        await replay.commit("j", crashed_lease)
    lease, again, _ = await replay.sample("j", 4)
    assert sorted(g.task_id for g in again) == [f"0/{i}" for i in range(4)]
    assert await replay.commit("j", lease) == 4
    stats = await replay.stats("j")
    assert (stats.size_groups, stats.committed, stats.expired_leases) == (0, 4, 1)


async def test_renewed_lease_outlives_its_timeout_and_expired_ones_stay_expired(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=100, lease_timeout_s=0.6)
    await replay.insert([make_group("j", f"0/{i}") for i in range(4)])
    held, _, _ = await replay.sample("j", 2)
    dropped, _, _ = await replay.sample("j", 2)
    for _ in range(4):  # 1.2 s, twice the timeout: only the renewed lease survives
        await asyncio.sleep(0.3)
        assert await replay.renew("j", [held]) == []
    assert await replay.renew("j", [held, dropped, "unknown"]) == [dropped, "unknown"]
    assert await replay.commit("j", held) == 2
    assert await replay.renew("j", [held]) == [held]  # committed: not open any more
    stats = await replay.stats("j")
    assert (stats.size_groups, stats.leased_groups, stats.committed, stats.expired_leases) == (2, 0, 2, 1)
    with pytest.raises(NotFound):
        await replay.renew("no-such-job", [held])


async def test_fifo_staleness_filter_drops_and_counts(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=100)
    await replay.insert([make_group("j", f"0/{i}", policy_version=i % 3) for i in range(9)])
    _, groups, stale = await replay.sample("j", 10, min_policy_version=1)
    assert stale == 3
    assert sorted(g.policy_version for g in groups) == [1, 1, 1, 2, 2, 2]
    assert (await replay.stats("j")).stale_dropped == 3


async def test_uniform_reuse_limit_and_staleness_skip(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=100, sampler="uniform", max_reuse=3)
    await replay.insert([make_group("j", f"0/{i}", policy_version=i % 2) for i in range(10)])
    uses: collections.Counter[str] = collections.Counter()
    for _ in range(20):
        lease, groups, stale = await replay.sample("j", 2, min_policy_version=1)
        assert stale == 0 and all(g.policy_version == 1 for g in groups)
        uses.update(g.task_id for g in groups)
        if lease:
            await replay.commit("j", lease)
    assert uses == {f"0/{i}": 3 for i in range(1, 10, 2)}  # each eligible group used exactly max_reuse times
    stats = await replay.stats("j")
    assert (stats.size_groups, stats.stale_dropped, stats.committed) == (5, 0, 15)
    records = await replay.query("j", min_policy_version=1, max_policy_version=1)
    assert {r.task_id: r.times_committed for r in records} == {f"0/{i}": 3 for i in range(1, 10, 2)}


async def test_prioritized_prefers_high_priority(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=100, sampler="prioritized", max_reuse=1000)
    hot = make_group("j", "hot", rewards=(0.0, 1.0))
    hot.priority = 100.0
    await replay.insert([hot, *[make_group("j", f"cold{i}", rewards=(1.0, 1.0)) for i in range(9)]])
    picks: collections.Counter[str] = collections.Counter()
    for seed in range(1, 41):
        lease, groups, _ = await replay.sample("j", 1, seed=seed)
        picks.update(g.task_id for g in groups)
        await replay.release("j", lease)
    assert picks["hot"] >= 38


async def test_capacity_evicts_oldest_unleased(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=3)
    await replay.insert([make_group("j", f"0/{i}") for i in range(2)])
    lease, _, _ = await replay.sample("j", 1)  # 0/0 leased: never evicted
    await replay.insert([make_group("j", f"0/{i}") for i in range(2, 5)])
    stats = await replay.stats("j")
    assert (stats.size_groups, stats.evicted) == (3, 2)
    _, groups, _ = await replay.sample("j", 10)
    assert [g.task_id for g in groups] == ["0/3", "0/4"]
    assert await replay.commit("j", lease) == 1


async def test_query_lineage_by_version_and_reward(replay: ReplayClient) -> None:
    await configure(replay, "j", capacity_groups=100)
    await replay.insert([make_group("j", f"0/{i}", policy_version=i, rewards=(i / 10, i / 10), actor=f"a{i}")
                         for i in range(10)])
    lease, _, _ = await replay.sample("j", 10)
    await replay.commit("j", lease)  # lineage survives consumption
    records = await replay.query("j", min_policy_version=2, max_policy_version=7, min_reward=0.35, max_reward=1)
    assert sorted(r.task_id for r in records) == ["0/4", "0/5", "0/6", "0/7"]
    r = next(r for r in records if r.task_id == "0/5")
    assert (r.policy_version, r.lineage.actor_id, r.lineage.trace_id, r.times_committed) == (5, "a5", "ab" * 16, 1)
    assert r.mean_reward == pytest.approx(0.5)
    assert list(r.episode_turns) == [] and list(r.episode_status) == []  # single-turn groups


async def test_lineage_of_a_multi_turn_group_keeps_each_episodes_turns_and_end(replay: ReplayClient) -> None:
    await configure(replay, "jm", capacity_groups=10)
    group = make_group("jm", "0/0", rewards=(1.0, 0.0, 0.5))
    ends = [common_pb2.EPISODE_STATUS_DONE, common_pb2.EPISODE_STATUS_MAX_TURNS, common_pb2.EPISODE_STATUS_ENV_ERROR]
    for sample, turns, end in zip(group.samples, (2, 3, 1), ends, strict=True):
        sample.turns.extend(common_pb2.Turn(start=k, end=k + 1) for k in range(turns))
        sample.episode_status = end
    await replay.insert([group])
    (record,) = await replay.query("jm")
    assert list(record.episode_turns) == [2, 3, 1] and list(record.episode_status) == ends
    assert record.lineage.actor_id == "actor-1" and record.lineage.trace_id == "ab" * 16


async def test_bad_input_gets_clear_errors_and_server_keeps_serving(
        replay: ReplayClient, replay_service: Running) -> None:
    with pytest.raises(NotFound, match="ConfigureTable"):
        await replay.insert([make_group("nojob", "0/0")])
    await configure(replay, "j", capacity_groups=10)
    with pytest.raises(InvalidArgument, match="at least one sample"):
        await replay.insert([make_group("j", "0/0", rewards=())])
    stub = replay._channel.stubs.replay
    bad = make_group("j", "0/1")
    del bad.samples[1].behaviour_logprobs[1:]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Insert(replay_pb2.InsertRequest(groups=[bad]), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(info.value) == [("groups[0].samples[1].behaviour_logprobs",
                                             "1 log-probs for 4 completion tokens")]
    big = [make_group("j", f"big{i}", tokens=120_000) for i in range(22)]  # ~36 MB: over 32 MiB, under 64 MiB
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Insert(replay_pb2.InsertRequest(groups=big), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over the limit" in (info.value.details() or "")
    with pytest.raises(InvalidArgument):
        await replay.sample("", 1)
    assert await replay.insert([make_group("j", "0/2")]) == [INSERTED]
    assert (await replay.stats("j")).inserted == 1


async def test_one_insert_call_dedups_evicts_and_trims_lineage_per_group(redis_url: str) -> None:
    """A batch is one script call: a duplicate inside the batch, eviction and the lineage bound
    all apply group by group, as if the groups came one per call."""
    client = aioredis.Redis.from_url(redis_url)
    tables = ReplayTables(client, max_lineage_records=3)
    await tables.configure("jb", TableConfig.queue(capacity_groups=2))
    groups = [make_group("jb", f"0/{i}", policy_version=i) for i in range(4)] + [make_group("jb", "0/1")]
    records = [convert.to_record(g, g.SerializeToString()) for g in groups]
    assert await tables.insert(records) == ([True, True, True, True, False], 2)
    assert await tables.insert(records[:1]) == ([False], 0)  # dedup outlives eviction
    stats = await tables.stats("jb")
    rows = await tables.query("jb", 0, None, None, 100)
    result = await tables.sample("jb", 10)
    await client.aclose()
    assert (stats.size_groups, stats.inserted, stats.duplicates, stats.evicted) == (2, 4, 2, 2)
    assert sorted(r.task_id for r in rows) == ["0/1", "0/2", "0/3"]  # the 3 newest versions
    assert [common_pb2.Group.FromString(p).task_id for p in result.payloads] == ["0/2", "0/3"]


def test_the_spec_and_the_samplers_share_one_vocabulary() -> None:
    """Every name a job spec may give `replay.sampler` is a sampler, and every sampler has a name there and
    a kind on the wire (the learner, the ledger, the client and the table all look samplers up here)."""
    assert set(typing.get_args(SamplerName)) == set(SAMPLERS)
    assert {s.kind for s in SAMPLERS.values()} == set(SAMPLERS_BY_KIND) - {replay_pb2.SAMPLER_KIND_UNSPECIFIED}
    assert [SAMPLERS[name].trainings_per_group(3) for name in ("fifo", "uniform", "prioritized")] == [1, 3, 3]
