"""Sweeps against a real gateway with no learner: the grid's jobs are submitted with their overrides and
stay queued, so waiting times out and cancelling leaves none of them queued. The whole 2x2 sweep that
runs to the end is in tests/fleet/test_fleet_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetrl.errors import ConfigError, DeadlineExceeded
from fleetrl.launcher import jobs_cli as cli
from fleetrl.sdk import sweep
from fleetrl.sdk.client import Client
from fleetrl.spec.config import apply_overrides
from tests.gateway.conftest import Proc
from tests.gateway.test_gateway_jobs import cli_run


def test_grid_parses_expands_and_round_trips_through_set() -> None:
    grid = sweep.parse_grid(["optim.learning_rate=[1e-6, 5e-6]", "algorithm.clip_eps=[0.2,0.3]",
                             'algorithm.name=["grpo"]'])
    combos = sweep.combinations(grid)
    assert len(combos) == 4 and combos[1] == {"optim.learning_rate": 1e-6, "algorithm.clip_eps": 0.3,
                                              "algorithm.name": "grpo"}
    for params in combos:  # what --set makes of the overrides is the value the grid named
        data = apply_overrides({}, sweep.overrides_of(params))
        assert (data["optim"]["learning_rate"], data["algorithm"]["clip_eps"], data["algorithm"]["name"]) == (
            params["optim.learning_rate"], params["algorithm.clip_eps"], "grpo")
    assert sweep.label(combos[0]) == "learning_rate=1e-06,clip_eps=0.2,name=grpo"


@pytest.mark.parametrize(("items", "field"), [
    (["optim.learning_rate=1e-6"], "optim.learning_rate=1e-6"),
    (["optim.learning_rate"], "optim.learning_rate"),
    (["=[1,2]"], "=[1,2]"),
    (["optim.learning_rate=[]"], "optim.learning_rate"),
    (["optim.learning_rate=[1, 1]"], "optim.learning_rate"),
    ([], "grid"),
    ([f"a.b={list(range(8))}", f"c.d={list(range(9))}"], "grid"),
])
def test_bad_grid_names_the_axis(items: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as bad:
        sweep.parse_grid(items)
    assert [v.field for v in bad.value.violations] == [field]


def test_sweep_submits_every_combination_then_times_out_and_cancels(client_for: Callable[..., Client],
                                                                      job_dir: Path) -> None:
    client = client_for("bob")
    grid = {"optim.learning_rate": [1e-5, 2e-5], "rollout.temperature": [0.5, 0.9]}
    run = client.sweep(grid, job_dir / "job.toml", overrides=["train.max_steps=3"], name="grid")
    jobs = [client.get_job(job_id) for job_id in run.job_ids]
    assert [(j.spec["optim"]["learning_rate"], j.spec["rollout"]["temperature"]) for j in jobs] == [
        (1e-5, 0.5), (1e-5, 0.9), (2e-5, 0.5), (2e-5, 0.9)]
    assert all(j.state == "queued" and j.spec["train"]["max_steps"] == 3 for j in jobs)
    assert [j.name for j in jobs][1] == "grid_learning_rate-1e-05_temperature-0.9"
    with pytest.raises(DeadlineExceeded, match="4 of 4 jobs still queued"):
        run.wait(timeout_s=0.5, poll_s=0.1)
    run.cancel()
    assert {client.get_job(job_id).state for job_id in run.job_ids} == {"cancelled"}
    assert run.wait(timeout_s=5)[0].state == "cancelled"


def test_a_bad_combination_cancels_what_was_submitted(client_for: Callable[..., Client], job_dir: Path) -> None:
    client = client_for("bob")
    before = {j.job_id for j in client.list_jobs(200)}
    with pytest.raises(ConfigError) as bad:  # the second temperature is refused by the gateway
        client.sweep({"rollout.temperature": [0.5, -1.0]}, job_dir / "job.toml")
    assert [v.field for v in bad.value.violations] == ["rollout.temperature"]
    new = [j for j in client.list_jobs(200) if j.job_id not in before]
    assert [j.state for j in new] == ["cancelled"]


def test_cli_sweep_json_times_out_and_cancels(gateway: Proc, job_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(cli_run(gateway, "sweep", str(job_dir / "job.toml"), "--grid", "optim.learning_rate=[1e-5,3e-5]",
                            "--timeout", "0.3", "--poll", "0.1", "--json"))
    assert code == 1
    err = json.loads(capsys.readouterr().err)
    assert err["code"] == "DEADLINE_EXCEEDED" and "2 of 2 jobs" in err["error"]
    assert cli.main(cli_run(gateway, "sweep", str(job_dir / "job.toml"), "--grid", "optim.learning_rate=1")) == 2
    assert "optim.learning_rate=1: expected key=[value, ...]" in capsys.readouterr().err


def test_table_puts_the_best_final_reward_first_and_dashes_what_is_missing() -> None:
    from rich.console import Console

    rows = [sweep.SweepRow({"optim.learning_rate": 1e-6}, "j-a", "succeeded", steps=4, final_reward=0.25, wall_s=12),
            sweep.SweepRow({"optim.learning_rate": 5e-6}, "j-b", "succeeded", steps=4, final_reward=0.5,
                           pass_at_1=0.4, wall_s=11),
            sweep.SweepRow({"optim.learning_rate": 1e-5}, "j-c", "failed", "diverged")]
    console = Console(width=200, record=True)
    console.print(cli.sweep_table(rows))
    lines = [line for line in console.export_text().splitlines() if "j-" in line]
    assert [line.split()[3] for line in lines] == ["j-b", "j-a", "j-c"]
    assert "0.400" in lines[0] and "failed (diverged)" in lines[2] and lines[2].count("-") >= 3
