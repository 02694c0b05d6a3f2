"""docker-compose.yml agrees with the code: real entry points, real settings.

No Docker engine runs here, so this checks what can go stale: each fleetrl
service's command is a `fleetrl` subcommand, and every FLEETRL_<SERVICE>_<FIELD>
variable names a field of that service's settings model. Where a compose
binary exists, `config` validates the files too.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fleetrl.launcher.main import ROUTES

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "gateway": "fleetrl.services.gateway.config:GatewaySettings",
    "replay": "fleetrl.services.replay.config:ReplaySettings",
    "reward": "fleetrl.reward.settings:RewardSettings",
    "learner": "fleetrl.train.settings:LearnerSettings",
    "actor": "fleetrl.rollout.settings:ActorSettings",
    "tinker": "fleetrl.services.tinker.config:TinkerSettings",
}


def _settings_fields(service: str) -> set[str]:
    module, name = SETTINGS[service].split(":")
    return set(getattr(importlib.import_module(module), name).model_fields)


def _services_of(path: Path) -> dict[str, dict]:
    return yaml.safe_load(path.read_text())["services"]  # type: ignore[no-any-return]


def _fleetrl_services(path: Path) -> dict[str, dict]:
    services = yaml.safe_load(path.read_text())["services"]
    return {name: svc for name, svc in services.items() if svc.get("image", "").startswith("fleetrl")}


@pytest.mark.parametrize("compose", ["docker-compose.yml", "docker-compose.gpu.yml"])
def test_commands_and_environment_match_the_code(compose: str) -> None:
    base = _fleetrl_services(ROOT / "docker-compose.yml")
    services = base if compose == "docker-compose.yml" else yaml.safe_load((ROOT / compose).read_text())["services"]
    assert set(base) == set(SETTINGS)
    for name, svc in services.items():
        command = svc.get("command", base[name]["command"])
        assert command[0] in ROUTES and ROUTES[command[0]][0] == f"fleetrl.services.{name}.__main__", name
        prefix = f"FLEETRL_{name.upper()}_"
        fields = _settings_fields(name)
        for variable in svc.get("environment", {}):
            assert variable.startswith(prefix), variable
            assert variable[len(prefix):].lower() in fields, f"{variable} is not a setting of {name}"


def test_dockerfile_entrypoint_is_the_cli() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["fleetrl"]' in text
    assert 'fleetrl = "fleetrl.launcher.main:main"' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.skipif(not (shutil.which("docker-compose")), reason="docker-compose not installed")
def test_compose_config_validates() -> None:
    subprocess.run(["docker-compose", "-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml", "config", "-q"],
                   cwd=ROOT, check=True, timeout=60)


def test_compose_nats_configuration_is_accepted_by_nats_server() -> None:
    """The compose NATS service's command and config file, checked by the real nats-server (`-t`)."""
    from fleetrl.launcher.embedded import nats_server_binary

    nats = _services_of(ROOT / "docker-compose.yml")["nats"]
    command = list(nats["command"])
    mounted = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"] if v.startswith("./")}
    config = command[command.index("-c") + 1]
    command[command.index("-c") + 1] = str(ROOT / mounted[config])
    done = subprocess.run([nats_server_binary(), *command, "-t"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max_payload" in (ROOT / mounted[config]).read_text()
