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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    """The fleet's services (not the one-shot `secrets`, which runs `fleetrl secrets` before NATS and Redis)."""
    services = yaml.safe_load(path.read_text())["services"]
    return {name: svc for name, svc in services.items() if svc.get("image", "").startswith("fleetrl")
            and name != "secrets"}


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


def mounted(service: dict[str, Any], root: Path, secrets: Path) -> Callable[[str], str]:
    """A container path of service as a path here: its bind mounts copied under root (so that a config
    file's relative includes resolve as they do in the container), the `secrets` volume as `secrets`."""
    places = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            here = root / target.lstrip("/")
            here.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / source, here)
            places[target] = here
        elif source == "secrets":
            (root / target.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / target.lstrip("/")).symlink_to(secrets)
            places[target] = root / target.lstrip("/")

    def here(path: str) -> str:
        for target, place in places.items():
            if path == target or path.startswith(target + "/"):
                return str(place) + path[len(target):]
        return path

    return here


def test_compose_nats_configuration_is_accepted_by_nats_server(tmp_path: Path) -> None:
    """The compose NATS service's command and config file (with the secrets it includes), checked by the
    real nats-server (`-t`)."""
    from fleetrl.launcher import credentials
    from fleetrl.launcher.embedded import nats_server_binary

    credentials.write_once(tmp_path / "secrets")
    nats = _services_of(ROOT / "docker-compose.yml")["nats"]
    here = mounted(nats, tmp_path / "nats", tmp_path / "secrets")
    command = [here(part) for part in nats["command"]]
    done = subprocess.run([nats_server_binary(), *command, "-t"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max_payload" in Path(command[command.index("-c") + 1]).read_text()


async def test_compose_nats_and_redis_refuse_a_client_without_the_secrets(tmp_path: Path) -> None:
    """NATS and Redis as compose runs them (their commands and files, the credentials `fleetrl secrets`
    wrote), on free ports here: a client without credentials is refused by both; the learner's settings
    from its compose environment (the credentials files) get in. Every fleetrl service that talks to NATS
    or Redis is given both files; the reward service, which runs user code, mounts no secrets."""
    import nats
    import nats.errors
    import redis.asyncio as aioredis
    import redis.exceptions

    from fleetrl.launcher import credentials
    from fleetrl.launcher.embedded import free_port, nats_server_binary, valkey_server_binary, wait_for_port
    from fleetrl.train.settings import LearnerSettings

    services = _services_of(ROOT / "docker-compose.yml")
    assert services["secrets"]["command"] == ["secrets", "/secrets"]
    for name, svc in _fleetrl_services(ROOT / "docker-compose.yml").items():
        env = svc.get("environment", {})
        prefix = f"FLEETRL_{name.upper()}_"
        for server in ("NATS", "REDIS"):
            if f"{prefix}{server}_URL" in env:
                assert env[f"{prefix}{server}_CREDENTIALS_FILE"] == f"/secrets/{server.lower()}", name
    assert not any(v.startswith("secrets:") for v in services["reward"]["volumes"])
    assert credentials.write_once(tmp_path / "secrets") and not credentials.write_once(tmp_path / "secrets")  # kept

    nats_port, monitor_port, redis_port = free_port(), free_port(), free_port()
    here = mounted(services["nats"], tmp_path / "nats", tmp_path / "secrets")
    nats_cmd = [nats_server_binary(), *[here(p) for p in services["nats"]["command"]], "-p", str(nats_port),
                "-m", str(monitor_port)]
    conf = Path(nats_cmd[nats_cmd.index("-c") + 1])  # the copy here: its data volume, /data, as a directory here
    conf.write_text(conf.read_text().replace("store_dir: /data", f"store_dir: {tmp_path / 'nats-data'}"))
    here = mounted(services["redis"], tmp_path / "redis", tmp_path / "secrets")
    redis_cmd = [valkey_server_binary(), *[here(p) for p in services["redis"]["command"][1:]], "--port",
                 str(redis_port), "--dir", str(tmp_path)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for cmd in (nats_cmd, redis_cmd)]
    try:
        for port, proc in zip((nats_port, redis_port), procs, strict=True):
            wait_for_port("127.0.0.1", port, 30, proc)
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(f"nats://127.0.0.1:{nats_port}", allow_reconnect=False, connect_timeout=5,
                               max_reconnect_attempts=0)
        stranger = aioredis.Redis.from_url(f"redis://127.0.0.1:{redis_port}/0")
        with pytest.raises(redis.exceptions.AuthenticationError):
            await stranger.ping()
        await stranger.aclose()

        env = services["learner"]["environment"]
        settings = LearnerSettings(
            nats_url=f"nats://127.0.0.1:{nats_port}", redis_url=f"redis://127.0.0.1:{redis_port}/0",
            nats_credentials_file=here(env["FLEETRL_LEARNER_NATS_CREDENTIALS_FILE"]),
            redis_credentials_file=here(env["FLEETRL_LEARNER_REDIS_CREDENTIALS_FILE"]))
        client = await nats.connect(settings.nats_url, allow_reconnect=False, connect_timeout=5)
        await client.close()
        member = aioredis.Redis.from_url(settings.redis_url)
        assert await member.ping()
        await member.aclose()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
