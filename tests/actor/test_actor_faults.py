"""Actors under faults, with real NATS, Valkey, replay and reward services and a tiny model.

- SIGKILL one of 3 actors (one holding a task) every few seconds: every task ends as exactly one group, and every
  redelivery follows a delivery to a process that was then killed, none to a live one.
- SIGSTOP the actor holding a task past ack_wait: another actor stores the group; after SIGCONT the
  late copy is reported DUPLICATE; one copy remains.
- A task that always crashes the backend is dead-lettered after exactly max_retries deliveries.
- A task that SIGKILLs its actor process on every delivery (two of three actors die) is stopped by
  the consumer's delivery limit after max_retries deliveries and moved to the dead-letter subject by
  a real learner process (`bus.dead_letter_exhausted` while it waits for data), which publishes a
  replacement; the job succeeds and the ledger shows the task dead-lettered, nothing lost.
- Weights published mid-run are used by later tasks; a corrupt object is rejected and re-pulled.
- Delta weights: a damaged delta is reported and the learner's repair lets the tasks that need it run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats.errors
import nats.js.errors
import torch
from actor_fleet import MODEL, ROOT, Fleet, job_spec, perturbed_weights, wait_until

from fleetrl.jobs.store import JobState
from fleetrl.policy import models
from fleetrl.proto.fleetrl.v1 import replay_pb2
from fleetrl.tasks import bus
from fleetrl.tasks.feeder import task_ids_in_order
from fleetrl.weights.publish import WeightPublisher
from fleetrl.weights.store import WeightPointer

ACK_WAIT_S = 3.0


def _prompt(i: int) -> tuple[str, str]:
    a, b = 10 + i % 37, 20 + (i * 7) % 41
    return f"What is {a} + {b}? Answer with just the number.", str(a + b)


async def _ready(fleet: Fleet, name: str, version: int = 0) -> None:
    await wait_until(lambda: f"loaded weights v{version}" in fleet.log_text(name), 60, f"{name} to hold v{version}")


TASKS = 100


async def test_sigkill_every_few_seconds_loses_and_duplicates_nothing(fleet: Fleet) -> None:
    # A task whose deliveries are all cut by kills would be dead-lettered after max_retries (that path has
    # its own test); here every task must end in replay, so the retry budget outlasts the kill cadence.
    # An actor generates a round of 8 tasks (round_tokens) in one batch, so a task costs less than alone:
    # enough of them that the run outlasts several kills, each of which lands on a round.
    spec = job_spec(rollout={"samples_per_prompt": 4, "max_new_tokens": 32}, train={"max_retries_per_episode": 30})
    job = await fleet.create_job(spec, [])
    await fleet.publish_weights(job, 0)
    names = ["k0", "k1", "k2"]
    for name in names:
        fleet.start_actor(name)
    for name in names:
        await _ready(fleet, name)
    for i in range(TASKS):
        await fleet.publish_task(job, i, *_prompt(i))
    kills: list[float] = []
    log_offsets = dict.fromkeys(names, 0)  # where each actor's current process starts in its log
    killed_logs: list[str] = []  # the whole log of each killed process
    deadline = time.monotonic() + 240
    while (await fleet.replay.stats(job)).inserted < TASKS:
        assert time.monotonic() < deadline, f"{TASKS} tasks did not finish"
        await asyncio.sleep(2.5)
        # Kill an actor that holds a task, and only while another one serves too: on a busy machine a restart
        # takes longer than the kill period, and killing actors still booting would starve the job.
        serving = [n for n in names if "received" in fleet.log_text(n)[log_offsets[n]:]]
        if len(serving) < 2:
            continue
        name = serving[len(kills) % len(serving)]
        kills.append(time.time())
        fleet.kill(name)
        killed_logs.append(fleet.log_text(name)[log_offsets[name]:])  # complete: the process is dead
        log_offsets[name] += len(killed_logs[-1])
        fleet.start_actor(name)
    await asyncio.sleep(ACK_WAIT_S + 2)  # a late redelivery would show up as a duplicate insert
    stats = await fleet.replay.stats(job)
    records = await fleet.replay.query(job, limit=1000)
    task_ids = [r.task_id for r in records]
    assert stats.inserted == TASKS and stats.size_groups == TASKS
    assert sorted(task_ids) == sorted(f"0/{i}" for i in range(TASKS))
    assert len(kills) >= 3
    # Each redelivery is owed to a kill: the delivery before it went to a process that was killed (logged
    # there, or lost in flight to it), never to a process still alive, which would have failed or stalled it.
    # (Not a time window after a kill: on a loaded machine a redelivered task can wait for a free actor.)
    live_logs = [fleet.log_text(n)[log_offsets[n]:] for n in names]
    redelivered = [r for r in records if r.lineage.delivery_attempt > 1]

    def earlier_delivery(record: replay_pb2.LineageRecord) -> str:
        return f" task {record.task_id} delivery {record.lineage.delivery_attempt - 1} received"

    for record in redelivered:
        assert not any(earlier_delivery(record) in text for text in live_logs), (record.lineage, "to a live actor")
    logged_by_killed = [r for r in redelivered if any(earlier_delivery(r) in text for text in killed_logs)]
    assert logged_by_killed or not redelivered
    failed = re.compile(r"task \S+ delivery \d+ failed \(")  # the queue's log line for a failed delivery
    assert not any(failed.search(text) for text in live_logs + killed_logs)
    assert {r.lineage.actor_id for r in records} <= set(names)
    info = await fleet.js.consumer_info(bus.TASKS_STREAM, bus.task_consumer(job))
    assert info.num_pending == 0 and info.num_ack_pending == 0
    counts = (await fleet.ledger.account(fleet.js, job)).counts
    print(f"kills={len(kills)} redelivered={len(redelivered)} logged_by_killed={len(logged_by_killed)} "
          f"duplicates={stats.duplicates} ledger={counts}")
    assert counts["pending"] == counts["published"] == TASKS  # no learner here: every group waits in replay
    assert counts["lost"] == counts["duplicated"] == counts["unpublished"] == 0


FIXED_LATENCY_S = 5.0
"""A group's generation on the fixed backend (`backend=fixed`: a sleep, no compute, the same tokens for a
redelivery): long enough for the test to signal the actor holding it, and a redelivered copy costs no more."""


async def test_sigstopped_actor_late_result_is_a_duplicate(fleet: Fleet) -> None:
    """The holder is stopped inside its generation (the fixed backend's), past ack_wait; the other actor's
    copy is stored; the holder, continued, finishes and its copy is dropped as a duplicate."""
    spec = job_spec()
    job = await fleet.create_job(spec, [])
    await fleet.publish_weights(job, 0)
    for name in ("s0", "s1"):
        fleet.start_actor(name, "backend=fixed", f"fixed_latency_s={FIXED_LATENCY_S}")
    for name in ("s0", "s1"):
        await _ready(fleet, name)
    await fleet.publish_task(job, 0, *_prompt(0))
    holder = await wait_until(
        lambda: next((n for n in ("s0", "s1") if "task 0/0 delivery 1 received" in fleet.log_text(n)), None),
        30, "a delivery of the task", interval_s=0.05)
    fleet.kill(holder, signal.SIGSTOP)
    other = "s1" if holder == "s0" else "s0"
    await wait_until(lambda: "task 0/0 delivery 2 received" in fleet.log_text(other), ACK_WAIT_S + 10,
                     "the redelivery to the other actor")
    await wait_until(lambda: _inserted(fleet, job, 1), 60, "the other actor's group")
    fleet.kill(holder, signal.SIGCONT)
    stats = await wait_until(lambda: _duplicates(fleet, job, 1), 60, "the late copy to be dropped")
    assert stats.inserted == 1 and stats.size_groups == 1
    (record,) = await fleet.replay.query(job)
    assert record.lineage.actor_id == other and record.lineage.delivery_attempt == 2


async def _inserted(fleet: Fleet, job: str, n: int) -> bool:
    return (await fleet.replay.stats(job)).inserted >= n


async def _duplicates(fleet: Fleet, job: str, n: int) -> object:
    stats = await fleet.replay.stats(job)
    return stats if stats.duplicates >= n else None


async def _dead_letters(fleet: Fleet, job: str) -> list[nats.aio.msg.Msg]:
    sub = await fleet.js.subscribe(bus.dlq_subject(job), stream=bus.DLQ_STREAM, ordered_consumer=True)
    out = []
    try:
        while True:
            out.append(await sub.next_msg(timeout=1.0))
    except nats.errors.TimeoutError:
        return out
    finally:
        await sub.unsubscribe()


async def test_task_that_always_crashes_is_dead_lettered_after_max_retries(fleet: Fleet) -> None:
    spec = job_spec(train={"max_retries_per_episode": 3})
    job = await fleet.create_job(spec, [])
    await fleet.publish_weights(job, 0)
    for name in ("d0", "d1"):
        fleet.start_actor(name, "fault_crash_marker=CRASH-ME")
    for name in ("d0", "d1"):
        await _ready(fleet, name)
    for i in range(8):
        prompt, answer = _prompt(i)
        await fleet.publish_task(job, i, prompt + (" CRASH-ME" if i == 3 else ""), answer)
    await wait_until(lambda: _inserted(fleet, job, 7), 60, "the 7 healthy tasks")
    await wait_until(lambda: _dead_letters(fleet, job), 30, "the dead letter")
    await asyncio.sleep(2)  # no further delivery or dead letter may follow
    dead = await _dead_letters(fleet, job)
    assert len(dead) == 1
    headers = dead[0].headers or {}
    assert headers["Fleet-Deliveries"] == "3" and headers["Fleet-Original-Msg-Id"] == bus.task_msg_id(job, 0, 3)
    assert "fault injection" in headers["Fleet-Reason"]
    logs = fleet.log_text("d0") + fleet.log_text("d1")
    deliveries = sorted(re.findall(r"task 0/3 delivery (\d+) received", logs))
    assert deliveries == ["1", "2", "3"]
    stats = await fleet.replay.stats(job)
    assert stats.inserted == 7 and "0/3" not in {r.task_id for r in await fleet.replay.query(job)}
    info = await fleet.js.consumer_info(bus.TASKS_STREAM, bus.task_consumer(job))
    assert info.num_pending == 0 and info.num_ack_pending == 0
    accounting = await fleet.ledger.account(fleet.js, job)
    print(f"dead letter: ledger={accounting.counts}")
    assert accounting.counts["pending"] == 7 and accounting.counts["dead_lettered"] == 1
    assert accounting.counts["lost"] == accounting.counts["duplicated"] == 0
    (dead_task,) = [t for t in accounting.tasks if t.fate == "dead_lettered"]
    assert dead_task.task_id == "0/3" and "fault injection" in dead_task.reason


POISON_STEPS = 4


def start_learner(fleet: Fleet, run_dir: Path) -> subprocess.Popen[bytes]:
    """`python -m fleetrl.services.learner --once`: claims the queued job, feeds it, trains it, exits."""
    s = fleet.services
    env = {**os.environ, "FLEETRL_LEARNER_LISTEN": "127.0.0.1:0",
           "FLEETRL_LEARNER_SAMPLE_WAIT_S": "0.5", "FLEETRL_LEARNER_TORCH_THREADS": "1", "FLEETRL_TRACING": "0"}
    cmd = [sys.executable, "-m", "fleetrl.services.learner", "--once", "--nats-url", s.nats_url, "--redis-url",
           s.redis_url, "--replay-addr", s.replay_addr, "--set", f"reward_addr={s.reward_addr}",
           "--run-dir", str(run_dir)]
    with open(fleet.log("learner"), "ab") as out:
        fleet.actors["learner"] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return fleet.actors["learner"]


async def test_task_that_kills_its_actor_is_dead_lettered_by_the_learner(fleet: Fleet, tmp_path: Path) -> None:
    """A real learner runs the job: its feeder publishes the poison task with the others, the task kills
    each actor it is delivered to, the server stops delivering it after max_retries, and the learner,
    waiting for data, moves it to the dead-letter subject and publishes a replacement. One task in flight
    at a time (one prompt per step, no staleness), so the job cannot end unless the learner does so. The
    poison is the second task published, and the job ends within the first epoch (the next one would
    publish the poison prompt again)."""
    spec = job_spec(train={"max_retries_per_episode": 2, "max_steps": POISON_STEPS, "checkpoint_interval": 2},
                    rollout={"prompts_per_step": 1})
    prompts = [_prompt(i) for i in range(2 * POISON_STEPS)]
    poison_id = task_ids_in_order(len(prompts), spec.seed, 2)[1]  # the second task the feeder publishes
    poison = int(poison_id.split("/")[1])
    prompts[poison] = (prompts[poison][0] + " KILL-ME", prompts[poison][1])
    body = "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in prompts).encode()
    record = await fleet.jobs.create("test", spec, body, None)
    job = record.job_id
    fleet.job_ids.append(job)
    names = ("p0", "p1", "p2")  # the server notices the limit when the next pull comes: one actor survives
    for name in names:
        fleet.start_actor(name, "fault_kill_marker=KILL-ME")
    learner = start_learner(fleet, tmp_path / "run")
    await wait_until(lambda: learner.poll() is not None, 180, "the learner to finish the job")
    learner_log = fleet.log_text("learner")
    assert learner.returncode == 0, learner_log[-3000:]
    assert (await fleet.jobs.get(job)).state == JobState.SUCCEEDED
    assert f"job {job}: 1 tasks dead-lettered so far; publishing replacements" in learner_log
    deaths = [name for name in names if fleet.actors[name].poll() == -signal.SIGKILL]
    logs = "".join(fleet.log_text(name) for name in names)
    assert sorted(re.findall(rf"task {poison_id} delivery (\d+) received", logs)) == ["1", "2"] and len(deaths) == 2
    (dead,) = await _dead_letters(fleet, job)
    headers = dead.headers or {}
    assert headers["Fleet-Deliveries"] == "2" and headers["Fleet-Actor-Id"] == "server"
    assert headers["Fleet-Original-Msg-Id"] == bus.task_msg_id(job, 0, poison)
    assert "max_deliver" in headers["Fleet-Reason"]
    accounting = await fleet.ledger.account(fleet.js, job)
    print(f"poison task: {len(deaths)} actor deaths, ledger={accounting.counts}")
    assert accounting.counts["dead_lettered"] == 1 and accounting.counts["trained"] == POISON_STEPS
    assert accounting.counts["lost"] == accounting.counts["duplicated"] == accounting.counts["in_flight"] == 0
    (dead_task,) = [t for t in accounting.tasks if t.fate == "dead_lettered"]
    assert dead_task.task_id == poison_id


async def test_weight_update_mid_run_and_corrupt_object(fleet: Fleet) -> None:
    spec = job_spec()
    job = await fleet.create_job(spec, [])
    await fleet.publish_weights(job, 0)
    fleet.start_actor("w0")
    await _ready(fleet, "w0")
    for i in range(4):
        await fleet.publish_task(job, i, *_prompt(i))
    await wait_until(lambda: _inserted(fleet, job, 4), 60, "tasks under v0")
    await fleet.publish_weights(job, 1, perturbed_weights(0.01))
    for i in range(4, 8):
        await fleet.publish_task(job, i, *_prompt(i), min_version=1)
    await wait_until(lambda: _inserted(fleet, job, 8), 60, "tasks under v1")
    # A pointer whose object does not match its digest: rejected, re-pulled, never loaded.
    good = await fleet.weights.latest(job)
    assert good is not None
    bad = WeightPointer(version=2, object_name=good.object_name, sha256="0" * 64, size_bytes=good.size_bytes,
                        dtype=good.dtype)
    kv = await fleet.js.key_value(bus.WEIGHTS_KV)
    await kv.put(job, bad.to_json())
    await wait_until(lambda: fleet.log_text("w0").count("rejected weights v2") >= 2, 30, "the corrupt pull rejections")
    await fleet.publish_weights(job, 3, perturbed_weights(0.02))
    for i in range(8, 12):
        await fleet.publish_task(job, i, *_prompt(i), min_version=3)
    await wait_until(lambda: _inserted(fleet, job, 12), 60, "tasks under v3")
    versions = {r.task_id: r.policy_version for r in await fleet.replay.query(job, limit=100)}
    assert {versions[f"0/{i}"] for i in range(4)} == {0}
    assert {versions[f"0/{i}"] for i in range(4, 8)} == {1}
    assert {versions[f"0/{i}"] for i in range(8, 12)} == {3}
    assert "loaded weights v2" not in fleet.log_text("w0")


async def test_delta_weights_a_damaged_delta_and_the_repair(fleet: Fleet) -> None:
    """A job with full_publish_interval 4: the actor follows v0 -> d1 by delta; d2 is damaged in the
    store, so neither its held v1 nor the snapshot v0 reaches v2 and it reports the chain; the
    learner's repair rewrites v2 in full and the tasks that need v2 run under it."""
    spec = job_spec(train={"full_publish_interval": 4})
    job = await fleet.create_job(spec, [])
    model, _ = models.load(MODEL)
    publisher = WeightPublisher(fleet.weights, job, "bfloat16", interval=1, keep=3, lease_epoch=0, full_interval=4)
    generator = torch.Generator().manual_seed(0)

    async def publish(version: int) -> None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=1e-4)
        await publisher.publish(model, version)

    await publisher.publish(model, 0)
    fleet.start_actor("d0")
    await _ready(fleet, "d0")
    await publish(1)
    for i in range(4):
        await fleet.publish_task(job, i, *_prompt(i), min_version=1)
    await wait_until(lambda: _inserted(fleet, job, 4), 60, "tasks under v1")
    assert "loaded weights v1" in fleet.log_text("d0") and "delta)" in fleet.log_text("d0")
    await publish(2)
    info = await (await fleet.js.object_store(bus.weights_bucket(job))).get_info("d2")
    stream, subject = f"OBJ_{info.bucket}", f"$O.{info.bucket}.C.{info.nuid}"
    last = await fleet.js.get_last_msg(stream, subject)
    await fleet.js.delete_msg(stream, last.seq)
    await fleet.js.publish(subject, bytes(b ^ 0xFF for b in last.data))  # same size, other bytes
    for i in range(4, 8):
        await fleet.publish_task(job, i, *_prompt(i), min_version=2)
    kv = await fleet.js.key_value(bus.WEIGHTS_KV)

    async def reported() -> bool:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            return (await kv.get(f"{job}.resync")).value == b"0"
        return False

    await wait_until(reported, 60, "the actor to report the broken chain")
    assert "loaded weights v2" not in fleet.log_text("d0")
    await publisher.repair_if_requested()
    await wait_until(lambda: _inserted(fleet, job, 8), 60, "tasks under the repaired v2")
    versions = {r.task_id: r.policy_version for r in await fleet.replay.query(job, limit=100)}
    assert {versions[f"0/{i}"] for i in range(4, 8)} == {2}
    pointer = await fleet.weights.latest(job)
    assert pointer is not None and pointer.version == 2 and pointer.kind == "full"


async def test_sigterm_finishes_the_current_task_then_exits(fleet: Fleet) -> None:
    """SIGTERM lands inside the generation (the fixed backend's); the actor stores the group, acks, exits 0."""
    spec = job_spec()
    job = await fleet.create_job(spec, [])
    await fleet.publish_weights(job, 0)
    proc = fleet.start_actor("t0", "backend=fixed", f"fixed_latency_s={FIXED_LATENCY_S}")
    await _ready(fleet, "t0")
    await fleet.publish_task(job, 0, *_prompt(0))
    await wait_until(lambda: "task 0/0 delivery 1 received" in fleet.log_text("t0"), 30, "the delivery",
                     interval_s=0.05)
    fleet.kill("t0", signal.SIGTERM)
    await wait_until(lambda: proc.poll() is not None, 30, "the actor to exit")
    assert proc.returncode == 0
    stats = await fleet.replay.stats(job)
    assert stats.inserted == 1
    info = await fleet.js.consumer_info(bus.TASKS_STREAM, bus.task_consumer(job))
    assert info.num_pending == 0 and info.num_ack_pending == 0
