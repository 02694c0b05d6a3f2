"""The fleet's thread budget: the rule, its overrides, and the environment each child gets."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from fleetrl.launcher import cores
from fleetrl.launcher.cli import _up_parser, options_from
from fleetrl.launcher.fleet import Fleet, FleetOptions


@pytest.mark.parametrize(("cores_", "actors", "learner", "actor"), [
    (2, 1, 1, 1),
    (4, 1, 3, 1),
    (8, 1, 5, 3),
    (8, 2, 6, 1),
    (16, 2, 10, 3),
    (64, 4, 40, 6),
    (1, 0, 1, 1),
])
def test_learner_heavy_split_fills_the_cores(cores_: int, actors: int, learner: int, actor: int) -> None:
    threads = cores.budget(cores_, actors)
    assert (threads["learner"], threads["actor"]) == (learner, actor)
    assert threads["learner"] >= threads["actor"]
    assert threads["learner"] + actors * threads["actor"] == cores_
    assert not cores.oversubscribed(threads, cores_, actors)
    assert all(threads[name] == 1 for name in cores.SMALL_SERVICES)


def test_more_compute_processes_than_cores_get_one_thread_each_and_say_so() -> None:
    threads = cores.budget(2, 3)
    assert (threads["learner"], threads["actor"]) == (1, 1)
    assert cores.oversubscribed(threads, 2, 3)


def test_overrides_take_their_count_and_leave_the_rest() -> None:
    assert cores.budget(8, 2, learner_threads=2)["actor"] == 3
    assert cores.budget(8, 2, actor_threads=1)["learner"] == 6
    assert cores.budget(8, 2, learner_threads=7, actor_threads=7) == {
        "learner": 7, "actor": 7, "gateway": 1, "replay": 1, "reward": 1}
    assert cores.budget(2, 1, learner_threads=4)["actor"] == 1  # nothing left: still one


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="cores >= 1"):
        cores.budget(0, 1)


def test_thread_env_sets_every_pool_and_the_torch_setting_of_torch_services() -> None:
    assert cores.thread_env("learner", 3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3",
                                              "OPENBLAS_NUM_THREADS": "3", "FLEETRL_LEARNER_TORCH_THREADS": "3"}
    assert cores.thread_env("actor", 2)["FLEETRL_ACTOR_TORCH_THREADS"] == "2"
    assert cores.thread_env("replay", 1) == dict.fromkeys(cores.THREAD_ENV, "1")


def test_machine_cores_is_the_affinity_mask() -> None:
    assert 1 <= cores.machine_cores() <= (os.cpu_count() or 1)


def test_flags_reach_the_fleet_and_a_scaled_fleet_keeps_the_learners_threads(tmp_path: Path) -> None:
    args: argparse.Namespace = _up_parser("fleetrl up").parse_args(
        ["--dir", str(tmp_path), "--actors", "2", "--cores", "16", "--actor-threads", "2"])
    options = options_from(args)
    assert (options.cores, options.learner_threads, options.actor_threads) == (16, None, 2)
    fleet = Fleet(FleetOptions(run_dir=tmp_path, actors=2, cores=16))
    assert fleet.threads["learner"] == 10 and fleet.threads["actor"] == 3
    assert fleet._actor_threads(1) == 6 and fleet._actor_threads(6) == 1  # the learner's 10 stay its own
    with pytest.raises(SystemExit):
        _up_parser("fleetrl up").parse_args(["--learner-threads", "0"])


@pytest.mark.parametrize(("cores_", "actors", "mode", "learner", "actor"), [
    (2, 1, "lend", 2, 1),
    (8, 1, "lend", 8, 3),
    (8, 2, "lend", 8, 1),
    (2, 1, "turns", 2, 2),
    (8, 2, "turns", 8, 4),
    (2, 3, "turns", 2, 1),
])
def test_a_lending_learner_runs_on_every_core_and_yields_them(cores_: int, actors: int, mode: str, learner: int,
                                                              actor: int) -> None:
    threads = cores.budget(cores_, actors, mode=mode)
    assert (threads["learner"], threads["actor"]) == (learner, actor)
    # the learner runs at the lowest priority, so only the actors' threads count against the cores
    assert cores.oversubscribed(threads, cores_, actors, mode) == (actors > cores_)
    env = cores.thread_env("learner", threads["learner"], mode)
    assert env["FLEETRL_LEARNER_COMPUTE_NICE"] == str(cores.LENT_NICE)
    assert env["FLEETRL_LEARNER_TORCH_THREADS"] == env["OMP_NUM_THREADS"] == str(cores_)
    assert "FLEETRL_ACTOR_COMPUTE_NICE" not in cores.thread_env("actor", actor, mode)
    assert "FLEETRL_LEARNER_COMPUTE_NICE" not in cores.thread_env("learner", 1, "split")
    # processes that share cores wait passively; a split keeps OpenMP's default
    assert env["OMP_WAIT_POLICY"] == cores.thread_env("actor", actor, mode)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in cores.thread_env("learner", 1, "split")
    assert "OMP_WAIT_POLICY" not in cores.thread_env("reward", 1, mode)


def test_cores_mode_reaches_the_children_and_bad_modes_are_refused(tmp_path: Path) -> None:
    args = _up_parser("fleetrl up").parse_args(["--dir", str(tmp_path), "--actors", "1", "--cores", "4",
                                                "--cores-mode", "lend"])
    fleet = Fleet(options_from(args))
    assert fleet.threads["learner"] == 4 and fleet.threads["actor"] == 1
    assert fleet._actor_threads(2) == 1 and fleet._actor_threads(1) == 1  # the actors' share, as the rule gives it
    assert cores.budget(4, 1, learner_threads=2, mode="lend")["actor"] == 1  # a fixed learner count takes nothing
    with pytest.raises(SystemExit):
        _up_parser("fleetrl up").parse_args(["--cores-mode", "greedy"])
    with pytest.raises(ValueError, match="mode must be one of"):
        cores.budget(2, 1, mode="greedy")
