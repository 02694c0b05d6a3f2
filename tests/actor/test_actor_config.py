"""ActorSettings and the CLI: strict, layered defaults < TOML < environment < flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetrl.errors import ConfigError
from fleetrl.rollout.settings import ENV_PREFIX, ActorSettings
from fleetrl.services.actor.__main__ import main, parse_args, settings_from
from fleetrl.spec.config import load_settings


def test_layers_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "actor.toml"
    toml.write_text('backend = "hf"\nfetch_timeout_s = 2.0\nreplay_addr = "toml:1"\n')
    monkeypatch.setenv("FLEETRL_ACTOR_REPLAY_ADDR", "env:2")
    monkeypatch.setenv("FLEETRL_ACTOR_FETCH_TIMEOUT_S", "3.0")
    args = parse_args(["--config", str(toml), "--actor-id", "a-1", "--set", "fetch_timeout_s=4", "--nats-url",
                       "nats://x:1"])
    settings = settings_from(args)
    assert (settings.actor_id, settings.replay_addr, settings.fetch_timeout_s, settings.nats_url) == \
        ("a-1", "env:2", 4.0, "nats://x:1")
    assert ActorSettings().actor_id != ActorSettings().actor_id  # host-pid-random per process default


def test_typos_and_bad_values_name_the_field() -> None:
    with pytest.raises(ConfigError, match="fetch_timout_s"):
        load_settings(ActorSettings, env_prefix=ENV_PREFIX, overrides=["fetch_timout_s=1"], environ={})
    with pytest.raises(ConfigError, match="backend"):
        load_settings(ActorSettings, env_prefix=ENV_PREFIX, overrides=["backend=tgi"], environ={})
    assert main(["--set", "reward_timeout_s=-1"]) == 2
