"""Infrastructure faults mid-job on the shared fleet (conftest.py), each judged by the end-to-end ledger.

- Valkey SIGKILLed just after replay acknowledged an insert, restarted on its port with
  its data: the learner keeps its job lease, replay, the job store and the heartbeats come back, no
  service is restarted, the job succeeds, the ledger balances;
- SIGSTOP (not kill) of replay, reward, NATS and Valkey in turn during one job, each for longer than
  the deadline of the calls made to it, then SIGCONT: callers time out and retry within their bounds,
  nothing is acked before it is stored (a task acked and not stored would be lost in the ledger), the
  job succeeds;
- Valkey at maxmemory mid-job, past the learner's job lease, then given memory again: the job pauses
  (the learner stops its run, its status and `fleetrl_learner_store_full` say why, and its claims are
  refused), no service restarts, the job resumes from its checkpoint and succeeds, the ledger balances;
- NATS SIGKILLed while the learner writes a weight object (its first chunk reached the server, so the
  chunks' acks, the metadata and the pointer move are still to come), restarted: the publish is tried
  again (it failed the job before `bus.retry_outage`), the pointer names a complete object whose
  digest checks, every actor's loaded versions only go up and reach past the interrupted one.

Each test prints its counts: faults injected, services restarted, and the ledger (lost, duplicated).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis
from e2e_fleet import PPS, FleetUnderTest, ledger, wait_for
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from fleetrl.jobs.store import job_key
from fleetrl.proto.fleetrl.v1 import learner_pb2, learner_pb2_grpc
from fleetrl.tasks import bus
from fleetrl.weights.store import WeightStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def two_default_actors_after(fleet: FleetUnderTest) -> Iterator[None]:
    """The fleet is shared (conftest.py): leave it with the two default actors it started with."""
    yield
    fleet.scale_actors(0)
    fleet.scale_actors(2)

VALKEY_STEPS = 8
FIXED_ACTOR_ENV = {"FLEETRL_ACTOR_BACKEND": "fixed", "FLEETRL_ACTOR_FIXED_LATENCY_S": "0.2"}
"""Actors that answer every task with fixed tokens after 0.2 s: no generation compute."""


def fixed_actors(fleet: FleetUnderTest, **env: str) -> None:
    """Replace the fleet's actors with two on the fixed backend, with env's settings besides."""
    fleet.scale_actors(0)
    with fleet.actor_env(**FIXED_ACTOR_ENV, **env):
        fleet.scale_actors(2)


def restarts(fleet: FleetUnderTest) -> dict[str, int]:
    return {name: fleet.restarts(name) for name in fleet.fleet.supervisor.children}


def step_of(fleet: FleetUnderTest, job_id: str) -> int:
    last = fleet.client.get_job(job_id).last
    return last.step if last else 0


def set_appendfsync(url: str, mode: str) -> None:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        client.config_set("appendfsync", mode)


def lease_epoch(url: str, job_id: str) -> int:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return int(client.hget(job_key(job_id), "lease_epoch") or 0)


def test_valkey_killed_mid_job_and_restarted(fleet: FleetUnderTest) -> None:
    """Valkey SIGKILLed right after replay acknowledged an insert (so that group is in the AOF: in the page
    cache, which a process kill keeps, whatever the fsync policy), down 1.5 s (under the learner's 3 s job
    lease), restarted with the same AOF."""
    assert fleet.fleet.infra is not None
    valkey = fleet.fleet.infra.valkey
    set_appendfsync(valkey.url, "always")
    valkey.appendfsync = "always"  # the restarted server too
    fleet.scale_actors(2)
    before = restarts(fleet)
    run = fleet.submit("valkey-kill", max_steps=VALKEY_STEPS)
    job = run.job_id
    started = time.monotonic()
    wait_for(lambda: step_of(fleet, job) >= 2, 120, "step 2")
    inserted = fleet.replay_stats(job).inserted
    wait_for(lambda: fleet.replay_stats(job).inserted > inserted, 30, "an acknowledged insert", interval_s=0.02)
    acked = fleet.replay_stats(job).inserted
    valkey.kill()
    time.sleep(1.5)
    valkey.start()
    try:
        assert fleet.replay_stats(job).inserted >= acked  # every acknowledged insert survived
        info = run.wait(timeout_s=240)
        assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
        assert restarts(fleet) == before  # learner, replay, gateway, actors: all recovered by themselves
        learner_log = fleet.log("learner")
        assert f"job {job}: lease lost" not in learner_log and f"job {job} resumed from step" not in learner_log
        assert lease_epoch(valkey.url, job) == 1  # claimed once: the learner's lease outlived the outage
        wait_for(lambda: {m.member_id for m in fleet.client.fleet().members} >= set(fleet.actors()), 10,
                 "actor heartbeats after the restart")
        members = sorted(m.member_id for m in fleet.client.fleet().members)
        fleet.stop_actors()
        counts = ledger(fleet, job, VALKEY_STEPS)
    finally:
        set_appendfsync(valkey.url, "everysec")
        valkey.appendfsync = "everysec"
    print(f"valkey kill: injected 1 SIGKILL (after insert #{acked}), services restarted 0, heartbeats back "
          f"{members}, {VALKEY_STEPS} steps in {time.monotonic() - started:.1f}s, ledger: {json.dumps(counts)}")


FULL_STEPS = 8
FULL_FOR_S = 5.0
"""How long Valkey refuses writes: past the learner's 3 s job lease."""


