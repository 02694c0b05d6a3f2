"""JobSpec validation names every bad field; settings load defaults < TOML < env < CLI."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
import pytest
from pydantic import BaseModel

from fleetrl.errors import ConfigError
from fleetrl.spec.config import InfraSettings, JobSpec, load_settings, parse_job_spec

GOOD = """
name = "addition"
model = "smollm2-135m"
prompts = "addition.jsonl"
seed = 3
[reward]
builtin = "numeric_match"
params = { format_weight = 0.5 }
[algorithm]
name = "dapo"
clip_eps = 0.2
clip_eps_high = 0.28
kl_coef = 0.01
kl_estimator = "k2"
[rollout]
prompts_per_step = 4
samples_per_prompt = 8
temperature = 0.9
[train]
max_steps = 30
max_staleness = 0
"""


def test_good_spec_parses_with_defaults_filled() -> None:
    spec = parse_job_spec(GOOD)
    assert spec.algorithm.name == "dapo" and spec.algorithm.kl_estimator == "k2"
    assert spec.rollout.samples_per_prompt == 8 and spec.optim.learning_rate == 1e-6
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ("[algorithm]\nname = 'sac'", "algorithm.name"),
        ("[algorithm]\nclip_eps = -0.1", "algorithm.clip_eps"),
        ("[algorithm]\nkl_estimator = 'k4'", "algorithm.kl_estimator"),
        ("[optim]\nlearning_rate = 0", "optim.learning_rate"),
        ("[optim]\nwarmup_steps = -1", "optim.warmup_steps"),
        ("[rollout]\nsamples_per_prompt = 0", "rollout.samples_per_prompt"),
        ("[rollout]\ntop_p = 1.5", "rollout.top_p"),
        ("[train]\nmax_staleness = -1", "train.max_staleness"),
        ("[train]\nmax_retries_per_episode = 0", "train.max_retries_per_episode"),
        ("[replay]\ncapacity_groups = 0", "replay.capacity_groups"),
        ("[replay]\nsampler = 'lifo'", "replay.sampler"),
        ("[train]\nbatch_size = 8", "train.batch_size"),
        ("[train]\npublish_interval = 4\nmax_staleness = 2", "train"),  # cross-field: staleness < interval - 1
        ("[train]\nfull_publish_interval = 4\n[train.lora]\nrank = 8", "train"),  # LoRA versions are adapters
    ],
)
def test_each_bad_field_is_named(patch: str, field: str) -> None:
    text = "prompts = 'p.jsonl'\n[reward]\nbuiltin = 'numeric_match'\n" + patch
    with pytest.raises(ConfigError) as info:
        parse_job_spec(text)
    assert [v.field for v in info.value.violations] == [field]


def test_all_mistakes_are_reported_at_once() -> None:
    text = "[reward]\nbuiltin = 'x'\nfile = 'y.py'\n[rollout]\ntemperature = 0\n[optim]\nlr = 1\n"
    with pytest.raises(ConfigError) as info:
        parse_job_spec(text)
    assert {v.field for v in info.value.violations} == {"prompts", "reward", "rollout.temperature", "optim.lr"}


def test_unparseable_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not parse"):
        parse_job_spec("name = ")


def test_settings_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('nats_url = "nats://toml:1"\nredis_url = "redis://toml:2"\nlog_level = "DEBUG"\n')
    env = {"FLEETRL_X_REDIS_URL": "redis://env:3", "FLEETRL_X_LOG_LEVEL": "WARNING", "FLEETRL_X_OTHER": "ignored"}
    settings = load_settings(
        InfraSettings, env_prefix="FLEETRL_X_", toml_path=toml, overrides=["log_level=ERROR"], environ=env
    )
    assert settings.nats_url == "nats://toml:1"
    assert settings.redis_url == "redis://env:3"
    assert settings.log_level == "ERROR"


def test_credentials_files_go_into_the_urls(tmp_path: Path) -> None:
    """A mounted secret's user and password end up in the URLs (every NATS server of a list, replacing any
    login there; Redis's default user as `:password@`); a missing or malformed file names its setting."""
    (tmp_path / "nats").write_text("fleetrl\npa/ss\n")
    (tmp_path / "redis").write_text("default\nsecret\n")
    env = {"FLEETRL_X_NATS_URL": "nats://old:login@a:1,nats://b:2",
           "FLEETRL_X_NATS_CREDENTIALS_FILE": str(tmp_path / "nats"),
           "FLEETRL_X_REDIS_CREDENTIALS_FILE": str(tmp_path / "redis")}
    settings = load_settings(InfraSettings, env_prefix="FLEETRL_X_", environ=env)
    assert settings.nats_url == "nats://fleetrl:pa%2Fss@a:1,nats://fleetrl:pa%2Fss@b:2"
    assert settings.redis_url == "redis://:secret@127.0.0.1:6379/0"
    with pytest.raises(ConfigError, match=r"redis_credentials_file .*missing: No such file"):
        load_settings(InfraSettings, env_prefix="FLEETRL_X_", environ={
            "FLEETRL_X_REDIS_CREDENTIALS_FILE": str(tmp_path / "missing")})
    (tmp_path / "bad").write_text("only-a-user\n")
    with pytest.raises(ConfigError, match=r"nats_credentials_file: .*a password on the second"):
        load_settings(InfraSettings, env_prefix="FLEETRL_X_", environ={
            "FLEETRL_X_NATS_CREDENTIALS_FILE": str(tmp_path / "bad")})


