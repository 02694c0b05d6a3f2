"""Infrastructure faults mid-job on the shared fleet (conftest.py), each judged by the end-to-end ledger.

- Valkey SIGKILLed just after replay acknowledged an insert, restarted on its port with
  its data: the learner keeps its job lease, replay, the job store and the heartbeats come back, no
  service is restarted, the job succeeds, the ledger balances;
- SIGSTOP (not kill) of replay, reward, NATS and Valkey in turn during one job, each for longer than
  the deadline of the calls made to it, then SIGCONT: callers time out and retry within their bounds,
  nothing is acked before it is stored (a task acked and not stored would be lost in the ledger), the
  job succeeds;
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
from collections.abc import Iterator

import pytest
import redis
from e2e_fleet import FleetUnderTest, ledger, wait_for
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from fleetrl.jobs.store import job_key
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


# ---------------------------------------------------------------- SIGSTOP

STOP_STEPS = 16
STOP_ACTOR_ENV = {"FLEETRL_ACTOR_BACKEND": "fixed", "FLEETRL_ACTOR_FIXED_LATENCY_S": "0.2",
                  "FLEETRL_ACTOR_REPLAY_TIMEOUT_S": "2", "FLEETRL_ACTOR_REWARD_TIMEOUT_S": "3"}
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
    fleet.scale_actors(0)
    with fleet.actor_env(**STOP_ACTOR_ENV):
        fleet.scale_actors(2)
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


async def kill_nats_mid_publish(fleet: FleetUnderTest, job_id: str, after_version: int) -> dict[str, object]:
    """Watch the job's object store subjects; SIGKILL nats-server as soon as a chunk of a new object
    arrives after the pointer passed `after_version`, before that object's metadata. Returns what it saw."""
    assert fleet.fleet.infra is not None
    nats = fleet.fleet.infra.nats
    bucket = bus.weights_bucket(job_id)
    nc = NATS()
    await nc.connect(nats.url, allow_reconnect=False)
    seen: dict[str, object] = {}
    killed = asyncio.Event()
    store = WeightStore(nc, bus.jetstream(nc))
    pointer = await store.latest(job_id)
    assert pointer is not None and pointer.version >= after_version
    seen["pointer_before"] = pointer.version

    async def on_chunk(msg: Msg) -> None:
        if killed.is_set():
            return
        nats.kill()
        killed.set()
        seen["chunk_subject"], seen["chunk_bytes"] = msg.subject, len(msg.data)

    await nc.subscribe(f"$O.{bucket}.C.>", cb=on_chunk)
    await nc.flush()
    try:
        await asyncio.wait_for(killed.wait(), 120)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return seen


async def pointer_and_digest(url: str, job_id: str) -> tuple[int, str, str]:
    nc = NATS()
    await nc.connect(url)
    try:
        store = WeightStore(nc, bus.jetstream(nc))
        pointer = await store.latest(job_id)
        assert pointer is not None
        payload = await store.pull(job_id, pointer)
        return pointer.version, pointer.sha256, hashlib.sha256(payload).hexdigest()
    finally:
        await nc.close()


def loaded_versions(log: str, job_id: str) -> list[int]:
    return [int(v) for v in re.findall(rf"job {job_id}: loaded weights v(\d+)", log)]


def test_nats_killed_during_a_weight_publish(fleet: FleetUnderTest) -> None:
    assert fleet.fleet.infra is not None
    nats = fleet.fleet.infra.nats
    fleet.scale_actors(0)
    with fleet.actor_env(FLEETRL_ACTOR_BACKEND="fixed", FLEETRL_ACTOR_FIXED_LATENCY_S="0.2"):
        fleet.scale_actors(2)
    before = restarts(fleet)
    run = fleet.submit("publish-kill", max_steps=PUBLISH_STEPS)
    job = run.job_id
    started = time.monotonic()
    wait_for(lambda: step_of(fleet, job) >= 2, 120, "step 2")
    kills, interrupted = 0, None
    while interrupted is None and kills < KILL_ATTEMPTS:
        # a small payload's publish can end between the first chunk the test sees and the SIGKILL landing:
        # then the kill hit between publishes, and the next publish gets another one
        seen = asyncio.run(kill_nats_mid_publish(fleet, job, 2))
        pointer_before = int(str(seen["pointer_before"]))
        kills += 1
        time.sleep(2.0)
        nats.start()
        wait_for(lambda: step_of(fleet, job) > pointer_before + 1, 120, "a step after the kill")  # noqa: B023
        failed = [int(v) for v in re.findall(rf"job {job}: publish of weights v(\d+) failed", fleet.log("learner"))]
        interrupted = next((v for v in failed if v > pointer_before), None)
    assert interrupted is not None, f"none of {kills} kills hit a publish"
    info = run.wait(timeout_s=240)
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    assert restarts(fleet) == before
    version, pointer_sha, payload_sha = asyncio.run(pointer_and_digest(nats.url, job))
    assert version == PUBLISH_STEPS and pointer_sha == payload_sha
    per_actor = {a: loaded_versions(fleet.log(a), job) for a in fleet.actors()}
    for name, versions in per_actor.items():
        assert versions == sorted(set(versions)), (name, versions)  # never backwards, never twice
        assert versions and versions[-1] >= interrupted, (name, versions)
    fleet.stop_actors()
    counts = ledger(fleet, job, PUBLISH_STEPS)
    print(f"nats kill during publish: injected {kills} SIGKILL(s), the last at {seen}, hitting the publish of "
          f"v{interrupted}, services restarted 0, versions loaded per "
          f"actor {json.dumps(per_actor)}, {PUBLISH_STEPS} steps in {time.monotonic() - started:.1f}s, "
          f"ledger: {json.dumps(counts)}")