def set_maxmemory(url: str, value: int) -> None:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        client.config_set("maxmemory", value)


def learner_status(fleet: FleetUnderTest) -> learner_pb2.LearnerStatus:
    with grpc.insecure_channel(fleet.layout.addresses["learner"]) as channel:
        return learner_pb2_grpc.LearnerServiceStub(channel).GetStatus(learner_pb2.LearnerStatusRequest(), timeout=5)


def store_full_gauge(fleet: FleetUnderTest) -> str:
    """The learner's `fleetrl_learner_store_full{store="redis"}` sample, as /metrics shows it."""
    url = f"http://127.0.0.1:{fleet.layout.metrics_ports['learner']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return next(line for line in text.splitlines() if line.startswith('fleetrl_learner_store_full{store="redis"}'))


def test_valkey_at_maxmemory_mid_job_pauses_it_until_memory_returns(fleet: FleetUnderTest) -> None:
    """Valkey's maxmemory set below its use mid-job (noeviction: every write refused OOM), for longer than
    the learner's 3 s job lease, then raised: the learner pauses the job instead of failing it (before, it
    exited on the refused FAILED write, and every restart's claim was refused: a crash loop under the
    supervisor), actors' inserts are refused RESOURCE_EXHAUSTED and retried, no service restarts, and a
    claim resumes the job from its checkpoint once memory returns. The learner meets the refusal in its
    own write of a step, or, when it has trained every group there is and waits for more (the actors'
    inserts being refused), in its job-lease renewal within the lease: before that renewal was a write
    Redis refuses, the waiting learner noticed nothing for `timeout_per_step_s`, and this test failed."""
    assert fleet.fleet.infra is not None
    valkey = fleet.fleet.infra.valkey
    fixed_actors(fleet)
    before = restarts(fleet)
    run = fleet.submit("valkey-full", max_steps=FULL_STEPS)
    job = run.job_id
    started = time.monotonic()
    wait_for(lambda: step_of(fleet, job) >= 3, 120, "step 3")
    # filled while the learner waits for groups: unless enough arrive before the fill, it writes nothing
    # more, and only its lease renewal meets the refusal
    wait_for(lambda: learner_status(fleet).phase == "waiting_for_data", 30, "the learner waiting for groups",
             interval_s=0.02)
    set_maxmemory(valkey.url, 1)
    full_at = time.monotonic()
    try:
        wait_for(lambda: f"job {job} paused, Redis refuses writes" in fleet.log("learner"), 15, "the pause")
        paused_after_s, paused_at = time.monotonic() - full_at, step_of(fleet, job)
        status, gauge = learner_status(fleet), store_full_gauge(fleet)
        time.sleep(max(0.0, FULL_FOR_S - (time.monotonic() - full_at)))  # claims refused, inserts refused
        state = fleet.client.get_job(job).state
    finally:
        set_maxmemory(valkey.url, 0)
    info = run.wait(timeout_s=240)
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    assert restarts(fleet) == before  # no crash, no crash loop
    learner_log = fleet.log("learner")
    refused = sorted(set(re.findall(r"(\w+) failed \(RESOURCE_EXHAUSTED\), retry",
                                    "".join(fleet.log(a) for a in fleet.actors()))))
    fleet.stop_actors()
    counts = ledger(fleet, job, FULL_STEPS)
    # a pause within a step of the fill met a step's write; one near the 3 s lease, the refused renewals
    print(f"valkey maxmemory: paused {paused_after_s:.1f} s after the fill at step {paused_at} ({state} meanwhile; "
          f"status {status.phase!r} {status.paused_reason!r}; {gauge}), actor calls refused and retried {refused}, "
          f"services restarted 0, resumed: {f'job {job} resumed from step' in learner_log}, "
          f"{FULL_STEPS} steps in {time.monotonic() - started:.1f}s, ledger: {json.dumps(counts)}")
    assert status.phase == "paused" and "Redis is out of memory (maxmemory reached" in status.paused_reason
    assert gauge.endswith(" 1.0") and store_full_gauge(fleet).endswith(" 0.0")  # 0 again once a claim landed
    assert state == "running" and "claim refused, Redis refuses writes" in learner_log
    assert f"job {job} resumed from step" in learner_log and lease_epoch(valkey.url, job) == 2
    # 8 steps of 4 trained once each (ledger), the feeder's window of 2 steps of 4 still queued, and one task
    # published for each group dropped stale (groups made before the pause can be, after the resume)
    assert counts["pending"] + counts["in_flight"] == 2 * PPS, counts
    assert counts["published"] == FULL_STEPS * PPS + 2 * PPS + counts["stale"], counts