def test_bad_setting_names_the_field() -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        load_settings(InfraSettings, env_prefix="FLEETRL_X_", overrides=["metrics_port=70000"], environ={})


def bounded_field_cases(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted path, a value just outside the field's bounds or choices) for every bounded field."""
    cases: list[tuple[str, object]] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            cases += bounded_field_cases(kind, f"{path}.")
            continue
        for bound in info.metadata:
            if isinstance(bound, annotated_types.Ge):
                cases.append((path, bound.ge - 1))
            elif isinstance(bound, annotated_types.Gt):
                cases.append((path, bound.gt))
            elif isinstance(bound, annotated_types.Le):
                cases.append((path, bound.le + 1))
            elif isinstance(bound, annotated_types.Lt):
                cases.append((path, bound.lt))
        parts = [kind] if typing.get_origin(kind) is Literal else typing.get_args(kind)  # Literal, or a union
        if any(typing.get_origin(part) is Literal for part in parts):
            cases.append((path, "no-such-choice"))
    return cases


BOUNDED = bounded_field_cases()


def test_the_bounded_field_table_covers_the_spec() -> None:
    paths = {path for path, _ in BOUNDED}
    assert {"algorithm.entropy_coef", "algorithm.clip_eps_high", "algorithm.name", "train.epochs_per_step",
            "rollout.prompts_per_step", "rollout.max_new_tokens", "train.publish_interval",
            "train.checkpoint_interval", "train.timeout_per_step_s", "seed"} <= paths
    assert len(BOUNDED) > 40


@pytest.mark.parametrize(("path", "value"), BOUNDED, ids=[f"{p}={v}" for p, v in BOUNDED])
def test_every_bounded_field_names_itself_when_out_of_range(path: str, value: object) -> None:
    spec: dict[str, Any] = {"prompts": "p.jsonl", "reward": {"builtin": "numeric_match"}}
    *parents, leaf = path.split(".")
    node = spec
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    with pytest.raises(ConfigError) as info:
        parse_job_spec(json.dumps(spec), "json")
    assert path in [v.field for v in info.value.violations]


def test_betas_are_bounded() -> None:
    with pytest.raises(ConfigError) as info:
        parse_job_spec("prompts = 'p.jsonl'\n[reward]\nbuiltin = 'numeric_match'\n[optim]\nbetas = [0.9, 1.5]\n")
    assert [v.field for v in info.value.violations] == ["optim.betas"]
