"""End to end: the whole fleet (real processes, tiny model) trains a job through the gateway.

- happy path: submit ~10 steps, the job succeeds, the exported model loads, the metrics JSONL
  holds every step with its groups;
- chaos: the same job while actors are SIGKILLed every few seconds and the reward service, the
  replay service and the learner are each SIGKILLed once; replay's and the learner's counters
  account for every group, and the end-to-end ledger (`fleetrl jobs account`) for every published
  task: 0 lost, 0 duplicated;
- thread budget: every child runs with its share of the cores (OMP/MKL/OpenBLAS threads);
- live scale: an actor is added mid-job and one removed (`fleetrl scale`); the ledger shows nothing lost
  or duplicated;
- NATS killed: nats-server SIGKILLed mid-job and restarted on its port; every service reconnects by
  itself, the job succeeds and the ledger balances.
- sweep: `fleetrl sweep` with a 2x2 grid runs four jobs to the end and prints one row for each,
  with the held-out pass@1 each job's learner measured on its eval set (`eval.interval`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from e2e_fleet import PPS, FleetUnderTest, job_params, ledger, wait_for
from google.protobuf import json_format
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.errors import FleetError, grpc_code
from fleetrl.jobs import retention
from fleetrl.jobs.store import now_ms
from fleetrl.launcher import cores
from fleetrl.sdk.client import FLAT_PARAMS
from fleetrl.sdk.records import DeletedInfo
from fleetrl.tasks import bus
from fleetrl.weights.jetstream import NatsTransport

pytestmark = pytest.mark.slow

STEPS = 10
CHAOS_STEPS = 12
ACTOR_KILL_EVERY_S = 4.0
KILL_ONCE_AT_STEP = {"reward": 2, "replay": 4, "learner": 7}
"""With checkpoint_interval 3, the learner dies during step 8, step 6 its last checkpoint: 7 and 8 are redone."""
SCALE_STEPS = 12
GROUPS_WITH_TWO = 12
FIXED_LATENCY_S = 1.0
"""Scale test actors use the fixed backend: a group costs 1 s of waiting and no CPU, so on 2 shared
cores the rate of groups follows the number of actors instead of the load on the machine."""


def test_happy_path_job_succeeds_exports_and_is_deleted(fleet: FleetUnderTest, tmp_path: Path) -> None:
    started = time.monotonic()
    run = fleet.submit("happy", max_steps=STEPS)
    with pytest.raises(FleetError) as running:
        fleet.client.delete_job(run.job_id)
    assert grpc_code(running.value) == grpc.StatusCode.FAILED_PRECONDITION, running.value
    info = run.wait(timeout_s=180)
    elapsed = time.monotonic() - started
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    print(f"happy path: {STEPS} steps in {elapsed:.1f}s")

    steps = list(run.watch())
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    metrics = fleet.metrics(run.job_id)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert len(m["task_ids"]) == PPS and {"loss", "reward_mean", "staleness_max"} <= m.keys()
        assert m["staleness_max"] <= 1
    trained = [t for m in metrics for t in m["task_ids"]]
    assert len(set(trained)) == STEPS * PPS

    model_dir = run.download_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("What is 2 + 5?", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tokenizer)

    before = footprint_of(fleet, run.job_id)  # `fleetrl delete`: nothing of the job is left in any store
    assert before.redis_keys and before.nats_messages and before.nats_bytes and before.disk_files, before
    held = delete_when_released(fleet, run.job_id)
    after = footprint_of(fleet, run.job_id)
    print(f"delete: before {before}, deleted {held}, after {after}")
    assert after.empty, after
    assert (held.redis_keys, held.disk_files) == (before.redis_keys, before.disk_files)
    with pytest.raises(FleetError) as gone:
        fleet.client.get_job(run.job_id)
    assert grpc_code(gone.value) == grpc.StatusCode.NOT_FOUND


def test_every_child_runs_with_its_thread_budget(fleet: FleetUnderTest) -> None:
    threads = fleet.fleet.threads
    for name in ("learner", "gateway", "replay", "reward", *fleet.actors()):
        environ = Path(f"/proc/{fleet.pid(name)}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().partition("=")[::2] for item in environ if item)
        expected = str(threads["actor" if name.startswith("actor-") else name])
        assert {env[key] for key in cores.THREAD_ENV} == {expected}, (name, threads)
    actors = len(fleet.actors())
    assert not cores.oversubscribed(threads, fleet.fleet.cores, actors) or threads["learner"] == threads["actor"] == 1


def test_chaos_kills_lose_and_duplicate_nothing(fleet: FleetUnderTest) -> None:
    fleet.scale_actors(3)
    rng = random.Random(2024)
    started = time.monotonic()
    run = fleet.submit("chaos", max_steps=CHAOS_STEPS, max_retries_per_episode=10)
    killed: dict[str, int] = {}
    actor_kills = 0
    next_actor_kill = started + ACTOR_KILL_EVERY_S
    while not (info := run.status()).done:
        assert time.monotonic() - started < 240, f"job stuck at {info.last}"
        step = info.last.step if info.last else 0
        for service, at_step in KILL_ONCE_AT_STEP.items():
            if service not in killed and step >= at_step:
                killed[service] = fleet.kill(service)
        if time.monotonic() >= next_actor_kill:
            serving = [name for name in fleet.actors() if fleet.serving(name, run.job_id)]
            if len(serving) >= 2:  # the last one serving is spared, so the job moves on between kills
                fleet.kill(rng.choice(serving))
                actor_kills += 1
            next_actor_kill = time.monotonic() + ACTOR_KILL_EVERY_S
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    assert set(killed) == set(KILL_ONCE_AT_STEP) and actor_kills >= 3
    assert all(fleet.restarts(service) >= 1 for service in killed)
    assert f"job {run.job_id} resumed from step" in fleet.log("learner")
    assert [m["step"] for m in fleet.metrics(run.job_id)] == list(range(1, CHAOS_STEPS + 1))
    fleet.stop_actors()
    print(f"chaos: {CHAOS_STEPS} steps in {elapsed:.1f}s, {actor_kills} actor kills, killed once: {sorted(killed)}")
    print("chaos replay counters:", json_format.MessageToJson(fleet.replay_stats(run.job_id), indent=None))
    # The ledger, not replay's counters: a learner that lost its job lease on a loaded box leaves trained groups
    # whose leases expired; their copies may later be dropped stale instead of committed, which replay's
    # balance alone would count against it.
    print("chaos ledger:", json.dumps(ledger(fleet, run.job_id, CHAOS_STEPS)))


def scored_rate(lineage: list[Any], start_ms: int, end_ms: int) -> float:
    """Groups per second whose rewards came back in (start_ms, end_ms]."""
    n = sum(start_ms < r.lineage.scored_unix_ms <= end_ms for r in lineage)
    return n / max(1e-3, (end_ms - start_ms) / 1000)


def test_live_scale_add_and_remove_an_actor(fleet: FleetUnderTest) -> None:
    fleet.scale_actors(0)
    # One task a round (round_tokens 0): a fixed-backend actor batching a round in one latency would outrun
    # the learner alone, and the test is about adding and removing the bottleneck while the job runs.
    with fleet.actor_env(FLEETRL_ACTOR_BACKEND="fixed", FLEETRL_ACTOR_FIXED_LATENCY_S=str(FIXED_LATENCY_S),
                         FLEETRL_ACTOR_ROUND_TOKENS="0"):
        (first,) = fleet.scale_actors(1)
        started = time.monotonic()
        run = fleet.submit("scale", max_steps=SCALE_STEPS)
        job = run.job_id
        wait_for(lambda: fleet.metrics(job), 120, "a first step with one actor")
        (added,) = set(fleet.scale_actors(2)) - {first}  # `fleetrl scale actor=2` mid-job
        wait_for(lambda: fleet.serving(added, job), 60, f"{added} serving")
        joined_ms, joined_count = now_ms(), fleet.replay_stats(job).inserted
        wait_for(lambda: fleet.replay_stats(job).inserted >= joined_count + GROUPS_WITH_TWO, 60, "groups from two")
        fleet.scale_actors(1)  # and back: the newest actor finishes its task and stops
        left_ms = now_ms()
        info = run.wait(timeout_s=120)
    elapsed = time.monotonic() - started
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    assert fleet.actors() == [first] and not fleet.alive(added)
    fleet.stop_actors()
    counts = ledger(fleet, job, SCALE_STEPS)  # every published task accounted for, end to end
    lineage = fleet.lineage(job)
    by_actor = {name: sorted(r.lineage.scored_unix_ms for r in lineage if r.lineage.actor_id == name)
                for name in (first, added)}
    assert by_actor[added] and by_actor[added][-1] <= left_ms + 1000 * (FIXED_LATENCY_S + 2)  # none after removal
    begin_ms, end_ms = by_actor[first][0], by_actor[first][-1]
    rates = [scored_rate(lineage, begin_ms, joined_ms), scored_rate(lineage, joined_ms, left_ms),
             scored_rate(lineage, left_ms + 2000, end_ms)]
    print(f"live scale: {SCALE_STEPS} steps in {elapsed:.1f}s; groups/s with 1, 2, then 1 actor(s): "
          + ", ".join(f"{r:.2f}" for r in rates) + f"; groups per actor: { {k: len(v) for k, v in by_actor.items()} }")
    print("live scale ledger:", json.dumps(counts))
    assert rates[1] >= 1.4 * rates[0] and rates[2] <= 0.8 * rates[1], rates


NATS_STEPS = 8


def test_nats_killed_mid_job_and_restarted(fleet: FleetUnderTest) -> None:
    """nats-server SIGKILLed while actors hold tasks and the learner feeds, restarted on the same port
    with the same data: no service is restarted by hand, the job succeeds and the ledger balances."""
    fleet.scale_actors(2)
    assert fleet.fleet.infra is not None
    nats = fleet.fleet.infra.nats
    run = fleet.submit("nats-kill", max_steps=NATS_STEPS)
    started = time.monotonic()
    restarts = {name: fleet.restarts(name) for name in fleet.fleet.supervisor.children}
    wait_for(lambda: (info := run.status()).last is not None and info.last.step >= 2, 120, "step 2")
    nats.kill()
    time.sleep(2.0)
    nats.start()
    info = run.wait(timeout_s=240)
    assert info.state == "succeeded", (info.reason, fleet.log("learner")[-3000:])
    assert "reconnected" in fleet.log("learner") and any("reconnected" in fleet.log(a) for a in fleet.actors())
    assert {name: fleet.restarts(name) for name in restarts} == restarts  # every service reconnected by itself
    fleet.stop_actors()
    counts = ledger(fleet, run.job_id, NATS_STEPS)
    print(f"nats kill: {NATS_STEPS} steps in {time.monotonic() - started:.1f}s, ledger: {json.dumps(counts)}")


def test_sweep_two_by_two_runs_four_jobs_and_leaves_nothing_running(fleet: FleetUnderTest, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetrl sweep` with a 2x2 grid: four jobs through the real services, one row each, none left running."""
    from fleetrl.launcher import main as fleetrl

    job_file = tmp_path / "job.toml"
    job_file.write_text(f'model = "tiny-llama"\nprompts = "{fleet.prompts}"\n[reward]\nbuiltin = "numeric_match"\n'
                        f'[eval]\nprompts = "{fleet.prompts}"\ninterval = 2\nproblems = 3\nsamples = 2\n'
                        'max_new_tokens = 4\n')  # held-out pass@k after step 2, by the learner
    sets = [arg for key, value in job_params(max_steps=2).items()
            for arg in ("--set", f"{FLAT_PARAMS.get(key, key)}={json.dumps(value)}")]
    fleet.scale_actors(0)
    with fleet.actor_env(FLEETRL_ACTOR_BACKEND="fixed", FLEETRL_ACTOR_FIXED_LATENCY_S="0.1"):
        fleet.scale_actors(2)
        code = fleetrl.main(["sweep", str(job_file), "--gateway", fleet.layout.addresses["gateway"], "--json",
                         "--grid", "optim.learning_rate=[1e-3, 5e-4]", "--grid", "algorithm.clip_eps=[0.2,0.3]",
                         "--name", "grid", "--poll", "0.3", "--timeout", "240", "--plot", str(tmp_path / "s.png"),
                         *sets])
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert code == 0, rows
    assert [r["params"] for r in rows] == [
        {"optim.learning_rate": lr, "algorithm.clip_eps": clip} for lr in (1e-3, 5e-4) for clip in (0.2, 0.3)]
    assert len({r["job_id"] for r in rows}) == 4
    for row in rows:
        assert row["state"] == "succeeded" and row["steps"] == 2 and row["final_reward"] is not None
        assert row["wall_s"] is not None and row["wall_s"] > 0
        assert row["pass_at_1"] is not None and 0 <= row["pass_at_1"] <= 1
        [last] = [m for m in fleet.metrics(row["job_id"]) if m["step"] == 2]
        assert last["eval_errors"] == 0 and last["eval_pass_at_1"] <= last["eval_pass_at_k"] and last["eval_s"] > 0
        job = fleet.client.get_job(row["job_id"])
        assert job.spec["optim"]["learning_rate"] == row["params"]["optim.learning_rate"]
        assert job.spec["algorithm"]["clip_eps"] == row["params"]["algorithm.clip_eps"]
        assert job.name.startswith("grid_learning_rate-")
    assert (tmp_path / "s.png").stat().st_size > 0
    mine = {r["job_id"] for r in rows}
    assert all(j.done for j in fleet.client.list_jobs(200) if j.job_id in mine)
    assert not [q for q in fleet.client.fleet().queues if q.job_id in mine]


def footprint_of(fleet: FleetUnderTest, job_id: str) -> retention.Footprint:
    assert fleet.fleet.infra is not None

    async def look() -> retention.Footprint:
        redis = aioredis.Redis.from_url(fleet.fleet.infra.valkey.url)  # type: ignore[union-attr]
        nc = await bus.connect(fleet.fleet.infra.nats.url, "footprint")  # type: ignore[union-attr]
        try:
            js = bus.jetstream(nc)
            return await retention.footprint(redis, js, fleet.run_dir, NatsTransport(nc, js), job_id)
        finally:
            await nc.close()
            await redis.aclose()

    return asyncio.run(look())


def delete_when_released(fleet: FleetUnderTest, job_id: str) -> DeletedInfo:
    """Delete the job once its learner has let go of it (its lease, released just after it succeeded)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return fleet.client.delete_job(job_id)
        except FleetError as error:
            assert grpc_code(error) == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline, error
            time.sleep(0.5)