# ---------------------------------------------------------------- SIGSTOP

STOP_STEPS = 16
STOP_ACTOR_ENV = {"FLEETRL_ACTOR_REPLAY_TIMEOUT_S": "2", "FLEETRL_ACTOR_REWARD_TIMEOUT_S": "3"}
"""The actors of the SIGSTOP test: short call deadlines, so a stop outlasts them quickly."""
STOP_FOR_S = {"replay": 4.0, "reward": 4.0, "nats": 11.0, "valkey": 11.0}
"""Each longer than the deadline of the calls made to it: the actors' replay (2 s) and reward (3 s)
deadlines; JetStream requests (`bus.REQUEST_TIMEOUT_S`, 10 s: the feeder's publishes, the learner's weight
publishes) and the task ack wait (3 s); the job store's 10 s socket timeout (learner, gateway, actors'
heartbeats) and the learner's 3 s job lease."""


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP a process for the block, SIGCONT it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def stop_pid(fleet: FleetUnderTest, name: str) -> int:
    infra = fleet.fleet.infra
    assert infra is not None
    server = {"nats": infra.nats, "valkey": infra.valkey}.get(name)
    if server is None:
        return fleet.pid(name)
    assert server.proc is not None
    return server.proc.pid


def test_sigstop_replay_reward_nats_valkey_in_turn(fleet: FleetUnderTest) -> None:
    fixed_actors(fleet, **STOP_ACTOR_ENV)
    before = restarts(fleet)
    run = fleet.submit("sigstop", max_steps=STOP_STEPS)
    job = run.job_id
    started = time.monotonic()
    at_step: dict[str, int] = {}
    for name, seconds in STOP_FOR_S.items():
        reached = wait_for(lambda: (s := step_of(fleet, job)) > max(at_step.values(), default=0) + 1 and s,
                           120, f"progress before stopping {name}")
        assert reached < STOP_STEPS, f"the job ended before {name} was stopped"
        at_step[name] = reached
        with stopped(stop_pid(fleet, name)):
            time.sleep(seconds)
    info = run.wait(timeout_s=240)
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    assert restarts(fleet) == before
    actor_logs = "".join(fleet.log(a) for a in fleet.actors())
    timed_out = sorted(set(re.findall(r"(\w+) failed \(DEADLINE_EXCEEDED\), retry", actor_logs)))
    learner_log = fleet.log("learner")
    resumed = f"job {job} resumed from step" in learner_log
    retried = rf"job {job}: (publish of weights v\d+|task publish|dead-letter count) failed"
    nats_retried = re.findall(retried, learner_log)
    epoch = lease_epoch(fleet.fleet.infra.valkey.url, job)  # type: ignore[union-attr]
    fleet.stop_actors()
    counts = ledger(fleet, job, STOP_STEPS)
    print(f"sigstop: injected {len(at_step)} stops {json.dumps(at_step)} (steps), {json.dumps(STOP_FOR_S)} (s); "
          f"actor calls that hit their deadline and were retried: {timed_out}; services restarted 0; "
          f"learner lost its 3 s job lease to the Valkey stop and resumed from its checkpoint: {resumed}; "
          f"learner NATS calls retried through the NATS stop: {nats_retried}; "
          f"{STOP_STEPS} steps in {time.monotonic() - started:.1f}s; ledger: {json.dumps(counts)}")
    assert {"Insert", "Score"} <= set(timed_out), "the stops were too short to outlive the actors' deadlines"
    # the NATS stop outlived a learner call to JetStream, which failed and was tried again
    assert nats_retried, f"no learner NATS call failed during the {STOP_FOR_S['nats']} s NATS stop"
    # the Valkey stop outlived the 3 s job lease: the learner stopped, claimed the job again, resumed
    assert re.search(rf"job {job}(: lease lost| stopped)", learner_log), "the Valkey stop did not stop the run"
    assert resumed and epoch == 2, (resumed, epoch)


