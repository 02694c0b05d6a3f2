"""Observability of a whole traced fleet running a tiny job: one trace per trajectory, /metrics that
move, and `fleetrl top --once` over the real gateway. One fleet for the module (conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

import pytest
from obs_fleet import MAX_STEPS, MODEL, TracedFleet, scrape, total, wait_for

from fleetrl.launcher import main as cli
from fleetrl.replay.client import ReplayClient

pytestmark = pytest.mark.slow
CHAIN_SERVICES = {"learner", "actor", "reward", "replay"}


def _trajectory(spans: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The spans of the first trajectory the learner trained on, by name, once its trace is complete."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    for span in spans:
        if span["name"] == "learner.consume":
            named = {s["name"]: s for s in by_trace[span["trace_id"]]}
            if {"fleetrl.v1.RewardService/Score", "fleetrl.v1.ReplayService/Insert"} <= set(named):
                return named
    return None


def test_top_once_over_the_gateway(fleet: TracedFleet, capsys: pytest.CaptureFixture[str]) -> None:
    """While the job runs (its first step is done): the actor, the learner, the job and its queue."""
    job_id = fleet.run.job_id
    wait_for(lambda: any(m.kind == "learner" and m.policy_version >= 1 for m in fleet.client.fleet().members), 10,
             "the learner's heartbeat after its first step")
    # Beats are periodic: the actor's may still predate its first task when the learner's shows step 1.
    wait_for(lambda: any(m.member_id == "actor-1" and m.job_id == job_id for m in fleet.client.fleet().members), 10,
             "the actor's heartbeat naming the job")
    assert cli.main(["top", "--dir", str(fleet.run_dir), "--once", "--json"]) == 0
    frame = json.loads(capsys.readouterr().out)
    members = {m["member_id"]: m for m in frame["members"]}
    actor = members["actor-1"]
    assert actor["kind"] == "actor" and actor["job_id"] == job_id and actor["seen_unix_ms"] > 0
    assert actor["state"] in ("idle", "waiting_for_weights", "generating", "scoring", "inserting")
    [learner] = [m for m in frame["members"] if m["kind"] == "learner"]
    assert learner["job_id"] == job_id and learner["policy_version"] >= 1
    [job] = [j for j in frame["jobs"] if j["job_id"] == job_id]
    assert job["last"]["step"] >= 1 and "reward_mean" in job["last"]["values"]
    assert "staleness_mean" in job["last"]["values"]
    if job["state"] == "running":
        assert [q["job_id"] for q in frame["queues"]] == [job_id]
    [own] = frame["shares"]  # the one tenant of this fleet: no row for the others
    assert own["tenant"] == "local" and own["served_s"] > 0 and own["share"] == 1.0, own

    assert cli.main(["top", "--gateway", fleet.layout.addresses["gateway"], "--once"]) == 0
    text = capsys.readouterr().out
    for expected in ("actors", "learners", "jobs", "tenants", "actor-1", job_id, f"/{MAX_STEPS}"):
        assert expected in text, expected


def test_one_trace_runs_from_feeder_to_the_step_that_trained_it(finished: TracedFleet) -> None:
    trace = wait_for(lambda: _trajectory(finished.spans()), 20, "a complete trajectory trace")

    def parent(child: str, of: str) -> None:
        assert trace[child]["parent_id"] == trace[of]["span_id"], f"{child} is not a child of {of}"

    assert trace["feeder.publish"]["parent_id"] is None and trace["feeder.publish"]["scope"] == "fleetrl.feeder"
    parent("actor.task", "feeder.publish")
    for step in ("actor.fetch", "actor.ensure_weights", "actor.generate", "actor.score", "actor.insert"):
        parent(step, "actor.task")
    parent("fleetrl.v1.RewardService/Score", "actor.score")
    parent("fleetrl.v1.ReplayService/Insert", "actor.insert")
    parent("learner.sample", "actor.insert")
    parent("learner.consume", "learner.sample")
    assert {s["service"] for s in trace.values()} == CHAIN_SERVICES | {"learner"}
    assert {trace[n]["service"] for n in ("fleetrl.v1.RewardService/Score", "fleetrl.v1.ReplayService/Insert",
                                          "actor.task", "feeder.publish")} == {"reward", "replay", "actor", "learner"}
    step = trace["learner.consume"]["attributes"]["fleetrl.step"]
    assert 1 <= step <= MAX_STEPS
    steps = [s for s in finished.spans() if s["name"] == "learner.step" and s["attributes"]["fleetrl.step"] == step]
    assert len(steps) == 1 and steps[0]["parent_id"] is None  # the step itself is a trace of its own
    assert steps[0]["trace_id"] != trace["learner.consume"]["trace_id"]
    assert [(link["trace_id"], link["span_id"]) for link in trace["learner.consume"]["links"]] == [
        (steps[0]["trace_id"], steps[0]["span_id"])], "learner.consume does not link to the step that trained it"
    assert trace["fleetrl.v1.ReplayService/Insert"]["kind"] == "SERVER" and trace["actor.task"]["kind"] == "INTERNAL"
    assert {s["status"]["code"] for s in trace.values()} == {"UNSET"}  # nothing failed on this trajectory's path

    task_id = trace["feeder.publish"]["attributes"]["fleetrl.task_id"]
    records = asyncio.run(_lineage(finished.layout.addresses["replay"], finished.run.job_id))
    lineage = {r.task_id: r.lineage for r in records}[task_id]
    assert lineage.trace_id == trace["actor.task"]["trace_id"]
    assert lineage.span_id == trace["actor.insert"]["span_id"]


async def _lineage(addr: str, job_id: str) -> list[Any]:
    async with ReplayClient(addr) as replay:
        return await replay.query(job_id, limit=1000)


def test_every_service_serves_metrics_that_move(finished: TracedFleet) -> None:
    early, late = finished.early, finished.scrape_all()
    assert set(early) == {"gateway", "replay", "reward", "learner", "tinker", "actor-1"}
    job = finished.run.job_id
    moved = {
        "actor-1": ("fleetrl_actor_tasks_total", {"job": job}),
        "replay": ("fleetrl_replay_inserted_total", {"job": job}),
        "reward": ("fleetrl_reward_items_total", {"job": job}),
        "learner": ("fleetrl_learner_steps_total", {"job": job}),
        "gateway": ("grpc_server_handled_total", {"grpc_code": "OK"}),
    }
    for target, (name, labels) in moved.items():
        before, after = total(early[target], name, **labels), total(late[target], name, **labels)
        assert 0 < before < after, f"{target} {name}: {before} -> {after}"
    learner, actor = late["learner"], late["actor-1"]
    assert total(learner, "fleetrl_learner_staleness_versions_count") == MAX_STEPS * 2  # 2 groups per step
    for phase in ("wait_for_data", "forward_backward", "optimizer", "publish", "checkpoint"):
        assert total(learner, "fleetrl_learner_phase_seconds_count", phase=phase) == MAX_STEPS, phase
    assert total(learner, "fleetrl_learner_policy_version", job=job) == MAX_STEPS
    assert ("fleetrl_task_queue_pending", (("job", job),)) in learner
    assert total(actor, "fleetrl_actor_generated_tokens_total", job=job) > 0
    assert total(actor, "fleetrl_actor_weight_pull_bytes_total", job=job) > 0
    assert total(actor, "fleetrl_actor_policy_version", job=job) >= MAX_STEPS - 2  # step 4 trains v>=2 groups
    assert total(actor, "fleetrl_actor_info", actor_id="actor-1") == 1
    assert total(late["replay"], "grpc_server_handled_total", grpc_method="Insert", grpc_code="OK") > 0
    assert total(late["reward"], "fleetrl_reward_latency_seconds_count") > 0


def test_top_fails_cleanly_without_a_fleet(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["top", "--dir", str(tmp_path), "--once"]) == 1
    assert "no running fleet" in capsys.readouterr().out


def test_the_fleet_serves_the_tinker_api_to_the_official_sdk(fleet: TracedFleet) -> None:
    """`fleetrl up --tinker --tinker-on-actors MODEL --tinker-on-learner MODEL`: the official SDK, with any
    `tml-` key (open mode), gets the fleet's model allow-list, a sample of the base is served by the fleet's
    actor, and a training run lives on the fleet's learner beside its job, which publishes its sampler version
    for the actor to sample; the call is counted on the tinker service's /metrics and written as its span."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=f"http://{fleet.layout.addresses['tinker']}", api_key="tml-local")
    try:
        models = {m.model_name for m in service.get_server_capabilities().supported_models}
        sampler = service.create_sampling_client(base_model=MODEL)
        params = types.SamplingParams(max_tokens=4, seed=3, stop=[])
        result = sampler.sample(types.ModelInput.from_ints([1, 2, 3, 4]), 1, params).result(timeout=120)
        trainer = service.create_lora_training_client(base_model=MODEL, rank=4).result(timeout=120)
        tokens = list(range(10, 20))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:]})
        trainer.forward_backward([datum], "cross_entropy").result(timeout=120)
        step = trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
        trained = trainer.save_weights_and_get_sampling_client().result(timeout=120)  # published by the learner
        again = trained.sample(types.ModelInput.from_ints([1, 2, 3, 4]), 1, params).result(timeout=120)
    finally:
        service.close("success").result()
    assert step.metrics["step:max"] == 1.0 and len(again.sequences[0].tokens) == 4
    learner_log = fleet.fleet.supervisor.children["learner"].log_path.read_text(errors="replace")
    assert f"tinker training run {trainer.model_id}@" in learner_log
    assert f"sampler version {trainer.model_id}@" in learner_log  # the learner published it, not the service
    assert MODEL in models
    assert len(result.sequences) == 1 and len(result.sequences[0].tokens) == 4
    assert total(scrape(fleet.layout.metrics_ports["actor-1"]), "fleetrl_actor_tinker_samples_total",
                 outcome="served") == 2
    route = "/api/v1/get_server_capabilities"
    assert total(scrape(fleet.layout.metrics_ports["tinker"]), "fleetrl_tinker_http_seconds_count", route=route,
                 status="200") == 1
    assert wait_for(lambda: [s for s in fleet.spans() if s["service"] == "tinker" and s["name"] == f"GET {route}"],
                    30, "the call's span")
