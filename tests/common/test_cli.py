"""The `fleetrl` console entry, run as a real process: --help, version, and `infra up` / `infra down`."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import nats
import pytest
import redis

from fleetrl import __version__
from fleetrl.launcher import main as cli
from fleetrl.launcher.embedded import STATE_FILE, process_identity, read_state

ROOT = Path(__file__).resolve().parents[2]


def fleetrl(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetrl.launcher.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


def test_help_lists_every_subcommand() -> None:
    result = fleetrl("--help")
    assert result.returncode == 0, result.stderr
    for command in ("version", "infra", *cli.ROUTES):
        assert re.search(rf"^\s+{command}\s", result.stdout, re.MULTILINE), f"{command} missing from --help"


def test_help_imports_no_torch() -> None:
    code = ("import sys; from fleetrl.launcher import main as cli; cli.main(['--help']); "
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr


def test_installed_script_prints_the_package_version() -> None:
    script = Path(sys.executable).parent / "fleetrl"
    result = subprocess.run([str(script), "version"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fleetrl {__version__}"
    assert importlib.metadata.version("fleetrl") == __version__


def test_unknown_command_fails() -> None:
    result = fleetrl("no-such-command")
    assert result.returncode == 2
    assert "unknown command" in result.stderr


async def _jetstream_account_info(url: str) -> int:
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        info = await nc.jetstream(timeout=5).account_info()
        return int(info.streams)
    finally:
        await nc.close()


def _kill_recorded(state: dict[str, str]) -> None:
    for key in ("NATS", "VALKEY"):
        pid = int(state.get(f"{key}_PID", "0"))
        if pid and process_identity(pid) == state.get(f"{key}_PROCESS"):
            os.kill(pid, signal.SIGKILL)


def test_infra_up_detached_serves_nats_and_valkey_until_down(tmp_path: Path) -> None:
    run_dir = tmp_path / "infra"
    up = fleetrl("infra", "up", "--detach", "--dir", str(run_dir))
    state = read_state(run_dir)
    try:
        assert up.returncode == 0, up.stderr
        nats_url, redis_url = state["FLEETRL_LEARNER_NATS_URL"], state["FLEETRL_REPLAY_REDIS_URL"]
        nats_at = re.search(r"^NATS\s+(\S+)", up.stdout, re.MULTILINE)
        redis_at = re.search(r"^Valkey\s+(\S+)", up.stdout, re.MULTILINE)
        assert nats_at and redis_at, up.stdout
        assert nats_url.endswith("@" + nats_at[1]) and redis_url.endswith("@" + redis_at[1] + "/0"), state
        password = redis_url.split(":")[2].split("@")[0]  # redis://:<password>@host:port/0
        assert password and password not in up.stdout  # printed without the credentials the URLs carry

        assert redis.Redis.from_url(redis_url, socket_timeout=5).ping()
        assert asyncio.run(_jetstream_account_info(nats_url)) == 0

        again = fleetrl("infra", "up", "--detach", "--dir", str(run_dir))
        assert again.returncode == 1
        assert "already recorded" in again.stderr

        down = fleetrl("infra", "down", "--dir", str(run_dir))
        assert down.returncode == 0, down.stderr
        assert "stopped 2 server(s)" in down.stdout
        for key in ("NATS", "VALKEY"):
            assert process_identity(int(state[f"{key}_PID"])) is None, f"{key} still running"
        assert not (run_dir / STATE_FILE).exists()
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2).ping()
        assert fleetrl("infra", "down", "--dir", str(run_dir)).stdout.startswith("no servers recorded")
    finally:
        _kill_recorded(state)