# ---------------------------------------------------------------- NATS killed during a weight publish

PUBLISH_STEPS = 8
KILL_ATTEMPTS = 3


async def kill_during_upload_after(fleet: FleetUnderTest, job_id: str, version: int, kill: Callable[[], object],
                                   already: bool = False) -> dict[str, object]:
    """Watch the job's weight pointer and its object chunks on one connection, and call `kill` at the first chunk
    that arrives once the pointer is at `version` or past it: a chunk of the next version's upload, before that
    object's metadata. Exact, not a race with the learner: NATS delivers one publisher's messages in order and
    the learner writes chunks and pointer on one connection (the pointer read at the start seeds the watch).
    With `already`, the pointer must be at `version` or past it when the watch starts. Returns the pointer when
    it fired and the chunk it saw."""
    assert fleet.fleet.infra is not None
    nc = NATS()
    await nc.connect(fleet.fleet.infra.nats.url, allow_reconnect=False)
    seen: dict[str, object] = {}
    pointer, killed = [0], asyncio.Event()

    async def on_pointer(msg: Msg) -> None:
        pointer[0] = int(json.loads(msg.data)["version"])

    async def on_chunk(msg: Msg) -> None:
        if killed.is_set() or pointer[0] < version:
            return
        kill()
        killed.set()
        seen["pointer_before"], seen["chunk_subject"], seen["chunk_bytes"] = pointer[0], msg.subject, len(msg.data)

    await nc.subscribe(f"$KV.{bus.WEIGHTS_KV}.{job_id}", cb=on_pointer)
    await nc.subscribe(f"$O.{bus.weights_bucket(job_id)}.C.>", cb=on_chunk)
    await nc.flush()
    latest = await WeightStore(nc, bus.jetstream(nc)).latest(job_id)
    assert not already or (latest is not None and latest.version >= version), latest
    pointer[0] = max(pointer[0], latest.version if latest else 0)
    try:
        await asyncio.wait_for(killed.wait(), 180)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return seen


async def pointer_and_digest(url: str, job_id: str) -> tuple[int, str, str, tuple[object, ...]]:
    nc = NATS()
    await nc.connect(url)
    try:
        store = WeightStore(nc, bus.jetstream(nc))
        pointer = await store.latest(job_id)
        assert pointer is not None
        payload = await store.pull(job_id, pointer)
        return pointer.version, pointer.sha256, hashlib.sha256(payload).hexdigest(), tuple(pointer.chain)
    finally:
        await nc.close()


def loaded_versions(log: str, job_id: str) -> list[int]:
    return [int(v) for v in re.findall(rf"job {job_id}: loaded weights v(\d+)", log)]


@pytest.mark.parametrize("full_every", [1, 3], ids=["full", "deltas"])
def test_nats_killed_during_a_weight_publish(fleet: FleetUnderTest, full_every: int) -> None:
    """NATS SIGKILLed while the learner writes a version's object (a full snapshot each version, or with
    `train.full_publish_interval` 3 mostly deltas against the version before): the job goes on once
    NATS is back, the pointer's digest is its payload's (a chain's, rebuilt), and every actor loads
    versions in order, never one twice."""
    assert fleet.fleet.infra is not None
    nats = fleet.fleet.infra.nats
    fixed_actors(fleet)
    before = restarts(fleet)
    run = fleet.submit(f"publish-kill-{full_every}", max_steps=PUBLISH_STEPS,
                       **{"train.full_publish_interval": full_every})
    job = run.job_id
    started = time.monotonic()
    # v0 is full and starts a chain of at most full_every versions: with deltas, v3 is full and v4 a delta
    after = 3 if full_every == 3 else 2
    wait_for(lambda: step_of(fleet, job) >= after, 120, f"step {after}")
    kills, interrupted = 0, None
    while interrupted is None and kills < KILL_ATTEMPTS:
        # a small payload's publish can end between the first chunk the test sees and the SIGKILL landing:
        # then the kill hit between publishes, and the next publish gets another one
        seen = asyncio.run(kill_during_upload_after(fleet, job, after, nats.kill, already=True))
        pointer_before = int(str(seen["pointer_before"]))
        kills += 1
        time.sleep(2.0)
        nats.start()
        wait_for(lambda: step_of(fleet, job) > pointer_before + 1, 120, "a step after the kill")  # noqa: B023
        failed = [int(v) for v in re.findall(rf"job {job}: publish of weights v(\d+) failed", fleet.log("learner"))]
        interrupted = next((v for v in failed if v > pointer_before), None)
    assert interrupted is not None, f"none of {kills} kills hit a publish"
    assert full_every == 1 or interrupted % full_every != 0, interrupted  # the deltas case hit a delta's upload
    info = run.wait(timeout_s=240)
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    assert restarts(fleet) == before
    version, pointer_sha, payload_sha, chain = asyncio.run(pointer_and_digest(nats.url, job))
    assert version == PUBLISH_STEPS and pointer_sha == payload_sha
    assert bool(chain) == (full_every > 1), chain  # with deltas, the last version is a chain's end
    per_actor = {a: loaded_versions(fleet.log(a), job) for a in fleet.actors()}
    for name, versions in per_actor.items():
        assert versions == sorted(set(versions)), (name, versions)  # never backwards, never twice
        assert versions and versions[-1] >= interrupted, (name, versions)
    fleet.stop_actors()
    counts = ledger(fleet, job, PUBLISH_STEPS)
    print(f"nats kill during publish (full snapshot every {full_every}): injected {kills} SIGKILL(s), the last "
          f"at {seen}, hitting the publish of v{interrupted}, services restarted 0, versions loaded per "
          f"actor {json.dumps(per_actor)}, {PUBLISH_STEPS} steps in {time.monotonic() - started:.1f}s, "
          f"ledger: {json.dumps(counts)}")


