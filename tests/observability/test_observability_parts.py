"""The observability parts on their own: heartbeats in a real Valkey, the queue probe on a real NATS,
the fleet view's tenant rules, the actor's activity window, and the gRPC interceptor's metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.actor.metrics import Activity
from services.common import bus, heartbeat, telemetry
from services.common.config import JobSpec
from services.common.errors import NotFound
from services.common.heartbeat import Beat
from services.common.jobs import JobState, JobStore
from services.gateway.checks import Limits
from services.gateway.service import Gateway
from services.proto.fleetrl.v1 import common_pb2
from services.replay.client import ReplayClient
from services.replay.config import ReplaySettings
from services.replay.server import running

SPEC = JobSpec.model_validate({"prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}})


async def test_heartbeats_expire_by_themselves(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    await heartbeat.write(store.redis, Beat("learner", "L", "training", "j-1", 3))
    await heartbeat.write(store.redis, Beat("actor", "b", "generating", "j-1", 2, 10.5, 0.5), ttl_s=0.3)
    await heartbeat.write(store.redis, Beat("actor", "a", "idle"))
    assert [(b.kind, b.member_id) for b in await heartbeat.read_all(store.redis)] == [
        ("actor", "a"), ("actor", "b"), ("learner", "L")]
    assert (await heartbeat.read_all(store.redis))[1].tokens_per_s == 10.5
    await asyncio.sleep(0.5)
    await heartbeat.clear(store.redis, "actor", "a")
    assert [b.member_id for b in await heartbeat.read_all(store.redis)] == ["L"]
    await store.close()


async def test_task_queue_counts_pending_in_flight_and_dead_lettered(nats_url: str) -> None:
    nc = await bus.connect(nats_url, "test")
    js = bus.jetstream(nc)
    await bus.ensure_streams(js)
    assert await bus.task_queue(js, "j-q") == bus.TaskQueue("j-q")  # no consumer yet
    await bus.ensure_job_consumer(js, "j-q", SPEC)
    for index in range(3):
        await js.publish(bus.task_subject("j-q"), b"task", headers={"Nats-Msg-Id": f"j-q/0/{index}"})
    sub = await js.pull_subscribe_bind(durable=bus.task_consumer("j-q"), stream=bus.TASKS_STREAM)
    await sub.fetch(1, timeout=5)
    await js.publish(bus.dlq_subject("j-q"), b"task")
    assert await bus.task_queue(js, "j-q") == bus.TaskQueue("j-q", pending=2, in_flight=1, dead_lettered=1)
    await nc.close()


class Members:
    """A fleet source with fixed members and empty queues."""

    def __init__(self, beats: list[Beat]) -> None:
        self.beats = beats

    async def members(self) -> list[Beat]:
        return self.beats

    async def queue(self, job_id: str) -> bus.TaskQueue:
        return bus.TaskQueue(job_id, pending=7)


async def test_fleet_view_hides_other_tenants_jobs(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    mine = await store.create("alice", SPEC, b'{"prompt": "x"}\n', None)
    theirs = await store.create("bob", SPEC, b'{"prompt": "x"}\n', None)
    done = await store.create("alice", SPEC, b'{"prompt": "x"}\n', None)
    await store.set_state(done.job_id, JobState.CANCELLED, "test")
    beats = [Beat("actor", "a1", "generating", mine.job_id, 4), Beat("actor", "a2", "scoring", theirs.job_id, 9),
             Beat("actor", "a3", "idle", "j-gone", 1)]
    gateway = Gateway(store, _unused(), _unused(), _unused(), Members(beats), Limits(1 << 20, 1 << 20))
    view = await gateway.fleet("alice")
    assert [(m.member_id, m.job_id, m.policy_version) for m in view.members] == [
        ("a1", mine.job_id, 4), ("a2", "", 0), ("a3", "", 0)]
    assert view.queues == [bus.TaskQueue(mine.job_id, pending=7)]
    await store.close()


def _unused() -> Any:
    return object()


def test_activity_window() -> None:
    now = [100.0]
    activity = Activity(window_s=10.0, clock=lambda: now[0])
    now[0] = 102.0
    activity.begin("j")
    activity.set_state("generating")
    activity.add_tokens(40)
    now[0] = 104.0
    assert activity.rates() == (0.5, 10.0)  # busy 2 of 4 s, 40 tokens in 4 s
    activity.end()
    assert activity.state == "idle"
    for second in range(105, 120):
        now[0] = float(second)
        fraction, rate = activity.rates()
    assert (fraction, rate) == (0.0, 0.0)  # the busy stretch left the 10 s window


async def test_interceptor_counts_codes_and_traces_without_a_provider(redis_url: str) -> None:
    """Tracing is off here (no provider): calls still work and are counted by their final code."""
    settings = ReplaySettings(redis_url=redis_url, listen="127.0.0.1:0")
    captured: list[CollectorRegistry] = []
    async with running(settings) as svc, ReplayClient(f"127.0.0.1:{svc.port}", attempts=1) as replay:
        await replay.configure("j-ok", SPEC.replay)
        group = common_pb2.Group(job_id="j-ok", task_id="0/1", samples=[common_pb2.Sample()])
        await replay.insert([group])
        with pytest.raises(NotFound):
            await replay.stats("j-missing")
        captured.append(svc.metrics.registry)
    registry = captured[0]
    handled = {(s.labels["grpc_method"], s.labels["grpc_code"]): s.value
               for family in registry.collect() if family.name == "grpc_server_handled"
               for s in family.samples if s.name.endswith("_total")}
    assert handled == {("ConfigureTable", "OK"): 1, ("Insert", "OK"): 1, ("Stats", "NOT_FOUND"): 1}
    assert telemetry.current_trace_id() == ""

