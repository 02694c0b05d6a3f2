"""The observability parts on their own: heartbeats in a real Valkey, the queue probe on a real NATS,
the fleet view's tenant rules, the actor's activity window, the gRPC interceptor's metrics, the JSONL
span records, and when tracing turns on."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client import CollectorRegistry

from fleetrl.errors import ConfigError, NotFound, Unavailable
from fleetrl.jobs.store import JobState, JobStore
from fleetrl.launcher import top
from fleetrl.proto.fleetrl.v1 import common_pb2
from fleetrl.replay.client import ReplayClient
from fleetrl.rollout.metrics import Activity
from fleetrl.runtime import heartbeat, telemetry
from fleetrl.runtime.heartbeat import Beat
from fleetrl.services.gateway.checks import Limits
from fleetrl.services.gateway.service import Gateway
from fleetrl.services.replay.config import ReplaySettings
from fleetrl.services.replay.server import running
from fleetrl.spec.config import JobSpec
from fleetrl.tasks import bus

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


class Unreachable:
    """A reward checker whose service does not answer."""

    async def describe(self) -> Any:
        raise Unavailable("reward service unreachable at 127.0.0.1:1")


async def test_fleet_view_hides_other_tenants_jobs(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    mine = await store.create("alice", SPEC, b'{"prompt": "x"}\n', None)
    theirs = await store.create("bob", SPEC, b'{"prompt": "x"}\n', None)
    done = await store.create("alice", SPEC, b'{"prompt": "x"}\n', None)
    await store.set_state(done.job_id, JobState.CANCELLED, "test")
    beats = [Beat("actor", "a1", "generating", mine.job_id, 4), Beat("actor", "a2", "scoring", theirs.job_id, 9),
             Beat("actor", "a3", "idle", "j-gone", 1)]
    gateway = Gateway(store, Unreachable(), _unused(), _unused(), Members(beats), Limits(1 << 20, 1 << 20))  # type: ignore[arg-type]
    view = await gateway.fleet("alice")
    assert view.reward_sandbox == "reward service not answering: reward service unreachable at 127.0.0.1:1"
    assert [(m.member_id, m.job_id, m.policy_version) for m in view.members] == [
        ("a1", mine.job_id, 4), ("a2", "", 0), ("a3", "", 0)]
    assert view.queues == [bus.TaskQueue(mine.job_id, pending=7)]
    await store.close()


async def test_a_tenant_sees_its_share_of_actor_time_and_the_others_only_together(redis_url: str) -> None:
    store = JobStore.from_url(redis_url)
    alice = await store.create("alice", SPEC, b'{"prompt": "x"}\n', None, weight=2.0)
    bob = await store.create("bob", SPEC, b'{"prompt": "x"}\n', None, weight=1.0)
    carol = await store.create("carol", SPEC, b'{"prompt": "x"}\n', None, weight=1.0)
    beats = [Beat("actor", "a1", "generating", alice.job_id, 1, served_s={alice.job_id: 12.0, bob.job_id: 6.0}),
             Beat("actor", "a2", "generating", carol.job_id, 1, served_s={carol.job_id: 6.0, "j-gone": 30.0})]
    gateway = Gateway(store, Unreachable(), _unused(), _unused(), Members(beats), Limits(1 << 20, 1 << 20))  # type: ignore[arg-type]
    view = await gateway.fleet("alice")
    assert [(s.tenant, s.jobs, s.weight, s.served_s, s.share, s.fair_share) for s in view.shares] == [
        ("alice", 1, 2.0, 12.0, 0.5, 0.5), ("", 2, 2.0, 12.0, 0.5, 0.5)]  # a deleted job's seconds count for nobody
    assert [m.served_s for m in view.members] == [{alice.job_id: 12.0}, {}]  # bob's and carol's jobs stay hidden
    assert [s.tenant for s in (await gateway.fleet("bob")).shares] == ["bob", ""]
    assert (await gateway.fleet("dave")).shares[0] == type(view.shares[0])("dave", 0, 0.0, 0.0, 0.0, 0.0)
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


def test_activity_window_splits_busy_time_by_job() -> None:
    now = [100.0]
    activity = Activity(window_s=10.0, clock=lambda: now[0])
    activity.begin("j-a")
    now[0] = 103.0
    activity.end()
    activity.begin("j-b")
    now[0] = 104.0
    activity.rates()
    assert activity.served_s() == {"j-a": 3.0, "j-b": 1.0}  # the task in hand counts up to now
    for second in range(105, 116):  # a beat a second, as the actor's heartbeat loop calls it
        now[0] = float(second)
        activity.rates()
    assert activity.served_s() == {"j-b": 10.0}  # j-a's stretch left the 10 s window; j-b's task still runs


def test_a_mixed_rounds_busy_time_is_split_by_its_jobs_shares() -> None:
    now = [100.0]
    activity = Activity(window_s=10.0, clock=lambda: now[0])
    activity.begin("j-lead")  # a round led by j-lead, with j-rider's tasks riding in its batch
    now[0] = 104.0
    activity.end({"j-lead": 96.0, "j-rider": 32.0})  # new tokens each job's groups could make
    activity.rates()
    assert activity.served_s() == {"j-lead": 3.0, "j-rider": 1.0}


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



def test_jsonl_exporter_keeps_kind_status_links_and_events(tmp_path: Any) -> None:
    path = tmp_path / "traces" / "test.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(telemetry.JsonlSpanExporter(path)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("step") as step:
        pass
    with tracer.start_as_current_span("call", kind=trace.SpanKind.CLIENT,
                                      links=[trace.Link(step.get_span_context(), {"why": "trained"})]) as call:
        call.add_event("retry", {"attempt": 2})
        call.set_status(trace.StatusCode.ERROR, "UNAVAILABLE")
    provider.shutdown()
    step_record, call_record = [json.loads(line) for line in path.read_text().splitlines()]
    assert step_record["kind"] == "INTERNAL" and step_record["status"] == {"code": "UNSET", "description": None}
    assert step_record["links"] == step_record["events"] == []
    assert call_record["kind"] == "CLIENT"
    assert call_record["status"] == {"code": "ERROR", "description": "UNAVAILABLE"}
    assert call_record["links"] == [{"trace_id": step_record["trace_id"], "span_id": step_record["span_id"],
                                     "attributes": {"why": "trained"}}]
    [event] = call_record["events"]
    assert (event["name"], event["attributes"]) == ("retry", {"attempt": 2})
    assert call_record["start_ns"] <= event["time_ns"] <= call_record["end_ns"]


@pytest.mark.parametrize(("env", "enabled"), [
    ({}, False),
    ({"FLEETRL_TRACING": "1"}, True),
    ({"FLEETRL_TRACING": "off"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "FLEETRL_TRACING": "0"}, False),
])
def test_an_otlp_endpoint_turns_tracing_on_unless_fleetrl_tracing_says_otherwise(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], enabled: bool) -> None:
    for name in ("FLEETRL_TRACING", *telemetry.OTLP_ENDPOINT_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert telemetry.tracing_enabled() is enabled


def test_a_typo_in_fleetrl_tracing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETRL_TRACING", "ture")
    with pytest.raises(ConfigError, match="FLEETRL_TRACING"):
        telemetry.tracing_enabled()


def test_otlp_without_the_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """An endpoint is set but the exporter cannot be imported: a ConfigError naming the extra, no provider."""
    monkeypatch.delenv("FLEETRL_TRACING", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ConfigError, match=r"fleetrl\[otlp\]") as error:
        telemetry.setup_tracing("test", tmp_path)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in str(error.value)
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


def test_top_refreshes_on_a_fixed_cadence() -> None:
    """Refreshes start at t0 + k x interval whatever the calls take; a refresh longer than the interval
    skips the ticks it overran instead of bursting to catch up."""
    now, started = [10.0], []

    def sleep(seconds: float) -> None:
        assert seconds >= 0
        now[0] += seconds

    call_s = iter([0.3, 0.9, 2.5, 0.0, 0.1])
    for _ in top.every(1.0, clock=lambda: now[0], sleep=sleep):
        started.append(now[0])
        if len(started) == 6:
            break
        now[0] += next(call_s)
    assert started == pytest.approx([10.0, 11.0, 12.0, 15.0, 16.0, 17.0])


def test_top_interval_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        top.parser().parse_args(["--interval", "0"])
    assert "not a positive number of seconds" in capsys.readouterr().err
