"""GPU placement of a local fleet: learner and actors on distinct devices when there are two or more."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fleetrl.launcher import devices
from fleetrl.launcher.cli import _up_parser, options_from
from fleetrl.launcher.fleet import SERVICES, Fleet, FleetLayout, FleetOptions


@pytest.mark.parametrize(("gpus", "learner", "actors"), [
    ([], "", ["", "", ""]),
    (["0"], "0", ["0", "0", "0"]),
    (["0", "1"], "0", ["1", "1", "1"]),
    (["3", "5", "7"], "3", ["5", "7", "5"]),
])
def test_learner_first_actors_on_the_others_in_turn(gpus: list[str], learner: str, actors: list[str]) -> None:
    assert devices.device_env("learner", gpus)["CUDA_VISIBLE_DEVICES"] == learner
    assert [devices.device_env("actor", gpus, i)["CUDA_VISIBLE_DEVICES"] for i in (1, 2, 3)] == actors
    for service in ("gateway", "replay", "reward"):
        assert devices.device_env(service, gpus) == {"CUDA_VISIBLE_DEVICES": ""}
    assert ("FLEETRL_ACTOR_DEVICE" in devices.device_env("actor", gpus, 1)) == bool(gpus)


def test_visible_gpus_follow_cuda_visible_devices_and_refuse_a_bad_list() -> None:
    assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    for bad in ("0,,1", "1,1"):
        with pytest.raises(ValueError, match="GPU list"):
            devices.parse_gpus(bad)


def test_the_flag_reaches_every_child(tmp_path: Path) -> None:
    args: argparse.Namespace = _up_parser("fleetrl up").parse_args(["--dir", str(tmp_path), "--gpus", "0,1,2"])
    fleet = Fleet(options_from(args))
    assert fleet.gpus == ["0", "1", "2"]
    fleet.layout = FleetLayout("nats://x", "redis://x", dict.fromkeys(SERVICES, "127.0.0.1:1"), {}, tmp_path, 1)
    assert fleet._env("learner", threads=1)["CUDA_VISIBLE_DEVICES"] == "0"
    assert fleet._env("actor", 2, threads=1)["CUDA_VISIBLE_DEVICES"] == "2"
    assert fleet._env("replay", threads=1)["CUDA_VISIBLE_DEVICES"] == ""
    assert Fleet(FleetOptions(run_dir=tmp_path, gpus=[])).gpus == []
    with pytest.raises(SystemExit):
        _up_parser("fleetrl up").parse_args(["--gpus", "0,0"])