def test_the_learner_killed_during_a_delta_upload(fleet: FleetUnderTest) -> None:
    """The learner SIGKILLed at the first chunk of v4's upload, a delta against v3 (`train.full_publish_interval`
    3): the supervisor restarts it, it resumes from checkpoint 3 holding no base, so its first version is a full
    snapshot, v4 again over the half-written delta, or v5 when the whole small delta was already on its way to
    NATS as the kill landed (then v4 is in); the pointer never moves back, its last payload matches its digest,
    every actor loads versions in order (never one twice) and the ledger is exact."""
    assert fleet.fleet.infra is not None
    fixed_actors(fleet)
    before = restarts(fleet)
    run = fleet.submit("delta-learner-kill", max_steps=PUBLISH_STEPS, checkpoint_interval=3,
                       **{"train.full_publish_interval": 3})
    job = run.job_id

    # watched from seconds before v3 is published (the learner has yet to claim the job), so the kill lands in
    # v4's upload however fast the steps go
    seen = asyncio.run(kill_during_upload_after(fleet, job, 3, lambda: fleet.kill("learner")))
    info = run.wait(timeout_s=240)
    learner_log = fleet.log("learner")
    assert info.state == "succeeded", (info.reason, learner_log[-3000:])
    after = restarts(fleet)
    assert after["learner"] == before["learner"] + 1 and {n: c for n, c in after.items() if n != "learner"} == {
        n: c for n, c in before.items() if n != "learner"}, (before, after)
    assert seen["pointer_before"] == 3 and f"job {job} resumed from step 3" in learner_log, seen
    version, pointer_sha, payload_sha, chain = asyncio.run(pointer_and_digest(fleet.fleet.infra.nats.url, job))
    # the resumed learner held no base: its first version (above the store's pointer at its start) was full, and
    # every third after it; with v4 cut off: v4 and v7 full, the last pointer v8 a delta on v7; with v4 in: v5
    # and v8 full
    store_at = int(re.findall(rf"job {job}: version 3 already published \(store at (\d+)\)", learner_log)[0])
    assert store_at in (3, 4), store_at
    last_full = max(range(store_at + 1, PUBLISH_STEPS + 1, 3))
    expected = () if last_full == PUBLISH_STEPS else tuple(range(last_full, PUBLISH_STEPS + 1))
    assert version == PUBLISH_STEPS and pointer_sha == payload_sha and chain == expected, (version, chain, store_at)
    per_actor = {a: loaded_versions(fleet.log(a), job) for a in fleet.actors()}
    for name, versions in per_actor.items():
        assert versions == sorted(set(versions)) and versions[-1] == PUBLISH_STEPS, (name, versions)
    fleet.stop_actors()
    counts = ledger(fleet, job, PUBLISH_STEPS)
    print(f"learner kill during a delta upload: at {seen}, store at v{store_at} when it resumed, "
          f"versions loaded per actor {json.dumps(per_actor)}, "
          f"last pointer v{version} chain {chain}, ledger: {json.dumps(counts)}")
